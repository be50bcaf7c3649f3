"""Whole prompts rebuilt from linear call events, and each reference that does not resolve refused by name."""

from __future__ import annotations

import itertools

import pytest
from assembler_factories import call, conversation
from linear_calls import linked

from schemas import ModelCallV1, decode, encode
from schemas.call.linear import UnresolvedPrefix, UnresolvedPrefixError, rebuild


def test_a_conversation_stored_linearly_rebuilds_to_the_same_calls() -> None:
    whole = conversation("r", 5, seed=3)
    stored = [whole[0], *(linked(c, p) for p, c in itertools.pairwise(whole))]
    assert all(s.prompt_prefix is not None for s in stored[1:])
    rebuilt = [stored[0]]
    for event in stored[1:]:
        event = decode(*reversed(encode(event)))  # through the wire form
        assert isinstance(event, ModelCallV1)
        rebuilt.append(rebuild(event, rebuilt[-1]))
    assert [list(c.prompt_token_ids) for c in rebuilt] == [list(c.prompt_token_ids) for c in whole]
    assert all(c.prompt_prefix is None for c in rebuilt)


def test_messages_and_tools_stored_by_reference_are_rebuilt_in_order() -> None:
    from schemas.call.v1 import NormalizedRequest

    tools = [{"type": "function", "function": {"name": "ls"}}]
    system, user, answer = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"a": 1}
    first = call([1, 2], [3], call_id="a").model_copy(
        update={"request": NormalizedRequest(messages=[system, user], tools=tools)})
    second = call([1, 2, 3, 4], [5], call_id="b").model_copy(
        update={"request": NormalizedRequest(messages=[system, user, answer], tools=tools)})
    stored = linked(second, first, messages=2, tools=True)
    assert stored.request.messages == [answer] and stored.request.tools is None
    assert rebuild(stored, first).request == second.request
    assert _refused(linked(second, first, messages=3), first) is UnresolvedPrefix.PAST_PARENT_END


def test_a_fork_references_the_shared_prefix_only() -> None:
    first = call([1, 2, 3], [10, 11, 12], call_id="a")
    second = call([1, 2, 3, 10, 99, 7], [13], call_id="b")  # the template re-spelled 11, 12 as 99
    stored = linked(second, first, 4)
    assert list(stored.prompt_token_ids) == [99, 7]
    assert list(rebuild(stored, first).prompt_token_ids) == [1, 2, 3, 10, 99, 7]


def _refused(event: ModelCallV1, parent: ModelCallV1 | None) -> UnresolvedPrefix:
    with pytest.raises(UnresolvedPrefixError) as caught:
        rebuild(event, parent)
    return caught.value.reason


def test_references_that_do_not_resolve_are_refused_with_their_reason() -> None:
    first = call([1, 2, 3], [10, 11], call_id="a")
    second = call([1, 2, 3, 10, 11, 7], [12], call_id="b")
    assert _refused(linked(second, first), None) is UnresolvedPrefix.PARENT_MISSING
    assert _refused(linked(second, first), call([1], [2], call_id="other")) is UnresolvedPrefix.PARENT_MISSING
    assert _refused(linked(second, first, 6), first) is UnresolvedPrefix.PAST_PARENT_END
    assert _refused(linked(second, first, digest="0" * 32), first) is UnresolvedPrefix.PREFIX_MISMATCH
    shorter = call([1, 2, 3], [10, 12], call_id="a")  # what the reader holds differs from what the proxy saw
    assert _refused(linked(second, first), shorter) is UnresolvedPrefix.PREFIX_MISMATCH


def test_a_call_cannot_reference_itself() -> None:
    first = call([1, 2, 3], [10], call_id="a")
    with pytest.raises(ValueError, match="prompt prefix from itself"):
        linked(call([1, 2, 3, 10], [4], call_id="a"), first).model_validate(
            linked(call([1, 2, 3, 10], [4], call_id="a"), first).model_dump())
