"""A rollout's token history: for each call, the messages as the template saw them and the exact ids.

Continuation builds a call's prompt from an earlier turn's prompt and sampled ids, so a turn stores
its prompt as a reference to the turn it extends plus only the ids it added (the bridge and the new
messages). A rollout's memory therefore grows with its new tokens, not with its turns times its
context, and the same reference is what a linear call event stores. No I/O.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutHistories", "RolloutHistory", "Turn", "View"]

View = tuple[Any, ...]
"""A message as a chat template sees it (:func:`consumers.assembler.drift.template_view`)."""


def _ids(values: Iterable[int]) -> array[int]:
    return array("l", values)


@dataclass(frozen=True, eq=False)
class Turn:
    """One call of a rollout, as continuation needs it.

    Its prompt is the first ``extends`` ids of ``parent``'s prompt and sampled ids, followed by
    ``added`` (all of the prompt when ``parent`` is None: a full render).
    """

    call_id: str
    """The call's id, for an event that references the call it extends."""
    views: tuple[View, ...]
    """The request's messages as the template saw them (none for a turn recorded by its tokens
    alone, which continuation never extends)."""
    tools: bytes
    """The tools offered, canonical (:func:`consumers.assembler.drift.canonical_tools`)."""
    parent: Turn | None
    """The turn whose prompt and sampled ids this prompt begins with."""
    added: array[int]
    """The prompt ids after the part of the parent's prompt and sampled ids it shares."""
    sampled: array[int]
    """The ids the engine sampled, the stop token included when it sampled one."""
    answer: View | None
    """The answer's message as the harness was given it (None when there was none)."""
    shared: int | None = None
    """How many leading ids of the parent's prompt and sampled ids the prompt shares, where it
    forked before their end (None: all of them, the prompt extends the parent)."""
    message_keys: tuple[bytes, ...] = ()
    """A short digest of each message of the request as recorded, for an event that references
    the messages it repeats (:mod:`~proxy.continuation.prefix`)."""
    tools_key: bytes = b""
    """A short digest of the tools offered as recorded."""

    @classmethod
    def of(cls, call_id: str, views: Sequence[View], tools: bytes, parent: Turn | None, added: Iterable[int],
           sampled: Iterable[int], answer: View | None, *, shared: int | None = None,
           message_keys: Sequence[bytes] = (), tools_key: bytes = b"") -> Turn:
        """A turn from plain sequences."""
        return cls(call_id, tuple(views), tools, parent, _ids(added), _ids(sampled), answer, shared,
                   tuple(message_keys), tools_key)

    @property
    def extends(self) -> int:
        """How many leading prompt ids are the parent's prompt and sampled ids (0 without a parent)."""
        if self.parent is None:
            return 0
        return self.parent.prompt_len + len(self.parent.sampled) if self.shared is None else self.shared

    @property
    def prompt_len(self) -> int:
        """The number of prompt ids."""
        return self.extends + len(self.added)

    def prompt_ids(self) -> list[int]:
        """The whole prompt, assembled from the chain of turns it extends."""
        return self.context().tolist()[:self.prompt_len]

    def context(self) -> array[int]:
        """The prompt ids followed by the sampled ids: what a later prompt may extend."""
        chain = []
        turn: Turn | None = self
        while turn is not None:
            chain.append(turn)
            turn = turn.parent
        ids: array[int] = _ids(())
        for step in reversed(chain):
            del ids[step.extends:]
            ids.extend(step.added)
            ids.extend(step.sampled)
        return ids


class RolloutHistory:
    """The turns of one rollout, newest last; only the newest ``keep`` are candidates to extend.

    A turn older than that may still be referenced by a newer turn's prompt (and so stay in
    memory); it is only no longer searched. Harnesses extend their latest turn or one shortly
    before it (a retried call, a fork), so a few suffice.
    """

    def __init__(self, *, keep: int = 8) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self._turns: deque[Turn] = deque(maxlen=keep)

    def record(self, turn: Turn) -> None:
        """Add a finished call's turn."""
        self._turns.append(turn)

    def find(self, call_id: str) -> Turn | None:
        """The kept turn of this call, if any."""
        return next((turn for turn in self._turns if turn.call_id == call_id), None)

    def newest_first(self) -> Iterator[Turn]:
        """The kept turns, the latest first."""
        return reversed(self._turns)

    @property
    def latest(self) -> Turn | None:
        """The newest turn, if any."""
        return self._turns[-1] if self._turns else None

    def __len__(self) -> int:
        return len(self._turns)


class RolloutHistories:
    """The token histories of the rollouts a proxy serves, the least recently used dropped beyond a bound.

    A dropped rollout that calls again has lost its state: its next call falls back with
    ``state_lost`` and starts a new history, which is correct, only less compact.
    """

    def __init__(self, *, max_rollouts: int = 4096, keep: int = 8) -> None:
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts must be at least 1, not {max_rollouts}")
        self._max = max_rollouts
        self._keep = keep
        self._histories: OrderedDict[str, RolloutHistory] = OrderedDict()

    def of(self, rollout_id: str) -> RolloutHistory:
        """The rollout's history, a new one when it has none."""
        history = self._histories.get(rollout_id)
        if history is None:
            history = self._histories[rollout_id] = RolloutHistory(keep=self._keep)
            while len(self._histories) > self._max:
                self._histories.popitem(last=False)
        else:
            self._histories.move_to_end(rollout_id)
        return history

    def forget(self, rollout_id: str) -> None:
        """Drop a finished rollout's history."""
        self._histories.pop(rollout_id, None)

    def __len__(self) -> int:
        return len(self._histories)
