"""Group formation: the rollouts of one task train together, so advantages compare like with like.

A group is complete when ``group_size`` trajectories of its task arrived. Stragglers are not
waited for forever: ``group_timeout_s`` after its first trajectory the group is released with the
members it has. Infrastructure failures take their place in the count (the group is complete
without waiting for them) but never enter the group's statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas import TrajectoryV1

_P = TypeVar("_P")


@dataclass
class Group(Generic[_P]):
    """The trajectories of one task seen so far, each with the caller's position token."""

    task_id: str
    first_seen: float
    expected: int | None
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


class GroupBuffer(Generic[_P]):
    """Collects trajectories per task and releases complete or timed-out groups in arrival order."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._open: dict[str, Group[_P]] = {}
        self.duplicates = 0
        """Trajectories whose (task, group_index) was already in the open group."""

    def add(self, trajectory: TrajectoryV1, position: _P) -> tuple[Group[_P] | None, bool]:
        """Add one trajectory; return the group if it is now complete, and whether it was accepted.

        A second trajectory with the same ``group_index`` in an open group is refused (returned
        False) so one rollout never counts twice in the statistics.
        """
        group = self._open.get(trajectory.task_id)
        if group is None:
            group = Group(trajectory.task_id, self._clock(), trajectory.group_size)
            self._open[trajectory.task_id] = group
        if any(t.group_index == trajectory.group_index for t, _ in group.members):
            self.duplicates += 1
            return None, False
        if trajectory.group_size is not None:
            group.expected = max(group.expected or 0, trajectory.group_size)
        group.members.append((trajectory, position))
        if group.complete():
            del self._open[trajectory.task_id]
            return group, True
        return None, True

    def expired(self) -> list[Group[_P]]:
        """Release groups whose stragglers are overdue, oldest first."""
        now = self._clock()
        out = [g for g in self._open.values() if now - g.first_seen >= self._timeout_s]
        for group in out:
            group.timed_out = True
            del self._open[group.task_id]
        return out

    def __len__(self) -> int:
        return len(self._open)

    def expired_all(self) -> list[Group[_P]]:
        """Release every open group (the source ended: no straggler can arrive any more)."""
        out = list(self._open.values())
        for group in out:
            group.timed_out = True
        self._open.clear()
        return out
