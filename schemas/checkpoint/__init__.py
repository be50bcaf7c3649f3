"""Checkpoint events (new weights, and where they were applied). One module per major version."""
