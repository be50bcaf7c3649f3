"""Drift reasons: why a call's prompt did not extend the rollout's earlier context token for token.

When it does not, the assembler starts a new training sample (a *merge break*), and every later
call re-carries the whole context. The reason says who rewrote what, so a break rate per harness
can be read as a cause. No I/O.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DriftReason"]


class DriftReason(StrEnum):
    """Why a call broke the rollout's token prefix, as judged from the calls' messages."""

    HISTORY_REWRITTEN = "history_rewritten"
    """An earlier message changed or was removed (compaction, a rewritten user turn), or the call
    starts another conversation (a title or summary request)."""
    MESSAGE_MOVED = "message_moved"
    """The earlier messages are all there, but one of them moved (a trailing context message the
    harness puts after the newest turn every time)."""
    TOOLS_CHANGED = "tools_changed"
    """The tools offered differ from the earlier call's, and the template renders them first."""
    REASONING_DROPPED = "reasoning_dropped"
    """The model's earlier turn came back without the reasoning it produced."""
    RERENDERED = "rerendered"
    """The history came back unchanged, but the chat template writes the sampled turn with other
    tokens than were sampled (a tool call's spelling, re-serialised arguments, the end-of-turn
    token)."""
    BRIDGE_MISMATCH = "bridge_mismatch"
    """The history came back unchanged, but the template's rendering of it does not line up for
    continuation: the repeated messages do not render as a token prefix of the whole request, or the
    earlier turn does not end with the template's turn closing."""
    STATE_LOST = "state_lost"
    """The request continues a conversation whose token history the proxy no longer holds (it
    restarted and could not recover the rollout's calls)."""
