"""Several ranks under ``torchrun``: rank 0 runs the learner's loop, the other ranks follow its orders.

Only rank 0 talks to Kafka (reads trajectories, resumes from the newest checkpoint event, writes
checkpoint folders and publishes their events): a second reader would train every trajectory
twice and a second publisher would announce every checkpoint twice. The other ranks hold shards
of the model, so they must enter the same collectives in the same order as rank 0: rank 0
broadcasts an :class:`Order` before each one (load this folder, train this batch, publish serving
weights, save a training state), and the followers do exactly what it says until it says stop.

Orders travel with ``broadcast_object_list`` on a gloo group (the default group itself on CPU, a
gloo side group next to NCCL on GPUs), because they are Python objects and a follower waits for
them on the host. A step's batch follows its order as tensors
(:meth:`~learner.tensors.TensorBatch.broadcast`), not pickled lists. While no batch is due rank 0
sends a keep-alive, so the process group's timeout
(``OPENFORGE_LEARNER_RANK_TIMEOUT_S``) can stay short enough to turn a dead or hung peer into an
error on the others instead of a process that waits forever.

Torch is imported only when there are several ranks: the one-process learner never touches this.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from learner.settings import LearnerSettings

if TYPE_CHECKING:
    from learner.protocol import TrainBatch
    from learner.tensors import TensorBatch

logger = logging.getLogger(__name__)

OrderKind = Literal["start", "step", "publish", "save_state", "idle", "stop", "abort"]


@dataclass(frozen=True)
class Order:
    """What rank 0 tells the other ranks to do next."""

    kind: OrderKind
    """``start`` (load ``model_dir``), ``step`` (train ``batch``), ``publish`` (take part in writing
    the serving weights of ``version``), ``save_state`` (write this rank's shards of the training
    state into ``folder``), ``idle`` (keep-alive), ``stop`` (leave cleanly), ``abort`` (leave with
    an error)."""
    model_dir: str | None = None
    batch: TrainBatch | TensorBatch | None = None
    """Sent as tensors after the order itself, never pickled; the other ranks receive a :class:`TensorBatch`."""
    version: int = 0
    folder: str | None = None
    reason: str = ""


def launched_world_size() -> int:
    """How many ranks the launcher started (``WORLD_SIZE``, torchrun's contract); 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Ranks:
    """This process's place among the ranks and rank 0's channel of orders to the others."""

    def __init__(self, rank: int, world_size: int, group: Any, owns_group: bool, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._owns_group = owns_group
        self.keepalive_s = timeout_s / 4
        """Rank 0 sends ``idle`` when it sent nothing for this long (a quarter of the timeout)."""

    @property
    def leader(self) -> bool:
        """Rank 0: the only rank that reads Kafka, writes files and publishes."""
        return self.rank == 0

    @classmethod
    def join(cls, settings: LearnerSettings) -> Ranks:
        """Join the launcher's process group (blocks until every rank joined).

        Raises:
            ValueError: the engine cannot shard over several ranks (only ``fsdp`` can).
        """
        world = launched_world_size()
        if settings.engine != "fsdp":
            raise ValueError(f"{world} ranks were launched but the {settings.engine!r} engine trains in one "
                             "process; set OPENFORGE_LEARNER_ENGINE=fsdp or launch one process")
        import torch
        import torch.distributed as dist

        from learner.workers.fsdp import ensure_process_group

        timeout = timedelta(seconds=settings.rank_timeout_s)
        owns = ensure_process_group(torch.device(settings.device).type, timeout)
        # NCCL cannot carry host objects; a gloo group beside it carries the orders.
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        ranks = cls(dist.get_rank(), dist.get_world_size(), group, owns, settings.rank_timeout_s)
        logger.info("rank %d of %d joined (%s); %s", ranks.rank, ranks.world_size, dist.get_backend(),
                    "reading Kafka and publishing" if ranks.leader else "following rank 0")
        return ranks

    def send(self, order: Order) -> None:
        """Rank 0: broadcast ``order`` to the other ranks (blocks until they can receive it)."""
        import torch.distributed as dist

        if order.kind == "step" and order.batch is None:
            raise ValueError("a step order needs its batch")
        dist.broadcast_object_list([replace(order, batch=None)], src=0, group=self._group)
        if order.batch is not None:
            from learner.tensors import TensorBatch

            TensorBatch.of(order.batch).broadcast(self._group)

    def receive(self) -> Order:
        """Other ranks: wait for rank 0's next order (fails after the group's timeout or when rank 0 died)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        order = box[0]
        if not isinstance(order, Order):
            raise RuntimeError(f"rank 0 sent {type(order).__name__}, not an order")
        if order.kind == "step":
            from learner.tensors import TensorBatch

            order = replace(order, batch=TensorBatch.receive(self._group))
        return order

    def close(self) -> None:
        """Leave the process group if this process created it."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
