"""Which earlier call a call's event references: the turn sharing the longest token prefix, recorded by that reference."""

from __future__ import annotations

from proxy.continuation.history import RolloutHistory, Turn
from proxy.continuation.prefix import refer


def _recorded(history: RolloutHistory, call_id: str, prompt: list[int], sampled: list[int]) -> tuple[str, int] | None:
    reference = refer(history, call_id, prompt, sampled, [], None)
    assert reference.turn is not None
    history.record(reference.turn)
    assert reference.turn.prompt_ids() == prompt  # the history holds the exact prompt, by reference
    return None if reference.prefix is None else (reference.prefix["call_id"], reference.prefix["tokens"])


def test_a_prompt_that_extends_the_last_call_references_its_whole_context() -> None:
    history = RolloutHistory()
    assert _recorded(history, "a", [1, 2, 3], [10, 11]) is None
    assert _recorded(history, "b", [1, 2, 3, 10, 11, 7], [12]) == ("a", 5)
    assert _recorded(history, "c", [1, 2, 3, 10, 11, 7, 12, 8, 9], [13]) == ("b", 7)
    assert history.latest is not None and len(history.latest.added) == 2  # only the new ids are kept


def test_a_fork_references_the_longest_shared_prefix_of_any_kept_call() -> None:
    history = RolloutHistory()
    _recorded(history, "a", [1, 2, 3], [10, 11, 12])
    _recorded(history, "b", [1, 2, 3, 10, 11, 12, 4], [20, 21])
    # The template re-spelled b's sampled 20, 21: the prompt forks inside b's turn.
    assert _recorded(history, "c", [1, 2, 3, 10, 11, 12, 4, 20, 99, 5], [30]) == ("b", 8)
    # A retry of a's turn shares most with a (b shares as much, and the newest wins ties).
    assert _recorded(history, "d", [1, 2, 3, 10, 11, 77], [31]) == ("c", 5)
    assert _recorded(history, "e", [5, 6], [1]) is None  # another conversation: stored whole


def test_a_call_continuation_built_references_its_parent_and_is_its_own_turn() -> None:
    history = RolloutHistory()
    first = Turn.of("a", (), b"", None, [1, 2, 3], [10, 11], None)
    history.record(first)
    built = Turn.of("b", (), b"", first, [7], [12], None)
    reference = refer(history, "b", [1, 2, 3, 10, 11, 7], [12], [{"role": "user", "content": "u"}], None,
                      built=built)
    assert reference.prefix is not None and reference.turn is not None
    assert (reference.prefix["call_id"], reference.prefix["tokens"]) == ("a", 5)
    # The turn to record is continuation's own, carrying the keys later references compare.
    assert reference.turn.parent is first and reference.turn.added.tolist() == [7]
    assert len(reference.turn.message_keys) == 1
    assert len(history) == 1  # nothing is recorded before the event is journalled


def test_the_messages_and_tools_an_event_repeats_are_referenced_too() -> None:
    history = RolloutHistory()
    tools = [{"type": "function", "function": {"name": "ls"}}]
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}
    first = refer(history, "a", [1, 2], [3], [system, user], tools)
    assert first.turn is not None
    history.record(first.turn)
    answer = {"role": "assistant", "content": "x"}
    second = refer(history, "b", [1, 2, 3, 4], [5], [system, user, answer, {"role": "tool", "content": "t"}], tools)
    assert second.prefix == {"call_id": "a", "tokens": 3, "messages": 2, "tools": True}
    # Same content, other key order: not the message the harness sent before, so not referenced.
    third = refer(history, "c", [1, 2, 3, 4], [5], [system, {"content": "u", "role": "user"}], None)
    assert third.prefix == {"call_id": "a", "tokens": 3, "messages": 1, "tools": False}


def test_a_message_orjson_cannot_write_is_kept_whole_not_refused() -> None:
    history = RolloutHistory()
    huge = {"role": "user", "content": "x", "n": 2**70}
    first = refer(history, "a", [1, 2], [3], [huge], None)
    assert first.turn is not None
    history.record(first.turn)
    second = refer(history, "b", [1, 2, 3, 4], [5], [huge, {"role": "user", "content": "y"}], None)
    assert second.prefix == {"call_id": "a", "tokens": 3, "messages": 0, "tools": False}


def test_a_continuation_call_rendered_whole_is_referenced_by_search_and_keeps_its_views() -> None:
    history = RolloutHistory()
    first = Turn.of("a", (), b"", None, [1, 2, 3], [10, 11], None)
    history.record(first)
    view = (("role", "user"),)
    built = Turn.of("b", (view,), b"tools", None, [1, 2, 3, 9, 7], [12], view)  # a full render
    reference = refer(history, "b", [1, 2, 3, 9, 7], [12], [], None, built=built)
    assert reference.prefix is not None and (reference.prefix["call_id"], reference.prefix["tokens"]) == ("a", 3)
    turn = reference.turn
    assert turn is not None and turn.parent is first and turn.prompt_ids() == [1, 2, 3, 9, 7]
    assert (turn.views, turn.tools, turn.answer) == ((view,), b"tools", view)


def test_repeating_a_turn_recorded_as_a_fork_gives_that_turns_own_prompt() -> None:
    """A turn recorded by reference to a shorter prefix of its parent (a fork, or the same prompt
    sent again) is repeated with its own ids, not its parent's whole context."""
    from proxy.continuation.planner import Repeat, repeat_prompt

    history = RolloutHistory()
    first = Turn.of("a", (), b"", None, [1, 2, 3], [10, 11], None)
    history.record(first)
    again = refer(history, "b", [1, 2, 3], [12], [], None).turn  # the same prompt, sampled anew
    assert again is not None and again.shared == 3
    prompt = repeat_prompt(Repeat(again))
    assert prompt.ids() == [1, 2, 3] == again.prompt_ids()
    assert prompt.turn("c", (), b"", [13], None).prompt_ids() == [1, 2, 3]
