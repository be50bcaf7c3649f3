"""Rollout launching: one task becomes ``group_size`` rollouts on a backend (Kubernetes or local)."""
