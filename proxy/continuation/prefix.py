"""Which earlier call a call's event references for its prompt prefix (calls events grow linearly).

A call's event stores its leading prompt ids as a reference to an earlier call of the rollout
(:class:`~schemas.call.v1.PromptPrefix`) and only the ids after it. The rollout's token history
(:mod:`~proxy.continuation.history`) is the one record of what each call saw and sampled: a call
continuation built already has its turn there, extending its parent; any other call (chat mode, a
fallback) is compared with the kept turns, and the turn sharing the longest token prefix with its
prompt is referenced, the whole context where the prompt extends it, a shorter prefix where the
samples forked (the template re-spelled a sampled turn). Either way the call's turn is recorded
by that reference, so the history grows with new tokens only. No I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.continuation.history import RolloutHistory, Turn

__all__ = ["Reference", "refer"]


@dataclass(frozen=True)
class Reference:
    """A call's prompt prefix reference, and its turn to record once its event is durable."""

    prefix: tuple[str, int] | None
    """The referenced call and how many of its context's ids the prompt begins with; None when
    the prompt shares no ids with a kept turn (it is stored whole)."""
    turn: Turn | None
    """The call's turn, for :meth:`RolloutHistory.record` after the event is journalled (a later
    call must not reference a call that has no event); None when continuation recorded it."""


def refer(history: RolloutHistory, call_id: str, prompt: Sequence[int], sampled: Sequence[int]) -> Reference:
    """The prefix reference for a finished call's event.

    Args:
        history: The rollout's token history.
        call_id: The call.
        prompt: Its whole prompt ids, as the engine saw them.
        sampled: The ids its first choice sampled.

    """
    own = history.find(call_id)
    if own is not None:  # built by continuation: its parent is the reference
        parent = own.parent
        return Reference(None if parent is None or own.extends == 0 else (parent.call_id, own.extends), None)
    packed = array("l", prompt).tobytes()
    best: Turn | None = None
    best_shared = 0
    for turn in history.newest_first():
        shared = _common_prefix(turn.context().tobytes(), packed)
        if shared > best_shared:
            best, best_shared = turn, shared
    whole = best is not None and best_shared == best.prompt_len + len(best.sampled)
    turn = Turn.of(call_id, (), b"", best, prompt[best_shared:], sampled, None, shared=None if whole else best_shared)
    return Reference(None if best is None else (best.call_id, best_shared), turn)


_ITEM = array("l").itemsize


def _common_prefix(context: bytes, prompt: bytes) -> int:
    """How many leading ids two packed sequences share."""
    if prompt.startswith(context):
        return len(context) // _ITEM  # the usual case: the prompt extends the turn
    # Binary search on whole ids: each probe is a C-level slice comparison.
    low, high = 0, min(len(context), len(prompt)) // _ITEM
    while low < high:
        middle = (low + high + 1) // 2
        if context[:middle * _ITEM] == prompt[:middle * _ITEM]:
            low = middle
        else:
            high = middle - 1
    return low
