"""Group formation: the rollouts of one task train together, so advantages compare like with like.

A group is complete when ``group_size`` trajectories of its task arrived. A group still short
waits for its stragglers until its deadline: the first member's arrival plus the task's own
timeout (every member is launched with the group and ends within that timeout, killed at it if
need be) plus a grace for launch skew and the assembler's latency. Trajectories that carry no
timeout (written before tasks carried one) wait the learner's fallback instead. Once released, a
group is closed: a member arriving later is refused as late, never the start of a new group.
Infrastructure failures take their place in the count (the group is complete without waiting for
them) but never enter the group's statistics.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from schemas import TrajectoryV1

_P = TypeVar("_P")
_RELEASED_IDS = 100_000  # released task ids remembered to refuse late members

Added = Literal["added", "duplicate", "late"]


@dataclass
class Group(Generic[_P]):
    """The trajectories of one task seen so far, each with the caller's position token."""

    task_id: str
    first_seen: float
    expected: int | None
    deadline: float = math.inf
    """When the group is released with the members it has."""
    members: list[tuple[TrajectoryV1, _P]] = field(default_factory=list)
    timed_out: bool = False

    @property
    def usable(self) -> list[tuple[TrajectoryV1, _P]]:
        """Members that count in the statistics (infrastructure failures excluded)."""
        return [m for m in self.members if not m[0].infrastructure_failure]

    @property
    def infrastructure_failures(self) -> list[tuple[TrajectoryV1, _P]]:
        """Members left out of the statistics."""
        return [m for m in self.members if m[0].infrastructure_failure]

    def complete(self) -> bool:
        """Every expected rollout arrived."""
        return self.expected is not None and len(self.members) >= self.expected

    @property
    def short(self) -> bool:
        """Released at its deadline with members missing."""
        return self.timed_out and not self.complete()


class GroupBuffer(Generic[_P]):
    """Collects trajectories per task and releases complete or overdue groups in arrival order."""

    def __init__(self, fallback_timeout_s: float, clock: Callable[[], float], grace_s: float = 0.0) -> None:
        self._fallback_s = fallback_timeout_s
        self._grace_s = grace_s
        self._clock = clock
        self._open: dict[str, Group[_P]] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self.duplicates = 0
        """Trajectories whose (task, group_index) was already in the open group."""
        self.late = 0
        """Trajectories that arrived after their group was released."""

    def add(self, trajectory: TrajectoryV1, position: _P) -> tuple[Group[_P] | None, Added]:
        """Add one trajectory; return the group if it is now complete, and what became of the trajectory.

        A second trajectory with the same ``group_index`` in an open group is refused
        (``duplicate``) so one rollout never counts twice in the statistics; one whose group was
        already released is refused as ``late``.
        """
        if trajectory.task_id in self._released:
            self.late += 1
            return None, "late"
        group = self._open.get(trajectory.task_id)
        if group is None:
            now = self._clock()
            wait = self._fallback_s if trajectory.timeout_s is None else trajectory.timeout_s + self._grace_s
            group = Group(trajectory.task_id, now, trajectory.group_size, now + wait)
            self._open[trajectory.task_id] = group
        if any(t.group_index == trajectory.group_index for t, _ in group.members):
            self.duplicates += 1
            return None, "duplicate"
        if trajectory.group_size is not None:
            group.expected = max(group.expected or 0, trajectory.group_size)
        group.members.append((trajectory, position))
        if group.complete():
            self._release(group)
            return group, "added"
        return None, "added"

    def expired(self) -> list[Group[_P]]:
        """Release groups past their deadline, oldest first."""
        now = self._clock()
        out = [g for g in self._open.values() if now >= g.deadline]
        for group in out:
            group.timed_out = True
            self._release(group)
        return out

    def __len__(self) -> int:
        return len(self._open)

    def expired_all(self) -> list[Group[_P]]:
        """Release every open group (the source ended: no straggler can arrive any more)."""
        out = list(self._open.values())
        for group in out:
            group.timed_out = True
            self._release(group)
        return out

    def _release(self, group: Group[_P]) -> None:
        del self._open[group.task_id]
        self._released[group.task_id] = None
        if len(self._released) > _RELEASED_IDS:
            self._released.popitem(last=False)
