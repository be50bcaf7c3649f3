"""Which prompt a call gets: the exact ids of an earlier turn extended, or a full render with a reason.

For a new request the planner looks for the latest earlier turn of the rollout whose messages (and
answer) the request repeats unchanged, compared as the template sees them, with the same tools (an
answer may come back without its reasoning: the sampled ids keep it).
The prompt is then that turn's prompt ids and sampled ids, the *bridge* (the rest of the
template's turn closing that the model did not sample), and the ids of the new messages as the
template renders them after the repeated ones.

The new ids come from two renders of the request by the engine's own template, in its real
context: the repeated messages alone, closed (``add_generation_prompt`` off), and the whole request
(on). Where the first is a token prefix of the second, the rest of the second is exactly what the
template adds for the new messages and the next generation prompt. The closed render ends with the
template's turn closing (learned once per replica, :class:`~proxy.continuation.engine.TokenEndpoints`);
the sampled turn already holds the part of it the model sampled (``<|im_end|>``), so the bridge is
only what follows (the newline), or all of it when the model stopped otherwise (``max_tokens``, another
stop token). Where the renders do not line up, the call falls back to the full render, named
``bridge_mismatch``; where no turn is repeated, to the full render with the reason the message
diagnosis gives. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from consumers.assembler.drift import diagnose_views, without_reasoning
from proxy.continuation.history import RolloutHistory, Turn, View
from schemas.drift import DriftReason

__all__ = ["Extend", "FullRender", "Plan", "Prompt", "Repeat", "bridge", "choose", "extend_prompt",
           "full_prompt", "max_new_tokens", "repeat_prompt"]


@dataclass(frozen=True)
class Extend:
    """The request repeats ``turn``'s messages and answer: its first ``through`` messages."""

    turn: Turn
    through: int


@dataclass(frozen=True)
class Repeat:
    """The request is ``turn``'s messages again, nothing added (a retried or forked call)."""

    turn: Turn


@dataclass(frozen=True)
class FullRender:
    """No earlier turn is repeated: the whole request is rendered."""

    reason: DriftReason | None
    """Why not (None: nothing to continue, the rollout's first call or a request without an
    assistant turn that opens it)."""


Plan = Extend | Repeat | FullRender


@dataclass(frozen=True)
class Prompt:
    """A call's prompt: ``parent``'s prompt and sampled ids, then ``added``.

    Only the first ``shared`` of the parent's ids where the prompt forked inside them.
    """

    parent: Turn | None
    added: tuple[int, ...]
    drift: DriftReason | None
    """Why the prompt is a full render although the rollout had turns to extend."""
    shared: int | None = None
    """How many of the parent's prompt and sampled ids the prompt begins with (None: all)."""

    def ids(self) -> list[int]:
        """The whole prompt."""
        if self.parent is None:
            return list(self.added)
        context = self.parent.context().tolist()
        return [*(context if self.shared is None else context[:self.shared]), *self.added]

    def turn(self, call_id: str, views: Sequence[View], tools: bytes, sampled: Sequence[int],
             answer: View | None) -> Turn:
        """The turn to record once the call answered."""
        return Turn.of(call_id, views, tools, self.parent, self.added, sampled, answer, shared=self.shared)


def choose(history: RolloutHistory, views: Sequence[View], tools: bytes) -> Plan:
    """Pick the turn to extend for a request with these messages (template views) and tools.

    The latest kept turn offered the same tools whose messages the request begins with wins: the
    request either stops there (:class:`Repeat`) or goes on with that turn's answer
    (:class:`Extend`). Otherwise the reason is the message diagnosis against the latest turn;
    a request that continues a conversation the history holds nothing of is ``state_lost``.
    """
    views = list(views)
    for turn in history.newest_first():
        if turn.tools != tools:
            continue
        count = len(turn.views)
        if views[:count] != list(turn.views):
            continue
        if len(views) == count:
            return Repeat(turn)
        # An answer that comes back without the reasoning the model sampled (an Anthropic harness
        # with thinking off is never shown it; some harnesses strip it) still extends the turn:
        # the prompt is built from the sampled ids, so the reasoning the model wrote stays in it.
        if turn.answer is not None and len(turn.sampled) and views[count] in (turn.answer,
                                                                              without_reasoning(turn.answer)):
            return Extend(turn, count + 1)
    latest = history.latest
    if latest is None:
        opened = any(view and view[0] == "assistant" for view in views)
        return FullRender(DriftReason.STATE_LOST if opened else None)
    reason = diagnose_views(latest.views, latest.answer, views, tools_before=latest.tools, tools_after=tools)
    if reason in (None, DriftReason.RERENDERED):
        # The messages came back but the answer did not as it was given (the harness edited it).
        reason = DriftReason.HISTORY_REWRITTEN
    return FullRender(reason)


def bridge(sampled: Sequence[int], closing: Sequence[int]) -> list[int]:
    """The part of the template's turn closing the sampled ids do not already end with."""
    for overlap in range(min(len(sampled), len(closing)), 0, -1):
        if list(sampled[-overlap:]) == list(closing[:overlap]):
            return list(closing[overlap:])
    return list(closing)


def extend_prompt(plan: Extend, closing: Sequence[int], closed_ids: Sequence[int], full_ids: Sequence[int]) -> Prompt:
    """The prompt that extends ``plan.turn``, or the full render when the renders do not line up.

    Args:
        plan: the turn to extend and how many of the request's messages repeat it.
        closing: the template's turn closing (from the replica's probe).
        closed_ids: the render of the request's first ``plan.through`` messages, without a
            generation prompt.
        full_ids: the render of the whole request, with one.
    """
    cut = len(closed_ids)
    if (not closing or cut < len(closing) or list(closed_ids[cut - len(closing):]) != list(closing)
            or len(full_ids) <= cut or list(full_ids[:cut]) != list(closed_ids)):
        return full_prompt(full_ids, DriftReason.BRIDGE_MISMATCH)
    added = bridge(plan.turn.sampled, closing) + list(full_ids[cut:])
    return Prompt(plan.turn, tuple(added), None)


def repeat_prompt(plan: Repeat) -> Prompt:
    """The prompt of a repeated turn: the same ids, built the same way."""
    return Prompt(plan.turn.parent, tuple(plan.turn.added), None, plan.turn.shared)


def full_prompt(full_ids: Sequence[int], drift: DriftReason | None) -> Prompt:
    """A full render's prompt."""
    return Prompt(None, tuple(full_ids), drift)


def max_new_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """How many ids a call may sample: what it asked for, clamped to the context left.

    Returns:
        At least 1 when the prompt leaves room, else 0 (the caller refuses the call: the prompt
        alone fills the context).
    """
    room = max(max_model_len - prompt_len, 0)
    return room if requested is None else min(max(requested, 0), room)
