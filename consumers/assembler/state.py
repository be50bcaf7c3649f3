"""Per-rollout join state: dedupe, out-of-order arrival, finalize decisions, low watermarks.

Pure and clocked by the caller (``now`` is a monotonic time in seconds), so every timing rule is
unit-tested without Kafka or sleeping. The service feeds it records and publishes what
:meth:`RolloutTable.due` hands back.

Lifecycle of one rollout here:

* **open** from its first event (any of call, lifecycle, reward, in any order). Events are
  deduplicated by ``event_id``; a second reward or terminal event keeps the first.
* **finalized** by :meth:`RolloutTable.due` when the terminal lifecycle event and the reward are
  in and ``grace_s`` passed since the last event (so a call that the proxy spooled, arriving just
  after the terminal event, still joins); or by a timeout, with a :class:`FinalizeReason` that
  says which one. Its outcome is judged by :func:`schemas.failures.classify` (the trajectory's
  ``failure_reason`` and ``infrastructure_failure``).
* **closed** for ``closed_retention_s`` afterwards: its events' offsets still hold the low
  watermark, so a restart re-reads the whole rollout rather than only its tail, and a new event
  for it is a *late* event (the service counts and dead-letters it).
* **remembered** by id only (bounded): a later event is still recognised as late.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from aiokafka.structs import TopicPartition

from consumers.assembler.samples import BuiltSamples, build_samples, order_calls
from consumers.assembler.tools import ToolErrorRules, annotate_tool_use
from schemas import EventBase, ModelCallV1, RewardV1, RolloutEventV1
from schemas.failures import classify
from schemas.rollout.v1 import RolloutPhase
from schemas.trajectory.v1 import FinalizeReason, MergeStats, TrajectoryV1

__all__ = ["FinalizePolicy", "Finalized", "Outcome", "RolloutTable", "trajectory_id_for"]

logger = logging.getLogger(__name__)

_TRAJECTORY_NAMESPACE = uuid.UUID("5b0f6c1e-9a43-4a8e-8f0e-4f70656e466f")


def trajectory_id_for(rollout_id: str) -> str:
    """The trajectory id of a rollout: deterministic, so any copy published twice is recognisable."""
    return uuid.uuid5(_TRAJECTORY_NAMESPACE, rollout_id).hex


class Outcome(StrEnum):
    """What the table did with one event."""

    ACCEPTED = "accepted"
    """Joined its rollout's open state."""
    DUPLICATE = "duplicate"
    """Same ``event_id`` seen before for this rollout (or a second reward); ignored."""
    LATE = "late"
    """The rollout was already finalized by this process; the event missed its trajectory."""
    REPLAYED = "replayed"
    """The rollout's trajectory was published before a restart; re-reading it changes nothing."""


@dataclass(frozen=True)
class FinalizePolicy:
    """When open rollouts are closed (see :class:`~consumers.assembler.settings.AssemblerSettings`)."""

    grace_s: float = 2.0
    reward_timeout_s: float = 300.0
    lifecycle_timeout_s: float = 3600.0
    closed_retention_s: float = 60.0
    max_open_rollouts: int = 100_000
    remembered_finalized: int = 200_000


@dataclass(frozen=True)
class Finalized:
    """A trajectory ready to publish, with the merge details behind it (for metrics)."""

    trajectory: TrajectoryV1
    built: BuiltSamples


@dataclass
class _Open:
    rollout_id: str
    opened_at: float
    last_event_at: float
    calls: list[ModelCallV1] = field(default_factory=list)
    lifecycle: list[RolloutEventV1] = field(default_factory=list)
    terminal: RolloutEventV1 | None = None
    reward: RewardV1 | None = None
    event_ids: set[str] = field(default_factory=set)
    first_offsets: dict[TopicPartition, int] = field(default_factory=dict)


@dataclass
class _Closed:
    closed_at: float
    event_ids: set[str]
    first_offsets: dict[TopicPartition, int]


class RolloutTable:
    """All rollouts one assembler instance is joining, keyed by rollout id."""

    def __init__(self, policy: FinalizePolicy | None = None, tool_rules: ToolErrorRules | None = None) -> None:
        self.policy = policy or FinalizePolicy()
        self.tool_rules = tool_rules or ToolErrorRules.of()
        self._open: dict[str, _Open] = {}  # insertion order = open order, for eviction
        self._closed: dict[str, _Closed] = {}
        self._remembered: OrderedDict[str, bool] = OrderedDict()  # rollout id -> published before a restart

    @property
    def open_count(self) -> int:
        """Rollouts waiting to be finalized."""
        return len(self._open)

    def finished(self, rollout_id: str) -> bool:
        """Whether the rollout was finalized (its later events are duplicates, replays or late)."""
        return rollout_id in self._closed or rollout_id in self._remembered

    def call(self, rollout_id: str, call_id: str) -> ModelCallV1 | None:
        """A call of an open rollout, as joined (its prompt whole), if it was read."""
        state = self._open.get(rollout_id)
        calls = state.calls if state is not None else ()
        return next((call for call in reversed(calls) if call.call_id == call_id), None)

    def add(self, event: EventBase, tp: TopicPartition, offset: int, now: float) -> Outcome:
        """Join one call, lifecycle or reward event read at ``tp``/``offset``.

        Raises:
            TypeError: The event is none of the three kinds the assembler reads.
        """
        if not isinstance(event, ModelCallV1 | RolloutEventV1 | RewardV1):
            raise TypeError(f"the assembler does not join {type(event).__name__} events")
        rollout_id = event.rollout_id
        closed = self._closed.get(rollout_id)
        if closed is not None:
            return Outcome.DUPLICATE if event.event_id in closed.event_ids else Outcome.LATE
        if rollout_id in self._remembered:
            return Outcome.REPLAYED if self._remembered[rollout_id] else Outcome.LATE
        state = self._open.get(rollout_id)
        if state is None:
            state = self._open[rollout_id] = _Open(rollout_id, opened_at=now, last_event_at=now)
        if event.event_id in state.event_ids:
            return Outcome.DUPLICATE
        if isinstance(event, RewardV1) and state.reward is not None:
            if event.value != state.reward.value:
                logger.warning("rollout %s: second reward %s ignored; keeping the first, %s",
                               rollout_id, event.value, state.reward.value)
            return Outcome.DUPLICATE
        state.event_ids.add(event.event_id)
        state.first_offsets.setdefault(tp, offset)
        state.last_event_at = now
        if isinstance(event, ModelCallV1):
            state.calls.append(event)
        elif isinstance(event, RewardV1):
            state.reward = event
        else:
            state.lifecycle.append(event)
            if event.is_terminal and state.terminal is None:
                state.terminal = event
        return Outcome.ACCEPTED

    def remember_published(self, rollout_ids: Iterable[str]) -> None:
        """Mark rollouts whose trajectories are already on the topic (read back after a restart)."""
        for rollout_id in rollout_ids:
            if rollout_id not in self._open and rollout_id not in self._closed:
                self._remember(rollout_id, published_before_restart=True)

    def due(self, now: float) -> list[Finalized]:
        """Finalize every open rollout whose time has come; expire closed ones.

        The returned rollouts move to the closed state at once: the caller must publish them
        (or crash, after which they are rebuilt from Kafka).
        """
        ready: list[tuple[_Open, FinalizeReason]] = []
        for state in self._open.values():
            reason = self._reason(state, now)
            if reason is not None:
                ready.append((state, reason))
        overflow = len(self._open) - len(ready) - self.policy.max_open_rollouts
        if overflow > 0:
            chosen = {id(state) for state, _ in ready}
            oldest = [s for s in self._open.values() if id(s) not in chosen][:overflow]
            ready.extend((state, FinalizeReason.EVICTED) for state in oldest)
        finalized = []
        for state, reason in ready:
            del self._open[state.rollout_id]
            self._closed[state.rollout_id] = _Closed(now, state.event_ids, state.first_offsets)
            finalized.append(_finalize(state, reason, self.tool_rules))
        expiry = now - self.policy.closed_retention_s
        for rollout_id in [r for r, c in self._closed.items() if c.closed_at <= expiry]:
            del self._closed[rollout_id]
            self._remember(rollout_id, published_before_restart=False)
        return finalized

    def watermark(self, tp: TopicPartition, position: int) -> int:
        """The offset to commit for ``tp``: nothing an open or closed rollout still needs is skipped.

        Args:
            tp: An input partition.
            position: The next offset to read there (everything before it was added).
        """
        lowest = position
        for offsets in [s.first_offsets for s in self._open.values()] + [
            c.first_offsets for c in self._closed.values()
        ]:
            first = offsets.get(tp)
            if first is not None and first < lowest:
                lowest = first
        return lowest

    def drop_partitions(self, tps: Iterable[TopicPartition]) -> int:
        """Forget rollouts with events on partitions this instance no longer owns.

        Their new owner re-reads them from the committed watermark. Returns how many open
        rollouts were dropped.
        """
        gone = set(tps)
        dropped = [r for r, s in self._open.items() if gone.intersection(s.first_offsets)]
        for rollout_id in dropped:
            del self._open[rollout_id]
        for rollout_id in [r for r, c in self._closed.items() if gone.intersection(c.first_offsets)]:
            del self._closed[rollout_id]
        return len(dropped)

    def _reason(self, state: _Open, now: float) -> FinalizeReason | None:
        quiet = now - state.last_event_at
        terminal = state.terminal
        if terminal is None:
            return FinalizeReason.LIFECYCLE_TIMEOUT if quiet >= self.policy.lifecycle_timeout_s else None
        if state.reward is not None:
            return FinalizeReason.COMPLETED if quiet >= self.policy.grace_s else None
        if terminal.phase is RolloutPhase.SUCCEEDED:
            return FinalizeReason.REWARD_TIMEOUT if quiet >= self.policy.reward_timeout_s else None
        return FinalizeReason.NO_REWARD_EXPECTED if quiet >= self.policy.grace_s else None

    def _remember(self, rollout_id: str, *, published_before_restart: bool) -> None:
        self._remembered[rollout_id] = published_before_restart
        self._remembered.move_to_end(rollout_id)
        while len(self._remembered) > self.policy.remembered_finalized:
            self._remembered.popitem(last=False)


def _finalize(state: _Open, reason: FinalizeReason, tool_rules: ToolErrorRules) -> Finalized:
    calls = order_calls(state.calls)
    try:
        built = build_samples(calls)
    except ValueError:
        # Recorded data the samples' own checks refuse (a bug upstream): publish the rollout's
        # outcome without samples rather than block the partition, and say so loudly.
        logger.exception("rollout %s: building samples failed; publishing it without samples", state.rollout_id)
        built = BuiltSamples([], MergeStats(calls=len(state.calls), merged=0, breaks=0,
                                            skipped=len(state.calls)), [])
    # Group context comes from one lifecycle event (the scheduled one carries it), so index and
    # size are consistent with each other.
    context = next((e for e in state.lifecycle if e.group_size is not None), None)
    context = context or (state.lifecycle[0] if state.lifecycle else None)
    last = state.terminal or (state.lifecycle[-1] if state.lifecycle else None)
    task_id = (
        (context.task_id if context else None)
        or next((c.task_id for c in state.calls if c.task_id), None)
        or (state.reward.task_id if state.reward else None)
        or state.rollout_id  # no event named the task: group the rollout alone
    )
    harness = next((e.harness for e in state.lifecycle if e.harness), None)
    terminal = state.terminal
    tool_use, tool_errors = annotate_tool_use(calls, tool_rules)
    failure = classify(terminal.phase if terminal else None, terminal.reason if terminal else None,
                       calls=state.calls, reward_missing=state.reward is None,
                       evicted=reason is FinalizeReason.EVICTED)
    trajectory = TrajectoryV1(
        trajectory_id=trajectory_id_for(state.rollout_id),
        rollout_id=state.rollout_id,
        task_id=task_id,
        run_id=next((e.run_id for e in state.lifecycle if e.run_id), None),
        group_index=context.group_index if context else 0,
        group_size=context.group_size if context else None,
        harness=harness,
        timeout_s=next((e.timeout_s for e in state.lifecycle if e.timeout_s), None),
        reward=state.reward.value if state.reward else None,
        phase=last.phase if last else None,
        reason=last.reason if last else None,
        infrastructure_failure=failure is not None and failure.is_infrastructure,
        failure_reason=failure,
        samples=built.samples,
        merge_stats=built.stats,
        merge_breaks=[item.record() for item in built.breaks],
        tool_use=tool_use,
        tool_errors=tool_errors,
        finalize_reason=reason,
    )
    return Finalized(trajectory, built)
