"""Workers: what turns a :class:`~learner.protocol.TrainBatch` into an optimizer step on a model.

``hf`` runs a transformers model on one device (CPU here, one GPU elsewhere); ``fsdp`` runs the same
step on a model sharded with FSDP2 through veRL's fsdp helpers (one or many GPUs, or CPU with gloo).
Both sit behind :class:`PolicyWorker`, chosen by ``OPENFORGE_LEARNER_ENGINE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from learner.protocol import TrainBatch
from learner.settings import LearnerSettings


class PolicyWorker(Protocol):
    """A trainable policy."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Recompute logprobs, compute the loss, step the optimizer; return the step's metrics."""

    def save(self, folder: Path) -> None:
        """Write weights (safetensors), config, tokenizer files and optimizer state into ``folder``."""

    def importance_weights(self) -> Sequence[float]:
        """The last step's per-token importance weights (a quantile sample of them; empty without correction)."""


def make_worker(settings: LearnerSettings, model_dir: Path) -> PolicyWorker:
    """The worker ``settings.engine`` names, loaded from ``model_dir`` (and its optimizer state, if saved)."""
    if settings.engine == "fsdp":
        from learner.workers.fsdp import FSDPPolicyWorker

        return FSDPPolicyWorker(settings, model_dir)
    from learner.workers.hf import HFPolicyWorker

    return HFPolicyWorker(settings, model_dir)
