"""Learner step events (what one optimizer step trained on). One module per major version."""
