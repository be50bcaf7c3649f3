"""The call event built without validation equals the validated one, and bad engine data still fails."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from producers.capture import CallCapture, event_from_fields, event_json, normalize_request
from schemas import ModelCallV1, decode, encode
from schemas.call.v1 import ApiProtocol, CallStatus, NormalizedRequest

CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi", "name": None}],
        "max_tokens": 4, "temperature": 0.5, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]}

VOLATILE = ("event_id", "created_at")


def _capture(**overrides: Any) -> CallCapture:
    fields: dict[str, Any] = {
        "rollout_id": "r-1", "call_id": "c-1", "protocol": ApiProtocol.OPENAI_CHAT, "model": "m",
        "request": normalize_request(CHAT, {"logprobs": True}), "streamed": False, "task_id": "t-1",
        "headers": {"user-agent": "harness/1.0", "x-session-id": "s"},
    }
    fields.update(overrides)
    return CallCapture(**fields)


def _whole(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-1", "model": "m", "prompt_token_ids": [1, 2, 3], "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}},
            **extra}


def _choice(index: int = 0, ids: tuple[int, ...] = (7, 8), **extra: Any) -> dict[str, Any]:
    return {"index": index, "token_ids": list(ids), "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ab"},
            "logprobs": {"content": [{"token": "a", "logprob": -0.25}, {"token": "b", "logprob": float("-inf")}]},
            **extra}


def _json(event: ModelCallV1) -> dict[str, Any]:
    value, _ = encode(event)
    body = orjson.loads(value)
    for key in VOLATILE:
        body.pop(key)
    body["timings"].pop("total_s")
    return body


def _same_json(data: dict[str, Any], created_at: datetime = datetime(2026, 5, 4, 3, 2, 1, 123456, tzinfo=UTC)
               ) -> bytes | None:
    """``event_json`` of the fields, checked byte for byte against pydantic's JSON of the validated event."""
    written = event_json(data, event_id="e" * 32, created_at=created_at)
    try:
        validated = event_from_fields(data, event_id="e" * 32, created_at=created_at, validate=True)
    except ValidationError:
        assert written is None  # what would not validate is never written straight
        raise
    if written is not None:
        assert written == encode(validated)[0]
    return written


def _both(capture: CallCapture, status: CallStatus = CallStatus.OK, **kwargs: Any) -> ModelCallV1:
    fast = capture.build(status, **kwargs)
    slow = capture.build(status, validate=True, **kwargs)
    # The shipper's path: the event's JSON written straight from the fields, whenever the checks vouch.
    assert _same_json(capture.fields(status, **kwargs)) is not None
    assert list(_json(fast)) == list(_json(slow))  # same keys in the same order
    assert _json(fast) == _json(slow)
    # What went out without validation must pass it on the way in.
    value, headers = encode(fast)
    decoded = decode(headers, value)
    assert isinstance(decoded, ModelCallV1)
    assert decoded == fast
    return fast


def test_whole_answer_with_engine_versions() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice(weight_versions=[{"version": "3", "start": 0, "end": 1},
                                                         {"version": "4", "start": 1, "end": 2}])]))
    event = _both(capture, upstream_status_code=200, upstream_replica="http://engine")
    assert [r.version for r in event.choices[0].weight_versions] == ["3", "4"]
    assert event.usage is not None and event.usage.cached_prompt_tokens == 1


def test_whole_answer_with_proxy_version_and_two_choices() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice(1, stop_reason=13), _choice(0, stop_reason="</s>")]))
    capture.weight_version = "base"
    event = _both(capture, upstream_status_code=200)
    assert [c.index for c in event.choices] == [0, 1]


def test_streamed_cut_with_tool_calls_and_retry() -> None:
    capture = _capture(streamed=True, attempt=2, retry_of="c-0", protocol=ApiProtocol.ANTHROPIC_MESSAGES)
    capture.on_chunk({"id": "x", "model": "m", "prompt_token_ids": [5, 6],
                      "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    capture.on_chunk({"choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [{"logprob": -1.0}]},
                                   "delta": {"tool_calls": [{"index": 0, "id": "t", "function": {"name": "ls"}}]}}]})
    capture.on_chunk({"choices": [{"index": 0, "token_ids": [10],
                                   "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]})
    event = _both(capture, CallStatus.CLIENT_DISCONNECTED, upstream_status_code=200, error_message=None)
    assert event.choices[0].completion_token_ids == [9]  # the unlogprobbed token is cut


def test_the_reasoning_text_is_in_the_summary_streamed_or_whole() -> None:
    # Its tokens are in the completion ids either way; without its text a reader of the event
    # would see ids that no part of the summary says.
    streamed = _capture(streamed=True)
    streamed.on_chunk({"id": "cmpl-1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for ids, delta in [([7], {"reasoning": "Two plus ", "reasoning_content": "Two plus "}),
                       ([8], {"reasoning": "two."}), ([9], {"content": "4"})]:
        streamed.on_chunk({"choices": [{"index": 0, "token_ids": ids, "delta": delta,
                                        "logprobs": {"content": [{"logprob": -0.5}]}}]})
    streamed.on_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    whole = _capture()
    whole.on_response(_whole([_choice(ids=(7, 8, 9), logprobs={"content": [{"logprob": -0.5}] * 3}, message={
        "role": "assistant", "content": "4", "reasoning": None, "reasoning_content": "Two plus two."})]))
    for capture in (streamed, whole):
        event = _both(capture, upstream_status_code=200)
        assert isinstance(event.response, dict)
        assert event.response["choices"][0]["message"] == {"role": "assistant", "content": "4",
                                                           "reasoning": "Two plus two."}


def test_failures_and_untranslated_requests() -> None:
    bare = _capture(request=NormalizedRequest(messages=[], extra={"untranslated": {"weird": [1, None]}}))
    event = _both(bare, CallStatus.INVALID_REQUEST, error_message="malformed JSON")
    assert event.error_message == "malformed JSON"
    # status ok without choices becomes an upstream error on both paths
    assert _both(_capture(), upstream_status_code=200).status is CallStatus.UPSTREAM_ERROR


@pytest.mark.parametrize(("choice", "needle"), [
    (_choice(index=-1), "greater than or equal to 0"),
    (_choice(finish_reason=3), "finish_reason"),
    (_choice(weight_versions=[{"version": "1", "start": 0, "end": 1}]), "cover every token"),
    (_choice(weight_versions=[{"version": "", "start": 0, "end": 2}]), "version"),
])
def test_bad_engine_data_still_fails_validation(choice: dict[str, Any], needle: str) -> None:
    capture = _capture()
    capture.on_response(_whole([choice]))
    with pytest.raises(ValidationError, match=needle):
        capture.build(CallStatus.OK, upstream_status_code=200)
    with pytest.raises(ValidationError, match=needle):
        _same_json(capture.fields(CallStatus.OK, upstream_status_code=200))


@pytest.mark.parametrize("content", [
    "plain", "", "naïve \u2013 漢字 🙂", "quotes \" and \\ backslash / slash", "controls \x00\x01\x1f\x7f\n\t",
    "\u2028\u2029 separators", "<script>&amp;</script>",
])
def test_the_json_written_straight_equals_pydantics_byte_for_byte(content: str) -> None:
    chat = {**CHAT, "messages": [{"role": "user", "content": content, "n": [1, -2, 2**53 + 1, 2**63 - 1]}],
            "temperature": 1e-7, "top_p": 0.1, "seed": -1, "stop": [content], "logit_bias": {"12": -100.0},
            "metadata": {"nested": {"deep": [None, True, False, 1.5e16, -0.0, 3.0]}}}
    capture = _capture(request=normalize_request(chat, {}), headers={"user-agent": content or "x"})
    capture.on_response(_whole([_choice(message={"role": "assistant", "content": content,
                                                 "tool_calls": [{"id": "t", "type": "function",
                                                                 "function": {"name": "ls", "arguments": "{}"}}]},
                                        stop_reason=content or None)],
                               prompt_token_ids=[*range(0, 150_000, 97), 2**31 - 1]))
    capture.weight_version = "v-" + "9" * 100
    data = capture.fields(CallStatus.OK, upstream_status_code=200, upstream_replica="http://e:8000")
    for created in (datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)):
        assert _same_json(data, created) is not None
    data["timings"]["total_s"] = 1e-9
    data["timings"]["time_to_first_token_s"] = 12345.678901234567
    assert _same_json(data) is not None


def test_fields_the_checks_do_not_vouch_for_are_not_written_straight() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice()]))
    data = capture.fields(CallStatus.OK, upstream_status_code=200)
    created = datetime(2026, 1, 1, tzinfo=UTC)
    # A time not in UTC: the validating path converts it, this one leaves it alone.
    assert event_json(data, event_id="e" * 32, created_at=datetime.fromisoformat("2026-01-01T01:00:00+01:00")) is None
    # A request built by hand with values JSON cannot hold as they are.
    odd = {**data, "request": NormalizedRequest.model_construct(messages=[{"content": object()}], tools=None,
                                                                 tool_choice=None, sampling={}, extra={})}
    assert event_json(odd, event_id="e" * 32, created_at=created) is None
    # Token ids out of int32, versions that do not cover the tokens.
    assert event_json({**data, "prompt_token_ids": [2**31]}, event_id="e" * 32, created_at=created) is None
    bad_versions = [{**data["choices"][0], "weight_versions": [{"version": "1", "start": 0, "end": 1}]}]
    assert event_json({**data, "choices": bad_versions}, event_id="e" * 32, created_at=created) is None
    # Ids the event refuses.
    assert event_json(data, event_id="", created_at=created) is None
    assert event_json(data, event_id="e" * 129, created_at=created) is None
    # Keys of another version of the record: unknown ones would be dropped, missing ones defaulted.
    assert event_json({**data, "new_field": 1}, event_id="e" * 32, created_at=created) is None
    assert event_json({k: v for k, v in data.items() if k != "response"}, event_id="e" * 32,
                      created_at=created) is None
    extra_key = [{**data["choices"][0], "text": "x"}]
    assert event_json({**data, "choices": extra_key}, event_id="e" * 32, created_at=created) is None
    # Shapes validation refuses though packing or orjson would take them.
    for shape in ({"prompt_token_ids": {}}, {"prompt_token_ids": iter([1])}, {"choices": {}},
                  {"choices": [{**data["choices"][0], "weight_versions": ""}]},
                  {"choices": [{**data["choices"][0], "completion_token_ids": (7, 8)}]}):
        assert event_json({**data, **shape}, event_id="e" * 32, created_at=created) is None, shape
    for request in ({"messages": "hi"}, {"tools": 5}, {"sampling": [1]}, {"extra": None}):
        fields = {"messages": [], "tools": None, "tool_choice": None, "sampling": {}, "extra": {}, **request}
        odd = {**data, "request": NormalizedRequest.model_construct(**fields)}
        assert event_json(odd, event_id="e" * 32, created_at=created) is None, request
    assert event_json(data, event_id="e" * 32, created_at=created) is not None


def test_bad_usage_and_headers_still_fail_validation() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice()], usage={"prompt_tokens": -1, "completion_tokens": 2}))
    with pytest.raises(ValidationError, match="prompt_tokens"):
        capture.build(CallStatus.OK)
    leaky = _capture(headers={"authorization": "Bearer x"})
    leaky.on_response(_whole([_choice()]))
    with pytest.raises(ValidationError, match="credentials"):
        leaky.build(CallStatus.OK)


def test_request_that_is_not_json_shaped_is_validated() -> None:
    with pytest.raises(ValidationError, match="messages"):
        normalize_request({"messages": "hello"}, {})
    # Adapters build plain JSON values; something that is not one cannot reach Kafka silently.
    capture = _capture(request=normalize_request({"messages": [{"content": object()}]}, {}))
    capture.on_response(_whole([_choice()]))
    with pytest.raises(PydanticSerializationError):
        encode(capture.build(CallStatus.OK))


def test_no_credential_header_is_recorded_whatever_its_name() -> None:
    from producers.capture import session_headers

    sent = {
        "User-Agent": "claude-cli/2.1.332", "X-Claude-Code-Session-Id": "s-1", "x-stainless-retry-count": "0",
        "anthropic-version": "2023-06-01", "session_id": "c-9", "traceparent": "00-ab-cd-01",
        "Authorization": "Bearer t", "x-api-key": "k", "x-goog-api-key": "k", "x-auth-token": "t",
        "api_key": "k", "Authentication": "t", "x-amz-security-token": "t", "ocp-apim-subscription-key": "k",
        "x-forwarded-authorization": "t", "cf-access-client-secret": "s", "anthropic-api-key": "k",
        "Cookie": "c", "x-db-password": "p", "x-request-signature": "s",
    }
    assert session_headers(sent) == {
        "user-agent": "claude-cli/2.1.332", "x-claude-code-session-id": "s-1", "x-stainless-retry-count": "0",
        "anthropic-version": "2023-06-01", "session_id": "c-9", "traceparent": "00-ab-cd-01"}
