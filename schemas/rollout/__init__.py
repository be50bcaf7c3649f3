"""Rollout lifecycle events. One module per major version."""
