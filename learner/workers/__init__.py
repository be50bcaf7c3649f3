"""Workers: what turns a :class:`~learner.protocol.TrainBatch` into an optimizer step on a model.

``hf`` runs a transformers model on one device (CPU here, one GPU elsewhere); ``fsdp`` runs the same
step on a model sharded with FSDP2 through veRL's fsdp helpers (one or many GPUs, or CPU with gloo).
Both sit behind :class:`PolicyWorker`, chosen by ``OPENFORGE_LEARNER_ENGINE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from learner.protocol import TrainBatch
from learner.settings import LearnerSettings

if TYPE_CHECKING:
    from learner.tensors import TensorBatch


class PolicyWorker(Protocol):
    """A trainable policy."""

    def train_step(self, batch: TrainBatch | TensorBatch) -> dict[str, float]:
        """Recompute logprobs, compute the loss, step the optimizer; return the step's metrics."""

    def save_serving(self, folder: Path) -> None:
        """Write what an engine loads into ``folder``: safetensors in the served dtype, config, tokenizer files."""

    def save_state(self, folder: Path) -> None:
        """Write master weights and optimizer state into ``folder`` (each rank its shards) to resume from."""

    def importance_weights(self) -> Sequence[float]:
        """The last step's per-token importance weights (a quantile sample of them; empty without correction)."""


def make_worker(settings: LearnerSettings, model_dir: Path) -> PolicyWorker:
    """The worker ``settings.engine`` names, loaded from ``model_dir`` (a model folder or a training state)."""
    if settings.engine == "fsdp":
        from learner.workers.fsdp import FSDPPolicyWorker

        return FSDPPolicyWorker(settings, model_dir)
    from learner.workers.hf import HFPolicyWorker

    return HFPolicyWorker(settings, model_dir)
