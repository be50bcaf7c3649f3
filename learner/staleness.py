"""The staleness bound, per token, counted in served weight versions.

Engines only ever serve published checkpoints, so versions count publishes: version 0 is the
initial weights and each published checkpoint is the next integer. A token's age is the newest
version the learner has published minus the version that sampled it (per token where the engine
reported ranges, else the version of the whole call, which the proxy writes as one range).

Off-policy correction (importance weights) repairs a small policy lag; it does not repair a large
one, where the weights are clipped for most tokens and the gradient is mostly noise. So tokens
older than the bound are masked out of the loss (the rest of their trajectory still trains), and a
trajectory loses its place in the step only when nothing trainable is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import TrajectoryV1
from schemas.trajectory.v1 import TrajectorySample


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
class FreshTokens:
    """One sample's loss mask with stale tokens masked, and what that took away."""

    loss_mask: list[int]
    """The sample's mask with every token beyond the bound set to 0."""
    kept: int
    """Trained tokens left."""
    masked: int
    """Trained tokens masked for staleness."""
    oldest_kept_age: int | None
    """Age of the oldest token still trained (None when none is)."""


@dataclass(frozen=True)
class StalenessPolicy:
    """Train a token when ``newest published version - its version <= max_staleness``."""

    max_staleness: int
    """Largest trained age, in published versions."""
    unversioned_as: int = 0
    """Version assumed where the engine reported none."""

    def age(self, version: int, newest: int) -> int:
        """Versions published after ``version``.

        Never negative: a sample newer than a learner that resumed from an older checkpoint counts
        as fresh.
        """
        return max(0, newest - version)

    def staleness(self, trajectory: TrajectoryV1, newest: int) -> int:
        """Age of the oldest token of ``trajectory``."""
        return self.age(behaviour_version(trajectory, self.unversioned_as), newest)

    def fresh(self, sample: TrajectorySample, newest: int) -> FreshTokens:
        """The sample's loss mask with the tokens older than the bound masked out."""
        mask = list(sample.loss_mask)
        ranges = [(r.start, r.end, parse_version(r.version, self.unversioned_as)) for r in sample.weight_versions]
        if not ranges:  # no versions at all: the whole completion is unversioned
            ranges = [(0, len(mask), self.unversioned_as)]
        kept = masked = 0
        oldest: int | None = None
        for start, end, version in ranges:
            trained = sum(mask[start:end])
            if not trained:
                continue
            age = self.age(version, newest)
            if age > self.max_staleness:
                mask[start:end] = [0] * (end - start)
                masked += trained
            else:
                kept += trained
                oldest = age if oldest is None else max(oldest, age)
        return FreshTokens(mask, kept, masked, oldest)
