"""Which earlier call a call's event references, and what it repeats of it (calls events grow linearly).

A call's event stores what it repeats of an earlier call of the rollout by reference
(:class:`~schemas.call.v1.PromptPrefix`: leading prompt ids, leading messages, the tools) and only
the rest. The rollout's token history (:mod:`~proxy.continuation.history`) is the one record of
what each call saw and sampled: a call continuation built already has its turn there, extending
its parent; any other call (chat mode, a fallback) is compared with the kept turns, and the turn
sharing the longest token prefix with its prompt is referenced, the whole context where the prompt
extends it, a shorter prefix where the samples forked (the template re-spelled a sampled turn).
Either way the call's turn is recorded by that reference, so the history grows with new tokens
only. Messages and tools are compared by short digests of their recorded JSON (:func:`message_keys`,
:func:`tools_key`); a turn continuation records carries them too, so its successors reference its
messages. No I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.continuation.history import RolloutHistory, Turn

__all__ = ["Reference", "message_keys", "refer", "tools_key"]


def _key(value: Any) -> bytes:
    # The JSON as recorded, key order kept: a message rebuilt from the referenced call must be the
    # one the harness sent, byte for byte.
    try:
        return hashlib.blake2b(orjson.dumps(value), digest_size=8).digest()
    except (orjson.JSONEncodeError, TypeError):
        return os.urandom(8)  # a value orjson cannot write (an integer past 64 bits) is never referenced


_NO_TOOLS = _key(None)


def message_keys(messages: Sequence[Any]) -> tuple[bytes, ...]:
    """A short digest of each message as the event records it."""
    return tuple(_key(message) for message in messages)


def tools_key(tools: Any) -> bytes:
    """A short digest of the tools offered as the event records them."""
    return _key(tools)


@dataclass(frozen=True)
class Reference:
    """A call's prompt prefix reference, and its turn to record once its event is durable."""

    prefix: dict[str, Any] | None
    """The referenced call, how many of its context's ids the prompt begins with, how many of its
    messages the request begins with, and whether its tools are offered again
    (:attr:`producers.capture.CallCapture.prompt_prefix`); None when the prompt shares no ids with
    a kept turn (the call is stored whole)."""
    turn: Turn | None
    """The call's turn, for :meth:`RolloutHistory.record` after the event is journalled (a later
    call must not reference a call that has no event, nor continue from it)."""


def refer(history: RolloutHistory, call_id: str, prompt: Sequence[int], sampled: Sequence[int],
          messages: Sequence[Any], tools: Any, *, built: Turn | None = None) -> Reference:
    """The reference for a finished call's event.

    Args:
        history: The rollout's token history.
        call_id: The call.
        prompt: Its whole prompt ids, as the engine saw them.
        sampled: The ids its first choice sampled.
        messages: Its request's messages, as the event records them.
        tools: Its request's tools, as the event records them.
        built: The call's turn as continuation built its prompt, if it did: the turn it extends is
            the reference, and it is the turn to record (with the keys of its messages and
            tools). A full render is referenced by search, as a chat-mode call is.
    """
    keys, tools_digest = message_keys(messages), tools_key(tools)
    if built is not None and built.parent is not None:
        parent, shared = built.parent, built.extends
        turn = dataclasses.replace(built, message_keys=keys, tools_key=tools_digest)
        return Reference(_prefix(parent, shared, keys, tools_digest) if shared else None, turn)
    packed = array("l", prompt).tobytes()
    best: Turn | None = None
    best_shared = 0
    for turn in history.newest_first():
        if turn.prompt_len + len(turn.sampled) <= best_shared:
            continue  # shares no more than the best so far even if the prompt extends it: not built
        shared = _common_prefix(turn.context().tobytes(), packed)
        if shared > best_shared:
            best, best_shared = turn, shared
    whole = best is not None and best_shared == best.prompt_len + len(best.sampled)
    # A prompt continuation rendered whole (the harness rewrote its history) still shares ids with
    # earlier calls: it is referenced like any other, and keeps what continuation needs of it.
    views, offered, answer = ((), b"", None) if built is None else (built.views, built.tools, built.answer)
    turn = Turn.of(call_id, views, offered, best, prompt[best_shared:], sampled, answer,
                   shared=None if whole else best_shared, message_keys=keys, tools_key=tools_digest)
    return Reference(None if best is None else _prefix(best, best_shared, keys, tools_digest), turn)


def _prefix(parent: Turn, tokens: int, keys: tuple[bytes, ...], tools_digest: bytes) -> dict[str, Any]:
    messages = 0
    for mine, theirs in zip(keys, parent.message_keys, strict=False):
        if mine != theirs:
            break
        messages += 1
    same_tools = parent.tools_key == tools_digest and tools_digest != _NO_TOOLS
    return {"call_id": parent.call_id, "tokens": tokens, "messages": messages, "tools": same_tools}


_ITEM = array("l").itemsize


def _common_prefix(context: bytes, prompt: bytes) -> int:
    """How many leading ids two packed sequences share."""
    if prompt.startswith(context):
        return len(context) // _ITEM  # the usual case: the prompt extends the turn
    # Binary search on whole ids. bytes.startswith compares in C without copying the prompt; a
    # slice comparison of both sides cost twenty times as much on a 100k-id prompt.
    low, high = 0, min(len(context), len(prompt)) // _ITEM
    while low < high:
        middle = (low + high + 1) // 2
        if prompt.startswith(context[:middle * _ITEM]):
            low = middle
        else:
            high = middle - 1
    return low
