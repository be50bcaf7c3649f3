"""Value types shared by several event schemas."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Annotated, Self

from pydantic import Field, JsonValue, StringConstraints, model_validator

from schemas._base import FrozenModel

__all__ = [
    "Identifier",
    "JsonObject",
    "WeightVersionRange",
    "check_version_ranges",
    "uncovered_spans",
]

Identifier = Annotated[str, StringConstraints(min_length=1, max_length=256)]
"""An opaque, non-empty id (task, rollout, call, ...). Ids travel in URLs, headers and Kafka
keys, so they are bounded in length; their format is up to whoever mints them."""

JsonObject = dict[str, JsonValue]
"""A free-form JSON object, validated only as JSON."""


class WeightVersionRange(FrozenModel):
    """Tokens ``[start, end)`` of a completion that were sampled under one weight version.

    Weights can change while a request is in flight, so one completion may span several
    versions; the learner needs the version of every trained token to bound staleness and to
    correct for off-policy sampling.
    """

    version: str = Field(min_length=1, max_length=128)
    """Weight version as reported by the engine. Versions the checkpoint publisher loads are
    the decimal string of ``CheckpointV1.version``; other values (e.g. the base model's label)
    are allowed but cannot be ordered."""

    start: int = Field(ge=0)
    """Index of the first token of the range, counted within the completion."""

    end: int = Field(ge=1)
    """Index one past the last token of the range (exclusive end)."""

    @model_validator(mode="after")
    def _non_empty(self) -> Self:
        if self.end <= self.start:
            raise ValueError(f"weight version range must be non-empty: start={self.start} end={self.end}")
        return self

    @property
    def version_number(self) -> int | None:
        """The version as an integer when it is one, for staleness arithmetic."""
        try:
            return int(self.version)
        except ValueError:
            return None


def check_version_ranges(
    ranges: Sequence[WeightVersionRange], length: int, *, what: str, require_cover: bool
) -> None:
    """Check that ranges are sorted, disjoint and within ``[0, length)``.

    Args:
        ranges: The ranges to check.
        length: Number of tokens the ranges index into.
        what: Name of the owning field, for the error message.
        require_cover: Also require that non-empty ranges cover every token: a model call's
            completion was sampled entirely, so every token has a version (an empty list means
            "unknown", which the learner can treat as maximally stale).

    Raises:
        ValueError: With a message naming the offending range.
    """
    position = 0
    for index, item in enumerate(ranges):
        if item.start < position:
            raise ValueError(
                f"{what}[{index}] [{item.start}, {item.end}) overlaps or precedes the previous "
                f"range ending at {position}; ranges must be sorted and disjoint"
            )
        if require_cover and item.start != position:
            raise ValueError(
                f"{what}[{index}] starts at {item.start} but the previous range ends at "
                f"{position}; ranges must cover every token without gaps"
            )
        position = item.end
    if position > length:
        raise ValueError(f"{what} reach token {position} but there are only {length} tokens")
    if require_cover and ranges and position != length:
        raise ValueError(
            f"{what} end at token {position} but there are {length} tokens; ranges must cover every token"
        )


def uncovered_spans(ranges: Sequence[WeightVersionRange], length: int) -> Iterator[slice]:
    """Yield the token spans of ``[0, length)`` that no range covers (ranges must be sorted)."""
    position = 0
    for item in ranges:
        if item.start > position:
            yield slice(position, item.start)
        position = max(position, item.end)
    if position < length:
        yield slice(position, length)
