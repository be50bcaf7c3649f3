"""The continuation planner: which earlier turn a request extends, the bridge, and each named fallback.

Pure logic on token ids and template views; the real engine's renders are in
tests/integration/proxy/test_continuation_on_vllm.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from consumers.assembler.drift import canonical_tools, template_view
from proxy.continuation.engine import generate_body
from proxy.continuation.history import RolloutHistories, RolloutHistory, Turn
from proxy.continuation.planner import (
    Extend,
    FullRender,
    Repeat,
    bridge,
    choose,
    extend_prompt,
    full_prompt,
    max_new_tokens,
    repeat_prompt,
)
from schemas.drift import DriftReason

CLOSING = (4091, 198)  # ChatML: "<|im_end|>", "\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(arguments: str, *, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return message


def result(text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "c1", "content": text}


def views(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [template_view(m) for m in messages]


def record(history: RolloutHistory, messages: list[dict[str, Any]], answer: dict[str, Any] | None, *,
           prompt: list[int], sampled: list[int], tools: list[Any] | None = TOOLS) -> Turn:
    turn = Turn.of(f"call-{len(history)}", views(messages), canonical_tools(tools), None, prompt, sampled,
                   template_view(answer) if answer is not None else None)
    history.record(turn)
    return turn


def plan(history: RolloutHistory, messages: list[dict[str, Any]], tools: list[Any] | None = TOOLS) -> Any:
    return choose(history, views(messages), canonical_tools(tools))


FIRST = [user("weather in Paris?")]
ANSWER = call('{"city": "Paris"}')


def test_a_request_that_repeats_the_latest_turn_and_its_answer_extends_it() -> None:
    history = RolloutHistory()
    turn = record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 8, 4091])
    # The harness sends the arguments back re-serialised: the same call as the template sees it.
    chosen = plan(history, [*FIRST, call('{"city":"Paris"}'), result("sunny")])
    assert chosen == Extend(turn, 2)


def test_the_extended_prompt_is_the_turns_ids_then_the_bridge_then_only_the_new_ids() -> None:
    history = RolloutHistory()
    turn = record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 8, 4091])
    closed = [1, 2, 3, 50, 51, 4091, 198]  # the template's own writing of the answer, then its closing
    full = [*closed, 4090, 60, 61, 4091, 198, 4090, 70]
    prompt = extend_prompt(Extend(turn, 2), CLOSING, closed, full)
    assert prompt.drift is None
    assert prompt.ids() == [1, 2, 3, 7, 8, 4091, 198, 4090, 60, 61, 4091, 198, 4090, 70]
    assert prompt.added == (198, 4090, 60, 61, 4091, 198, 4090, 70)
    nxt = prompt.turn("call-1", [], b"", [9, 4091], None)
    assert nxt.extends == 6 and nxt.prompt_len == 14
    assert nxt.prompt_ids() == prompt.ids()


def test_a_chain_of_turns_rebuilds_each_whole_prompt() -> None:
    one = Turn.of("a", [], b"", None, [1, 2], [3, 4091], None)
    two = Turn.of("b", [], b"", one, [198, 5], [6, 4091], None)
    three = Turn.of("c", [], b"", two, [198, 7], [8], None)
    assert three.prompt_ids() == [1, 2, 3, 4091, 198, 5, 6, 4091, 198, 7]
    assert three.extends == 8


@pytest.mark.parametrize(("sampled", "expected"), [
    ([7, 8, 4091], [198]),  # stopped on <|im_end|>: only the newline is the template's
    ([7, 8, 9], [4091, 198]),  # cut by max_tokens: the whole closing
    ([7, 8, 4089], [4091, 198]),  # stopped on <|endoftext|>: the template still closes the turn
    ([], [4091, 198]),
])
def test_the_bridge_is_the_closing_the_sampled_ids_do_not_already_end_with(sampled: list[int],
                                                                            expected: list[int]) -> None:
    assert bridge(sampled, CLOSING) == expected


def test_a_request_with_the_same_messages_again_repeats_the_turns_prompt() -> None:
    history = RolloutHistory()
    turn = record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    chosen = plan(history, FIRST)
    assert chosen == Repeat(turn)
    assert repeat_prompt(chosen).ids() == [1, 2, 3]


def test_a_fork_extends_the_latest_turn_it_repeats_not_merely_the_latest_turn() -> None:
    history = RolloutHistory()
    first = record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    record(history, [user("a side question")], None, prompt=[1, 9], sampled=[4091])
    assert plan(history, [*FIRST, ANSWER, result("rain")]) == Extend(first, 2)


def test_the_first_call_is_a_full_render_without_a_reason() -> None:
    assert plan(RolloutHistory(), FIRST) == FullRender(None)


def test_state_lost_when_a_request_continues_a_conversation_the_history_holds_nothing_of() -> None:
    # After a restart without recovery: the request carries an answer this history never saw.
    assert plan(RolloutHistory(), [*FIRST, ANSWER, result("sunny")]) == FullRender(DriftReason.STATE_LOST)


def test_history_rewritten_when_an_earlier_message_changed() -> None:
    history = RolloutHistory()
    record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    assert plan(history, [user("weather in Rome?"), ANSWER, result("sunny")]) == \
        FullRender(DriftReason.HISTORY_REWRITTEN)


def test_history_rewritten_when_the_harness_edited_the_answer() -> None:
    history = RolloutHistory()
    record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    assert plan(history, [*FIRST, call('{"city": "London"}'), result("sunny")]) == \
        FullRender(DriftReason.HISTORY_REWRITTEN)


def test_message_moved_when_a_trailing_context_message_comes_back_after_the_new_turn() -> None:
    history = RolloutHistory()
    context = {"role": "user", "content": "[context] 3 files open"}
    record(history, [*FIRST, context], ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    moved = [*FIRST, ANSWER, result("sunny"), {"role": "user", "content": "[context] 4 files open"}]
    assert plan(history, moved) == FullRender(DriftReason.MESSAGE_MOVED)


def test_tools_changed_when_the_request_offers_other_tools() -> None:
    history = RolloutHistory()
    record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    assert plan(history, [*FIRST, ANSWER, result("sunny")], tools=None) == FullRender(DriftReason.TOOLS_CHANGED)


def test_an_answer_back_without_its_reasoning_extends_the_turn_whose_sampled_ids_keep_it() -> None:
    """The proxy never drops reasoning the model sampled: an Anthropic harness with thinking off is
    never shown it, and the next prompt is still the sampled ids, reasoning included."""
    history = RolloutHistory()
    turn = record(history, FIRST, call('{"city": "Paris"}', reasoning="Paris is in France."), prompt=[1, 2, 3],
                  sampled=[7, 4091])
    assert plan(history, [*FIRST, ANSWER, result("sunny")]) == Extend(turn, 2)
    # The answer with other reasoning than sampled is a rewritten history.
    edited = call('{"city": "Paris"}', reasoning="Something else.")
    assert plan(history, [*FIRST, edited, result("sunny")]) == FullRender(DriftReason.HISTORY_REWRITTEN)


@pytest.mark.parametrize(("closing", "closed", "full"), [
    (CLOSING, [1, 2, 3, 50, 4091, 198], [1, 2, 3, 51, 4091, 198, 4090, 60]),  # the closed render is no prefix
    (CLOSING, [1, 2, 3, 50, 4091], [1, 2, 3, 50, 4091, 4090, 60]),  # the turn does not end with the closing
    ((), [1, 2, 3, 50], [1, 2, 3, 50, 4090, 60]),  # the replica's template has no turn closing
    (CLOSING, [1, 2, 3, 50, 4091, 198], [1, 2, 3, 50, 4091, 198]),  # nothing new rendered after it
])
def test_bridge_mismatch_falls_back_to_the_full_render(closing: tuple[int, ...], closed: list[int],
                                                       full: list[int]) -> None:
    history = RolloutHistory()
    turn = record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    prompt = extend_prompt(Extend(turn, 2), closing, closed, full)
    assert prompt.drift is DriftReason.BRIDGE_MISMATCH
    assert prompt.parent is None and prompt.ids() == full


def test_only_the_newest_kept_turns_are_searched() -> None:
    history = RolloutHistory(keep=1)
    record(history, FIRST, ANSWER, prompt=[1, 2, 3], sampled=[7, 4091])
    record(history, [user("a side question")], None, prompt=[1, 9], sampled=[4091])
    assert isinstance(plan(history, [*FIRST, ANSWER, result("rain")]), FullRender)


def test_a_full_prompt_carries_its_reason() -> None:
    prompt = full_prompt([1, 2], DriftReason.TOOLS_CHANGED)
    assert prompt.ids() == [1, 2] and prompt.drift is DriftReason.TOOLS_CHANGED


@pytest.mark.parametrize(("requested", "prompt_len", "expected"), [
    (None, 1000, 24), (16, 1000, 16), (100, 1000, 24), (16, 1024, 0), (16, 2000, 0)])
def test_max_new_tokens_is_what_was_asked_clamped_to_the_context_left(requested: int | None, prompt_len: int,
                                                                      expected: int) -> None:
    assert max_new_tokens(requested, prompt_len, 1024) == expected


def test_the_generate_body_always_sets_max_tokens_and_logprobs_and_leaves_the_render_alone() -> None:
    # Render leaves out sampling fields equal to their defaults, max_tokens=16 among them.
    rendered = {"request_id": "r", "token_ids": [1, 2], "sampling_params": {"temperature": 1.0}, "stream": False}
    body = generate_body(rendered, [1, 2, 3], max_tokens=16, stream=True)
    assert body["token_ids"] == [1, 2, 3]
    assert body["sampling_params"] == {"temperature": 1.0, "max_tokens": 16, "logprobs": 0}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert rendered["sampling_params"] == {"temperature": 1.0} and rendered["token_ids"] == [1, 2]
    with pytest.raises(ValueError, match="max_tokens"):
        generate_body(rendered, [1], max_tokens=0)


def test_histories_keep_the_most_recently_used_rollouts() -> None:
    histories = RolloutHistories(max_rollouts=2)
    a = histories.of("a")
    histories.of("b")
    assert histories.of("a") is a  # used again: now the most recent
    histories.of("c")  # drops b, the least recently used
    assert len(histories) == 2 and histories.of("a") is a
    record(histories.of("c"), FIRST, ANSWER, prompt=[1], sampled=[4091])
    histories.forget("c")
    assert len(histories.of("c")) == 0
