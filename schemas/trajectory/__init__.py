"""Trajectory events (assembled training data). One module per major version."""
