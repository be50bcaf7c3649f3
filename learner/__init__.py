"""The off-policy learner: trajectories in, checkpoints out.

It reads ``openforge.trajectories.v1`` continuously, forms groups per task, drops samples that
are too stale, computes advantages, policy losses and rollout-correction weights with veRL's own
functions, steps AdamW on a Hugging Face model, and every K steps writes a safetensors checkpoint
and publishes a ``CheckpointV1`` that records the consumed offsets, so a restart resumes exactly.

Importing this package is cheap; torch, transformers and veRL load only when a worker or the
algorithms are used (install them with ``make learner``).
"""

from learner.settings import LearnerSettings

__all__ = ["LearnerSettings"]
