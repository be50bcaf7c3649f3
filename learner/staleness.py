"""The staleness bound: how many weight versions behind a sample may be and still train.

Off-policy correction (importance weights) repairs a small policy lag; it does not repair a large
one, where the weights are clipped for most tokens and the gradient is mostly noise. So a
trajectory whose oldest behaviour version lags the learner's current version by more than the
bound is dropped, and the drop is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import TrajectoryV1


def parse_version(label: str, default: int) -> int:
    """An engine version label as an integer; ``default`` for labels that cannot be ordered.

    Versions the publisher loads are ``str(CheckpointV1.version)``; anything else (the base model's
    label, a name) is taken as ``default``, normally 0, the initial weights.
    """
    text = label.strip()
    return int(text) if text.isdecimal() else default


def behaviour_version(trajectory: TrajectoryV1, unversioned_as: int) -> int:
    """The oldest weight version that sampled any token of ``trajectory``.

    A trajectory whose samples report no versions is taken as ``unversioned_as``.
    """
    versions = [parse_version(r.version, unversioned_as) for s in trajectory.samples for r in s.weight_versions]
    return min(versions, default=unversioned_as)


@dataclass(frozen=True)
class StalenessPolicy:
    """Accept a trajectory when ``current_version - behaviour_version <= max_staleness``."""

    max_staleness: int
    """Largest accepted lag in weight versions."""
    unversioned_as: int = 0
    """Version assumed where the engine reported none."""

    def staleness(self, trajectory: TrajectoryV1, current_version: int) -> int:
        """Versions between the learner's weights and the oldest weights that sampled the trajectory.

        Never negative: a sample from a version newer than the learner's (possible right after a
        restart from an older checkpoint) counts as fresh.
        """
        return max(0, current_version - behaviour_version(trajectory, self.unversioned_as))

    def accepts(self, trajectory: TrajectoryV1, current_version: int) -> bool:
        """Whether the trajectory is fresh enough to train on."""
        return self.staleness(trajectory, current_version) <= self.max_staleness
