"""Whole prompts from linear call events: a prompt prefix stored by reference, resolved or refused.

A call event may store its leading prompt ids as a :class:`~schemas.call.v1.PromptPrefix`, a
reference to an earlier call of the rollout, and only the ids after it. Everything that needs the
whole prompt (the assembler, ``openforge topics tail`` and ``replay --to-file``) rebuilds it here,
one way. A reference that does not resolve is refused with a named reason, never padded or cut:
training on a prompt that is not the one the engine saw would be silent corruption. No I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from enum import StrEnum

from schemas._arrays import TokenIds
from schemas.call.v1 import ModelCallV1, NormalizedRequest, PromptPrefix

__all__ = ["UnresolvedPrefix", "UnresolvedPrefixError", "WholeCalls", "context_bytes", "prefix_digest", "rebuild"]


class UnresolvedPrefix(StrEnum):
    """Why a call's prompt prefix could not be rebuilt."""

    PARENT_MISSING = "prefix_parent_missing"
    """The referenced call was not read before this one (lost, dead-lettered, or of another rollout)."""
    PAST_PARENT_END = "prefix_past_parent_end"
    """The reference asks for more ids than the referenced call's context holds, or more messages
    than its request has."""
    PREFIX_MISMATCH = "prefix_mismatch"
    """The referenced ids do not have the digest the proxy stored: not the prefix it saw."""


class UnresolvedPrefixError(ValueError):
    """A prompt prefix that does not resolve; ``reason`` names why."""

    def __init__(self, reason: UnresolvedPrefix, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


def prefix_digest(packed: bytes) -> str:
    """The digest a :class:`PromptPrefix` stores, of token ids packed as little-endian int32."""
    return hashlib.blake2b(packed, digest_size=16).hexdigest()


def context_bytes(call: ModelCallV1) -> bytes:
    """A whole call's context, packed: its prompt ids, then its first choice's sampled ids.

    This is what a later call's prompt extends, and what a :class:`PromptPrefix` counts in.
    """
    choice = call.first_choice
    sampled = choice.completion_token_ids.to_bytes() if choice is not None else b""
    return call.prompt_token_ids.to_bytes() + sampled


def rebuild(call: ModelCallV1, parent: ModelCallV1 | None) -> ModelCallV1:
    """``call`` with its whole prompt, the prefix taken from ``parent`` (itself already whole).

    A call without a prefix is returned as it is.

    Raises:
        UnresolvedPrefixError: ``parent`` is None or not the referenced call, holds fewer ids than
            referenced, or its ids do not match the stored digest.
    """
    prefix = call.prompt_prefix
    if prefix is None:
        return call
    if parent is None or parent.call_id != prefix.call_id or parent.rollout_id != call.rollout_id:
        raise UnresolvedPrefixError(
            UnresolvedPrefix.PARENT_MISSING,
            f"call {call.call_id} extends call {prefix.call_id} of rollout {call.rollout_id}, which was not read")
    return _whole(call, prefix, parent)


def _whole(call: ModelCallV1, prefix: PromptPrefix, parent: ModelCallV1) -> ModelCallV1:
    context = context_bytes(parent)
    size = prefix.tokens * 4
    if size > len(context):
        raise UnresolvedPrefixError(
            UnresolvedPrefix.PAST_PARENT_END,
            f"call {call.call_id} takes {prefix.tokens} ids from call {prefix.call_id}, whose context has "
            f"{len(context) // 4}")
    head = context[:size]
    if prefix_digest(head) != prefix.digest:
        raise UnresolvedPrefixError(
            UnresolvedPrefix.PREFIX_MISMATCH,
            f"the first {prefix.tokens} ids of call {prefix.call_id} are not the prefix call {call.call_id} stored")
    earlier = parent.request
    if prefix.messages > len(earlier.messages):
        raise UnresolvedPrefixError(
            UnresolvedPrefix.PAST_PARENT_END,
            f"call {call.call_id} takes {prefix.messages} messages from call {prefix.call_id}, which sent "
            f"{len(earlier.messages)}")
    request = call.request
    whole_request = NormalizedRequest.model_construct(
        messages=[*earlier.messages[:prefix.messages], *request.messages],
        tools=earlier.tools if prefix.tools else request.tools,
        tool_choice=request.tool_choice, sampling=request.sampling, extra=request.extra)
    whole = TokenIds.from_bytes(head + call.prompt_token_ids.to_bytes())
    return call.model_copy(update={"prompt_prefix": None, "prompt_token_ids": whole, "request": whole_request})


class WholeCalls:
    """Whole calls from call events read in produce order (a rollout's events are on one partition).

    Keeps the latest ``max_calls`` whole calls it returned, to resolve the references of later
    ones; a reader that starts mid-topic cannot resolve references to calls before its start.
    """

    def __init__(self, max_calls: int = 4096) -> None:
        """Keep up to ``max_calls`` calls to resolve references against."""
        self._max = max_calls
        self._calls: OrderedDict[tuple[str, str], ModelCallV1] = OrderedDict()

    def whole(self, call: ModelCallV1) -> ModelCallV1:
        """``call`` with its whole prompt, remembered for the calls that reference it.

        Raises:
            UnresolvedPrefixError: its reference does not resolve against the calls read before.
        """
        prefix = call.prompt_prefix
        parent = None if prefix is None else self._calls.get((call.rollout_id, prefix.call_id))
        whole = rebuild(call, parent)
        self._calls[(call.rollout_id, call.call_id)] = whole
        while len(self._calls) > self._max:
            self._calls.popitem(last=False)
        return whole
