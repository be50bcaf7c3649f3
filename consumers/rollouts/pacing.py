"""Pacing: start a rollout only while the learner can still train what it will produce.

The learner trains trajectories in the order they complete and masks tokens older than its
staleness bound ``b`` (in published versions). It publishes a version every ``K`` steps of ``g``
groups. A rollout started now is sampled by the version the engines serve, ``A``. It trains in time
when the learner reaches it before publishing version ``A + b + 1``: that is, within
``(A + b + 1) * K - (P * K + j)`` more steps, where ``P`` is the newest published version and ``j``
the steps taken since. Everything already in flight or waiting is trained first, so a rollout may
start only while

    in flight + waiting + 1 <= ((A + b + 1) * K - (P * K + j)) * g * group_size

With engines serving the newest version (``A = P``) and checkpoints every step (``K = 1``) this is
``(b + 1)`` learner batches, less the steps already taken. "Waiting" is the learner's own count of
trajectories it has read and not yet trained or dropped, plus the records of the trajectories topic
beyond its read position (counted by offset, so transaction markers make it an overestimate,
never an underestimate). A rollout that has ended but whose trajectory is not on the topic yet
(the assembler commits about once a second) is the one thing not counted.

The learner's numbers come from its progress notices and the served version from the publisher's
"applied" notices, both on the compacted checkpoints topic, so a launcher that starts reads the
current state at once. Until the learner has said anything, nothing is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from schemas import CheckpointAppliedV1, DecodeError, LearnerProgressV1, decode
from stream.admin import KafkaAdmin
from stream.lifecycle import Managed
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, MissingTopicsError, TopicRegistry

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
    """In flight plus waiting now."""
    served: int
    """The version engines serve (newest applied), as used."""
    published: int = 0
    """The learner's newest published version."""
    max_staleness: int = 0
    """The learner's staleness bound, in versions."""

    @property
    def engines_behind(self) -> bool:
        """Engines serve a version too old for anything they sample to train: no publisher applies new ones."""
        return self.published - self.served > self.max_staleness


def window(progress: LearnerProgressV1, served: int, group_size: int) -> int:
    """In flight plus waiting that can still train in time (see the module docstring)."""
    steps_left = ((min(served, progress.version) + progress.max_staleness + 1) * progress.checkpoint_every
                  - (progress.version * progress.checkpoint_every + progress.steps_since_checkpoint))
    return max(0, steps_left) * progress.groups_per_step * group_size


class Pace(Managed):
    """Follows the checkpoints topic for one model's learner and engines; answers how much may start."""

    def __init__(self, kafka: KafkaSettings, registry: TopicRegistry, model: str | None = None) -> None:
        """Pace by ``model``'s learner, or, when None, by every learner that reports (the tightest wins)."""
        self._kafka = kafka
        self._registry = registry
        self._model = model
        self._progress: dict[str, LearnerProgressV1] = {}
        self._served: dict[str, int] = {}
        kwargs = dict(**kafka.client_kwargs(), enable_auto_commit=False, group_id=None,
                      isolation_level="read_committed", request_timeout_ms=kafka.request_timeout_ms)
        self._follow = AIOKafkaConsumer(client_id=f"{kafka.client_id}-launcher-pace", **kwargs)
        # Its own client for end offsets: read_committed, so they are the last stable offsets.
        self._ends = AIOKafkaConsumer(client_id=f"{kafka.client_id}-launcher-ends", **kwargs)
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False

    async def start(self) -> None:
        """Read the checkpoints topic from its beginning (compacted: the current state), then follow it."""
        if self._started:
            return
        self._started = True
        topic = self._registry[CHECKPOINTS].name
        async with KafkaAdmin(self._kafka, self._registry) as admin:
            try:
                tps = await admin.partitions(topic)
            except KeyError:
                raise MissingTopicsError.of([topic], self._kafka.bootstrap_servers) from None
        await self._follow.start()
        await self._ends.start()
        self._follow.assign(tps)
        await self._follow.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._read(), name="launcher-pace")

    async def stop(self) -> None:
        """Stop following and close both clients. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._follow.stop()
        await self._ends.stop()

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

    async def room(self, group_size: int, in_flight: int) -> PaceWindow | None:
        """How many rollouts of a task with ``group_size`` may start; None until a learner reported."""
        if not self._progress:
            return None
        best: PaceWindow | None = None
        for model, progress in self._progress.items():
            served = self._served.get(model, 0)
            limit = window(progress, served, group_size)
            outstanding = in_flight + progress.pending + await self._unread(progress)
            pace = PaceWindow(max(0, limit - outstanding), limit, outstanding, served, progress.version,
                              progress.max_staleness)
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
