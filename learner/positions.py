"""Where the learner is in the trajectory topic, precisely enough to resume without loss or repeat.

Groups span records: when a checkpoint is written, some records have been read but wait in an
incomplete group. The checkpoint therefore stores, per partition, the low watermark (the first
record not yet finished: trained in a step these weights include, or dropped) and the offsets
above it that are already finished. A restart seeks to the watermark and skips those offsets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True)
class Position:
    """One record of the trajectory topic."""

    topic: str
    partition: int
    offset: int

    @property
    def tp(self) -> TopicPartitionKey:
        """``(topic, partition)``."""
        return (self.topic, self.partition)


@dataclass
class PositionLedger:
    """Which records were read and which are finished, per partition."""

    _next: dict[TopicPartitionKey, int] = field(default_factory=dict)
    _pending: dict[TopicPartitionKey, set[int]] = field(default_factory=dict)
    _finished_above: dict[TopicPartitionKey, set[int]] = field(default_factory=dict)

    @classmethod
    def resume(cls, watermarks: Mapping[TopicPartitionKey, int],
               finished: Mapping[TopicPartitionKey, Iterable[int]]) -> PositionLedger:
        """A ledger that starts where a checkpoint left off."""
        ledger = cls()
        for tp, offset in watermarks.items():
            ledger._next[tp] = offset
        for tp, offsets in finished.items():
            ledger._finished_above[tp] = {o for o in offsets if o >= watermarks.get(tp, 0)}
        return ledger

    def already_finished(self, position: Position) -> bool:
        """A record the checkpoint already includes (read again after a restart): skip it."""
        return position.offset in self._finished_above.get(position.tp, ())

    def read(self, position: Position) -> None:
        """A record was read and is now pending."""
        self._pending.setdefault(position.tp, set()).add(position.offset)
        self._next[position.tp] = max(self._next.get(position.tp, 0), position.offset + 1)

    def finish(self, position: Position) -> None:
        """A pending record was trained or dropped."""
        self._pending.get(position.tp, set()).discard(position.offset)
        self._finished_above.setdefault(position.tp, set()).add(position.offset)

    def watermarks(self) -> dict[TopicPartitionKey, int]:
        """Per partition, the first offset not yet finished (where a restart must read from)."""
        marks: dict[TopicPartitionKey, int] = {}
        for tp, nxt in self._next.items():
            pending = self._pending.get(tp)
            marks[tp] = min(pending) if pending else nxt
        return marks

    def finished_above(self) -> dict[TopicPartitionKey, list[int]]:
        """Finished offsets at or above each watermark; pruned of those below as a side effect."""
        marks = self.watermarks()
        out: dict[TopicPartitionKey, list[int]] = {}
        for tp, offsets in self._finished_above.items():
            mark = marks.get(tp, 0)
            kept = {o for o in offsets if o >= mark}
            self._finished_above[tp] = kept
            if kept:
                out[tp] = sorted(kept)
        return out

    def pending_count(self) -> int:
        """Records read but not finished."""
        return sum(len(p) for p in self._pending.values())
