"""veRL's FSDP engine behind the learner's worker interface: not built yet.

What is missing: wrapping the model with veRL's FSDP engine (``verl.workers.engine``), a process
group per rank (NCCL on GPUs, gloo with a CPU platform shim for tests), sharded micro-batch
dispatch of :class:`~learner.protocol.TrainBatch`, and a full-state-dict gather before
``save_pretrained``. Until then ``OPENFORGE_LEARNER_ENGINE=fsdp`` fails at start with this message.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from learner.protocol import TrainBatch
from learner.settings import LearnerSettings

MISSING = (
    "the fsdp engine is not implemented yet: it needs veRL's FSDP engine wrapping, one process group per "
    "rank (NCCL, or gloo with a CPU platform shim), sharded micro-batch dispatch and a full-state-dict "
    "gather before saving; use OPENFORGE_LEARNER_ENGINE=hf"
)


class FSDPPolicyWorker:
    """Placeholder that names what the FSDP engine still needs."""

    def __init__(self, settings: LearnerSettings, model_dir: Path) -> None:
        raise NotImplementedError(MISSING)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Not implemented."""
        raise NotImplementedError(MISSING)

    def save(self, folder: Path) -> None:
        """Not implemented."""
        raise NotImplementedError(MISSING)

    def importance_weights(self) -> Sequence[float]:
        """Not implemented."""
        raise NotImplementedError(MISSING)
