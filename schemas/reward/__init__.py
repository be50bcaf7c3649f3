"""Reward events (from the verifier). One module per major version."""
