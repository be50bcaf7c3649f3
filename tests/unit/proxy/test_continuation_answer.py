"""Continuation's answers in the chat endpoint's shape: generate's ids put on derender's choices."""

from __future__ import annotations

from proxy.continuation.answer import _add_ids, _merged, _without_nulls


def _step(ids: list[int], finish: str | None = None, spans: list[dict[str, object]] | None = None) -> dict[str, object]:
    return {"request_id": "g", "choices": [{
        "index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None, "weight_versions": spans,
        "logprobs": {"content": [{"token_id": i, "logprob": -float(i)} for i in ids]}}]}


def test_generate_chunks_that_came_together_are_derendered_as_one() -> None:
    spans = [{"version": "1", "start": 0, "end": 3}]
    merged = _merged([_step([5]), _step([6, 7], "length", spans)])
    [choice] = merged["choices"]
    assert choice["token_ids"] == [5, 6, 7]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-5.0, -6.0, -7.0]
    assert (choice["finish_reason"], choice["weight_versions"]) == ("length", spans)


def test_a_derendered_chunk_gets_generate_s_ids_logprobs_and_spans() -> None:
    spans = [{"version": "1", "start": 0, "end": 2}]
    choice: dict[str, object] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": None}
    _add_ids(choice, _step([8, 9], "stop", spans)["choices"][0])  # type: ignore[index]
    assert choice["token_ids"] == [8, 9] and choice["weight_versions"] == spans
    assert choice["logprobs"] == {"content": [{"token_id": 8, "logprob": -8.0}, {"token_id": 9, "logprob": -9.0}]}
    assert choice["finish_reason"] == "stop"


def test_a_whole_answer_keeps_derender_s_logprobs_with_their_token_strings() -> None:
    theirs = {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]}
    choice: dict[str, object] = {"index": 0, "logprobs": theirs, "finish_reason": "tool_calls"}
    _add_ids(choice, _step([1, 2], "stop")["choices"][0])  # type: ignore[index]
    assert choice["logprobs"] is theirs and choice["finish_reason"] == "tool_calls"


def test_a_derendered_delta_leaves_out_what_has_no_value() -> None:
    delta = {"role": None, "content": None, "tool_calls": [{"id": None, "index": 0,
                                                            "function": {"name": None, "arguments": "{"}}]}
    assert _without_nulls(delta) == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
