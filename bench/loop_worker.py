"""The loop benchmark's learner worker: it sleeps for the step time a model predicts instead of training.

``bench.loop`` runs the real learner loop (grouping, staleness masking, batching, checkpoint and
publish cadence) with this worker in place of the ``hf`` one (``Learner(worker=...)``), so a step
takes as long as the real worker's would on the batch's tokens while the machine's cores stay free
for the rest of the loop. Its checkpoints are the initial model's files, written for real, so the
publisher checks and loads real folders.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from learner.protocol import TrainBatch
from learner.tensors import TensorBatch


@dataclass(frozen=True)
class StepTimeModel:
    """``seconds = a + b x tokens`` of one learner step, over every token of its rows."""

    a: float
    b: float
    source: str
    """Where it came from: measured on this machine, or given."""

    def seconds(self, tokens: int) -> float:
        """Predicted seconds of a step over ``tokens`` tokens."""
        return max(0.0, self.a + self.b * tokens)


@dataclass(frozen=True)
class Step:
    """One simulated step: wall-clock start and end (``time.time``), its tokens."""

    start: float
    end: float
    tokens: int
    """Every token of its rows (what the step time depends on)."""
    trained_tokens: int
    """Completion tokens it trained (loss mask 1)."""


@dataclass
class Timeline:
    """When the learner's worker was busy: steps and checkpoint saves (wall clock)."""

    steps: list[Step] = field(default_factory=list)
    saves: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Steps and saves are recorded from the learner's worker thread."""


class SimulatedWorker:
    """A :class:`~learner.workers.PolicyWorker` whose step is a sleep of the modelled length."""

    def __init__(self, model: StepTimeModel, model_dir: Path, timeline: Timeline) -> None:
        self.model = model
        self.model_dir = model_dir
        self.timeline = timeline

    def train_step(self, batch: TrainBatch | TensorBatch) -> dict[str, float]:
        """Sleep as long as the real step on ``batch`` would take; report a finite, empty step."""
        if not isinstance(batch, TrainBatch):
            raise TypeError("the simulated worker runs in one process, where steps come as rows")
        start = time.time()
        time.sleep(self.model.seconds(batch.total_tokens))
        with self.timeline.lock:
            self.timeline.steps.append(Step(start, time.time(), batch.total_tokens, batch.trained_tokens))
        return {"loss": 0.0, "grad_norm": 0.0, "updates": 1.0, "nonfinite_updates": 0.0}

    def save_serving(self, folder: Path) -> None:
        """Write the initial model's files into ``folder`` (weights, config, tokenizer)."""
        start = time.time()
        folder.mkdir(parents=True, exist_ok=True)
        for path in self.model_dir.iterdir():
            if path.is_file():
                shutil.copyfile(path, folder / path.name)
        with self.timeline.lock:
            self.timeline.saves.append((start, time.time()))

    def save_state(self, folder: Path) -> None:
        """Write a stand-in training state: nothing is trained, so there is nothing to resume."""
        start = time.time()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "simulated").write_text("the benchmark's simulated worker trains nothing\n")
        with self.timeline.lock:
            self.timeline.saves.append((start, time.time()))

    def importance_weights(self) -> Sequence[float]:
        """None: nothing is recomputed, so there is nothing to correct."""
        return ()
