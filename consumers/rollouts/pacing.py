"""Pacing: start a rollout only while the learner can still train what it will produce.

The learner trains trajectories in the order they complete and masks tokens older than its
staleness bound ``b`` (in published versions). It publishes a version every ``K`` steps of ``g``
groups. A rollout started now is sampled by the version the engines serve, ``A``. It trains in time
when the learner reaches it before publishing version ``A + b + 1``: that is, within
``(A + b + 1) * K - (P * K + j)`` more steps, where ``P`` is the newest published version and ``j``
the steps taken since. Everything already outstanding is trained first, so a rollout may start
only while

    outstanding + 1 <= ((A + b + 1) * K - (P * K + j)) * g * group_size

With engines serving the newest version (``A = P``) and checkpoints every step (``K = 1``) this is
``(b + 1)`` learner batches, less the steps already taken. "Outstanding" is every rollout between
its launch and its training: running (the backend's active rollouts); ended but with its
trajectory not on the trajectories topic yet (the assembler waits a grace period for late calls,
then commits: seconds); on the topic beyond the learner's read position (counted by offset, so
transaction markers make it an overestimate, never an underestimate); and read by the learner but
not yet trained or dropped (its own count). The second kind is known only for the rollouts this
launcher started: it follows the trajectories topic's keys (task ids) and counts, per task, the
rollouts that ended against the trajectories that arrived.

The learner's numbers come from its progress notices and the served version from the publisher's
"applied" notices, both on the compacted checkpoints topic, so a launcher that starts reads the
current state at once. Until the learner has said anything, nothing is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from schemas import CheckpointAppliedV1, DecodeError, LearnerProgressV1, decode
from stream.admin import KafkaAdmin
from stream.lifecycle import Managed
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, TRAJECTORIES, MissingTopicsError, TopicRegistry

__all__ = ["Pace", "PaceWindow", "window"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PaceWindow:
    """How many more rollouts may start now, and the numbers that decided it (for logs)."""

    room: int
    """Rollouts that may start (never negative)."""
    limit: int
    """In flight plus waiting that the learner can still train in time."""
    outstanding: int
    """Rollouts launched and not yet trained or dropped, now."""
    served: int
    """The version engines serve (newest applied), as used."""
    in_transit: int = 0
    """Of the outstanding: ended, with their trajectories not on the topic yet."""
    published: int = 0
    """The learner's newest published version."""
    max_staleness: int = 0
    """The learner's staleness bound, in versions."""

    @property
    def engines_behind(self) -> bool:
        """Engines serve a version too old for anything they sample to train: no publisher applies new ones."""
        return self.published - self.served > self.max_staleness


@dataclass
class _Launched:
    """A task's rollouts this launcher started, and what became of them."""

    rollouts: list[str] = field(default_factory=list)
    ended: dict[str, float] = field(default_factory=dict)
    """Rollout id -> when it was first seen no longer active."""
    arrived: int = 0
    """The task's trajectories seen on the topic since."""


def window(progress: LearnerProgressV1, served: int, group_size: int) -> int:
    """In flight plus waiting that can still train in time (see the module docstring)."""
    steps_left = ((min(served, progress.version) + progress.max_staleness + 1) * progress.checkpoint_every
                  - (progress.version * progress.checkpoint_every + progress.steps_since_checkpoint))
    return max(0, steps_left) * progress.groups_per_step * group_size


class Pace(Managed):
    """Answers how many rollouts may start, from the learner's and the engines' notices.

    It follows the checkpoints topic for the learner's progress and the engines' versions, and the
    trajectories topic's keys for the rollouts the launcher started and that have ended.
    """

    def __init__(self, kafka: KafkaSettings, registry: TopicRegistry, model: str | None = None, *,
                 transit_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        """Pace by ``model``'s learner, or, when None, by every learner that reports (the tightest wins).

        A rollout that ended counts as outstanding until its trajectory arrives, or for
        ``transit_timeout_s`` at most (a trajectory the assembler could not publish never arrives).
        """
        self._kafka = kafka
        self._registry = registry
        self._model = model
        self._transit_timeout_s = transit_timeout_s
        self._clock = clock
        self._progress: dict[str, LearnerProgressV1] = {}
        self._served: dict[str, int] = {}
        self._launched: dict[str, _Launched] = {}
        kwargs = dict(**kafka.client_kwargs(), enable_auto_commit=False, group_id=None,
                      isolation_level="read_committed", request_timeout_ms=kafka.request_timeout_ms)
        self._follow = AIOKafkaConsumer(client_id=f"{kafka.client_id}-launcher-pace", **kwargs)
        # Its own client for end offsets: read_committed, so they are the last stable offsets.
        self._ends = AIOKafkaConsumer(client_id=f"{kafka.client_id}-launcher-ends", **kwargs)
        # Only keys are looked at; values are fetched (Kafka has no key-only fetch) and dropped.
        self._arrivals = AIOKafkaConsumer(
            client_id=f"{kafka.client_id}-launcher-arrivals",
            max_partition_fetch_bytes=registry[TRAJECTORIES].spec.max_message_bytes, **kwargs)
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._stopped = False

    async def start(self) -> None:
        """Read the checkpoints topic from its beginning (compacted: the current state), then follow it."""
        if self._started:
            return
        self._started = True
        topic, trajectories = self._registry[CHECKPOINTS].name, self._registry[TRAJECTORIES].name
        async with KafkaAdmin(self._kafka, self._registry) as admin:
            try:
                tps = await admin.partitions(topic)
                arrival_tps = await admin.partitions(trajectories)
            except KeyError:
                raise MissingTopicsError.of([topic, trajectories], self._kafka.bootstrap_servers) from None
        await self._follow.start()
        await self._ends.start()
        await self._arrivals.start()
        self._follow.assign(tps)
        await self._follow.seek_to_beginning(*tps)
        # Only trajectories of rollouts launched from now on matter.
        self._arrivals.assign(arrival_tps)
        for tp, end in (await self._arrivals.end_offsets(arrival_tps)).items():
            self._arrivals.seek(tp, end)
        self._tasks = [asyncio.create_task(self._read(), name="launcher-pace"),
                       asyncio.create_task(self._read_arrivals(), name="launcher-pace-arrivals")]

    async def stop(self) -> None:
        """Stop following and close the clients. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._follow.stop()
        await self._ends.stop()
        await self._arrivals.stop()

    async def _read(self) -> None:
        while True:
            batches = await self._follow.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    try:
                        event = decode(tuple(record.headers or ()), record.value)
                    except DecodeError:
                        continue  # the publisher and learner dead-letter what they cannot read
                    self.observe(event)

    async def _read_arrivals(self) -> None:
        while True:
            batches = await self._arrivals.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    self.arrived(record.key.decode("utf-8", "replace") if record.key is not None else "")

    def launched(self, task_id: str, rollout_id: str) -> None:
        """Note a rollout this launcher started, to count it after it ends until its trajectory arrives."""
        self._launched.setdefault(task_id, _Launched()).rollouts.append(rollout_id)

    def arrived(self, task_id: str) -> None:
        """Note a trajectory of ``task_id`` on the trajectories topic (its key)."""
        launched = self._launched.get(task_id)
        if launched is not None:
            launched.arrived += 1

    def in_transit(self, active: set[str]) -> int:
        """Rollouts this launcher started that ended (are not in ``active``) and whose trajectories have not arrived."""
        now = self._clock()
        total = 0
        for task_id, launched in list(self._launched.items()):
            if launched.arrived >= len(launched.rollouts):
                del self._launched[task_id]
                continue
            for rollout_id in launched.rollouts:
                if rollout_id not in active:
                    launched.ended.setdefault(rollout_id, now)
            # Trajectories arrive in no particular order within a task: the oldest endings are the
            # ones taken as arrived, and an ending older than the timeout no longer counts.
            waiting = sorted(launched.ended.values())[launched.arrived:]
            total += sum(1 for ended in waiting if now - ended < self._transit_timeout_s)
        return total

    def observe(self, event: object) -> None:
        """Take in one event of the checkpoints topic."""
        if isinstance(event, LearnerProgressV1):
            if self._model is None or event.model == self._model:
                self._progress[event.model] = event
        elif isinstance(event, CheckpointAppliedV1) and event.ok:
            self._served[event.model] = max(self._served.get(event.model, 0), event.version)

    @property
    def min_group_size(self) -> int | None:
        """The largest ``min_group_size`` of the learners paced by (None until one reported)."""
        return max((p.min_group_size for p in self._progress.values()), default=None)

    async def room(self, group_size: int, active: set[str]) -> PaceWindow | None:
        """How many rollouts of a task with ``group_size`` may start; None until a learner reported.

        Args:
            group_size: The task's group size (the window is counted in its rollouts).
            active: The backend's rollouts that are running now.
        """
        if not self._progress:
            return None
        in_transit = self.in_transit(active)
        best: PaceWindow | None = None
        for model, progress in self._progress.items():
            served = self._served.get(model, 0)
            limit = window(progress, served, group_size)
            outstanding = len(active) + in_transit + progress.pending + await self._unread(progress)
            pace = PaceWindow(max(0, limit - outstanding), limit, outstanding, served, in_transit,
                              progress.version, progress.max_staleness)
            if best is None or pace.room < best.room:
                best = pace
        return best

    async def _unread(self, progress: LearnerProgressV1) -> int:
        """Trajectory records beyond the learner's read position (by offset: an overestimate)."""
        read = {TopicPartition(o.topic, o.partition): o.offset for o in progress.read_offsets}
        if not read:
            return 0
        ends = await self._ends.end_offsets(list(read))
        return sum(max(0, ends[tp] - offset) for tp, offset in read.items())
