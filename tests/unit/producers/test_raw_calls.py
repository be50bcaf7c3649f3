"""A call journalled raw and built by the shipper gives the event the proxy would have built itself."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from test_capture_build import CHAT, _capture, _choice, _json, _whole

from producers.capture import CAPTURE_KEYS, event_json, normalize_request
from producers.raw_calls import (
    RAW_CALLS,
    RAW_EXCHANGES,
    EngineExchange,
    pack_raw_call,
    pack_raw_exchange,
    ship_record,
    unpack_raw_call,
    unpack_raw_exchange,
)
from schemas import DeadLetterV1, ModelCallV1, decode
from schemas._errors import DeadLetterErrorType
from schemas.call.v1 import ApiProtocol, CallStatus
from stream import CALLS, DEAD_LETTERS, KafkaSettings, TopicRegistry

REGISTRY = TopicRegistry.from_settings(KafkaSettings(topic_prefix="t."))


def _shipped(capture: Any, status: CallStatus = CallStatus.OK, **kwargs: Any) -> ModelCallV1:
    """Journal record -> shipped Kafka record -> decoded with full validation, checked against build()."""
    topic, key, value, headers = pack_raw_call(capture, status, **kwargs)
    assert topic == RAW_CALLS and key == capture.rollout_id.encode() and headers == ()
    out_topic, out_key, out_value, out_headers = ship_record(REGISTRY, topic, key, value, headers, seq=7)
    assert out_topic == REGISTRY[CALLS].name and out_key == key
    event = decode(list(out_headers), out_value)
    assert isinstance(event, ModelCallV1) and out_key == event.kafka_key()
    direct = _json(capture.build(status, validate=True, **kwargs))
    shipped = _json(event)
    direct["timings"].pop("total_s", None)
    assert shipped == direct
    # Shipping the same record again (a failed batch, a restart) gives the same event: same id.
    again = decode(list(ship_record(REGISTRY, topic, key, value, headers, seq=7)[3]),
                   ship_record(REGISTRY, topic, key, value, headers, seq=7)[2])
    assert again.event_id == event.event_id and again.created_at == event.created_at
    return event


def test_whole_answer_with_versions_and_infinite_logprobs() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice(weight_versions=[{"version": "3", "start": 0, "end": 1},
                                                         {"version": "4", "start": 1, "end": 2}])]))
    event = _shipped(capture, upstream_status_code=200, upstream_replica="http://engine")
    assert list(event.choices[0].logprobs) == [-0.25, float("-inf")]  # JSON has no -inf; the record keeps it


def test_streamed_cut_retry_and_failures() -> None:
    capture = _capture(streamed=True, attempt=2, retry_of="c-0", protocol=ApiProtocol.ANTHROPIC_MESSAGES)
    capture.on_chunk({"id": "x", "model": "m", "prompt_token_ids": [5, 6],
                      "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    capture.on_chunk({"choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [{"logprob": -1.0}]},
                                   "delta": {"tool_calls": [{"index": 0, "id": "t", "function": {"name": "ls"}}]}}]})
    event = _shipped(capture, CallStatus.CLIENT_DISCONNECTED, upstream_status_code=200)
    assert event.retry_of == "c-0" and event.streamed
    failed = _shipped(_capture(), CallStatus.UPSTREAM_UNREACHABLE, error_message="no replica")
    assert failed.error_message == "no replica" and failed.choices == []


def test_the_trace_context_of_the_call_goes_with_its_event() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    capture = _capture()
    capture.on_response(_whole([_choice()]))
    with tracer.start_as_current_span("call") as span:
        record = pack_raw_call(capture, CallStatus.OK)
    trace_id = format(span.get_span_context().trace_id, "032x")
    headers = dict(ship_record(REGISTRY, *record, seq=0)[3])
    assert trace_id in headers["traceparent"].decode()
    assert trace.get_current_span().get_span_context().is_valid is False


def test_a_capture_that_makes_no_valid_event_becomes_a_dead_letter_not_a_stuck_journal() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice(index=-1)]))  # the engine reported a negative choice index
    topic, key, value, headers = pack_raw_call(capture, CallStatus.OK, upstream_status_code=200)
    out_topic, out_key, out_value, out_headers = ship_record(REGISTRY, topic, key, value, headers, seq=41)
    assert out_topic == REGISTRY[DEAD_LETTERS].name and out_key == key
    letter = decode(list(out_headers), out_value)
    assert isinstance(letter, DeadLetterV1)
    assert letter.value == value and letter.offset == 41 and letter.topic == RAW_CALLS
    assert letter.error_type is DeadLetterErrorType.INVALID_EVENT and "greater than or equal to 0" in letter.reason
    again = decode(*reversed(ship_record(REGISTRY, topic, key, value, headers, seq=41)[2:]))
    assert again.event_id == letter.event_id  # sent again after a failed batch: one letter for consumers


@pytest.mark.parametrize("value", [b"not json", orjson.dumps({"rollout_id": "r"}),
                                   orjson.dumps({"_event_id": 3, "_created_at": "2026-01-01T00:00:00+00:00"})])
def test_garbage_raw_records_are_refused_with_a_reason(value: bytes) -> None:
    with pytest.raises(ValueError, match="raw call record"):
        unpack_raw_call(value)
    assert ship_record(REGISTRY, RAW_CALLS, b"r", value, (), seq=0)[0] == REGISTRY[DEAD_LETTERS].name


def test_other_records_pass_through_untouched() -> None:
    record = ("t.openforge.rewards.v1", b"r", b"value", (("h", b"1"),))
    assert ship_record(REGISTRY, *record, seq=3) == record


def _exchange(answer: dict[str, Any], *, weight_version: str | None = None) -> tuple[Any, EngineExchange]:
    """A whole answer as the proxy sees it: the harness's body, what went to the engine, what came back."""
    harness = {**CHAT, "logprobs": True}
    asked = {k: harness[k] for k in CAPTURE_KEYS if k in harness}
    capture = _capture(request=normalize_request(harness, asked))
    sent = {**harness, "model": "served", "return_token_ids": True, "return_weight_versions": True}
    raw = orjson.dumps(answer)
    capture.on_response(orjson.loads(raw))
    capture.weight_version = weight_version
    return capture, EngineExchange(orjson.dumps(sent), raw, asked)


def _finite(choice: dict[str, Any]) -> dict[str, Any]:
    # An engine answer is JSON: its logprobs are finite (or the proxy could not have parsed it).
    return {**choice, "logprobs": {"content": [{"token": "a", "logprob": -0.25}, {"token": "b", "logprob": -3.5}]}}


@pytest.mark.parametrize(("answer", "weight_version"), [
    (_whole([_finite(_choice(weight_versions=[{"version": "3", "start": 0, "end": 1},
                                              {"version": "4", "start": 1, "end": 2}]))]), None),
    (_whole([_finite(_choice(1, stop_reason=13)), _finite(_choice(0, stop_reason="</s>"))]), "base"),
])
def test_a_whole_answer_journalled_as_its_engine_exchange_gives_the_same_event(
        answer: dict[str, Any], weight_version: str | None) -> None:
    capture, exchange = _exchange(answer, weight_version=weight_version)
    topic, key, value, headers = pack_raw_exchange(capture, exchange, upstream_status_code=200,
                                                   upstream_replica="http://engine")
    assert topic == RAW_EXCHANGES and exchange.request in value and exchange.answer in value
    out_topic, out_key, out_value, out_headers = ship_record(REGISTRY, topic, key, value, headers, seq=1)
    event = decode(list(out_headers), out_value)
    assert out_topic == REGISTRY[CALLS].name and isinstance(event, ModelCallV1)
    assert out_key == event.kafka_key()
    direct = _json(capture.build(CallStatus.OK, validate=True, upstream_status_code=200,
                                 upstream_replica="http://engine"))
    assert _json(event) == direct  # token ids, logprobs, versions, request and summary alike
    assert event.timings.total_s > 0 and event.request.extra == {"response_format": {"type": "text"},
                                                                 "logprobs": True}
    assert unpack_raw_exchange(value)[0].event_id == event.event_id


def test_a_damaged_exchange_record_becomes_a_dead_letter() -> None:
    capture, exchange = _exchange(_whole([_finite(_choice())]))
    record = pack_raw_exchange(capture, EngineExchange(exchange.request, b"{not json", exchange.asked),
                               upstream_status_code=200, upstream_replica=None)
    with pytest.raises(ValueError, match="raw exchange record"):
        unpack_raw_exchange(record[2])
    topic, _, value, headers = ship_record(REGISTRY, *record, seq=5)
    letter = decode(list(headers), value)
    assert topic == REGISTRY[DEAD_LETTERS].name and isinstance(letter, DeadLetterV1)
    assert letter.topic == RAW_EXCHANGES and letter.value == record[2]


def test_the_shipper_writes_a_vouched_event_without_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    capture, exchange = _exchange(_whole([_finite(_choice())]))
    exchange_record = pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica=None)
    call_record = pack_raw_call(capture, CallStatus.CLIENT_DISCONNECTED, upstream_status_code=200)

    def refuse(*args: Any, **kwargs: Any) -> ModelCallV1:
        raise AssertionError("the event was built")

    monkeypatch.setattr("producers.raw_calls.event_from_fields", refuse)
    for record in (exchange_record, call_record):
        topic, _, value, headers = ship_record(REGISTRY, *record, seq=1)
        assert topic == REGISTRY[CALLS].name and isinstance(decode(list(headers), value), ModelCallV1)


def test_a_raw_call_of_another_version_is_a_dead_letter_not_an_event_missing_a_field() -> None:
    capture = _capture()
    capture.on_response(_whole([_choice()]))
    topic, key, value, headers = pack_raw_call(capture, CallStatus.OK, upstream_status_code=200)
    newer = orjson.loads(value)
    newer["new_field"] = 1
    out_topic, _, out_value, out_headers = ship_record(REGISTRY, topic, key, orjson.dumps(newer), headers, seq=9)
    letter = decode(list(out_headers), out_value)
    assert out_topic == REGISTRY[DEAD_LETTERS].name and isinstance(letter, DeadLetterV1)
    assert "new_field" in letter.reason



_TOOL_CALL = {"id": "call-1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
_ONE_CHOICE = _finite(_choice())


@pytest.mark.parametrize(("answer", "weight_version"), [
    (_whole([_ONE_CHOICE]), None),
    (_whole([_ONE_CHOICE]), "v7"),
    (_whole([{**_ONE_CHOICE, "weight_versions": [{"version": "3", "start": 0, "end": 2}]}]), "v7"),
    (_whole([{**_ONE_CHOICE, "message": {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]},
              "finish_reason": "tool_calls"}]), None),
    (_whole([{**_ONE_CHOICE, "message": {"content": ""}}]), None),
    (_whole([{**_ONE_CHOICE, "message": {"role": "assistant", "content": "4", "reasoning": "2+2"}}]), None),
    (_whole([{**_ONE_CHOICE, "message": {"content": "4", "reasoning": None, "reasoning_content": "2+2"}}]), None),
    (_whole([{**_ONE_CHOICE, "message": {"content": "4", "reasoning": 5, "reasoning_content": ""}}]), None),
    (_whole([{**_ONE_CHOICE, "message": None, "logprobs": None}]), "v"),
    (_whole([{**_ONE_CHOICE, "token_ids": [7, 8, 9]}]), "v"),  # a logprob short: ids cut to match
    (_whole([{**_ONE_CHOICE, "index": 2, "stop_reason": 13}]), None),
    (_whole([{**_ONE_CHOICE, "stop_reason": "</s>", "finish_reason": None}]), None),
    (_whole([_ONE_CHOICE], usage=None, id=None, prompt_token_ids=None), None),
    (_whole([_ONE_CHOICE], usage={"prompt_tokens": 3.0, "completion_tokens": 2}), None),
    (_whole([{k: v for k, v in _ONE_CHOICE.items() if k not in ("index", "token_ids")}]), "v"),
])
def test_the_usual_whole_answer_maps_straight_to_the_fields_the_capture_gives(
        answer: dict[str, Any], weight_version: str | None) -> None:
    from producers.raw_calls import _answer_fields, _one_choice_fields

    capture, exchange = _exchange(answer, weight_version=weight_version)
    _, _, value, _ = pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica=None)
    meta, chat = orjson.loads(value[8:8 + int.from_bytes(value[:4], "little")]), orjson.loads(exchange.request)
    straight = _one_choice_fields(meta, chat, orjson.loads(exchange.answer))
    general = _answer_fields(meta, chat, orjson.loads(exchange.answer))
    assert straight is not None
    assert straight == general
    # Equal is not enough (1 == 1.0 == True, and key order is part of what the checks accept):
    # the event JSON written from each must be the same bytes (None alike: both validated).
    created = datetime.now(UTC)
    written = event_json(straight, event_id="e" * 32, created_at=created)
    assert written == event_json(general, event_id="e" * 32, created_at=created)
    assert [list(d) for d in (straight, general)] == [list(general)] * 2


@pytest.mark.parametrize("answer", [
    _whole([_ONE_CHOICE, _finite(_choice(1))]),  # several choices
    _whole([{**_ONE_CHOICE, "index": "0"}]),
    _whole([{**_ONE_CHOICE, "token_ids": {"7": 8}}]),
    _whole([{**_ONE_CHOICE, "message": {"role": "assistant", "content": [{"type": "text", "text": "ab"}]}}]),
    _whole([{**_ONE_CHOICE, "message": {"role": "assistant", "content": "ab", "tool_calls": {"0": _TOOL_CALL}}}]),
    _whole([_ONE_CHOICE], usage=[3, 2]),
    _whole([_ONE_CHOICE], prompt_token_ids="1,2,3"),
])
def test_an_unusual_whole_answer_is_left_to_the_capture(answer: dict[str, Any]) -> None:
    from producers.raw_calls import _one_choice_fields

    capture, exchange = _exchange(_whole([_ONE_CHOICE]))
    _, _, value, _ = pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica=None)
    meta = orjson.loads(value[8:8 + int.from_bytes(value[:4], "little")])
    assert _one_choice_fields(meta, orjson.loads(exchange.request), answer) is None


def test_a_record_without_session_headers_maps_as_the_capture_maps_it() -> None:
    from producers.raw_calls import _answer_fields, _one_choice_fields

    capture, exchange = _exchange(_whole([_ONE_CHOICE]))
    _, _, value, _ = pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica=None)
    meta = {**orjson.loads(value[8:8 + int.from_bytes(value[:4], "little")]), "session_headers": None}
    chat = orjson.loads(exchange.request)
    straight = _one_choice_fields(meta, chat, orjson.loads(exchange.answer))
    assert straight is not None and straight["session_headers"] == {}
    assert straight == _answer_fields(meta, chat, orjson.loads(exchange.answer))


def test_a_prompt_prefix_is_cut_and_digested_alike_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas._arrays import TokenIds
    from schemas.call.linear import prefix_digest
    from schemas.call.v1 import PromptPrefix

    capture, exchange = _exchange(_whole([_finite(_choice())]))
    capture.prompt_prefix = {"call_id": "c-0", "tokens": 2, "messages": 1, "tools": True}
    built = capture.build(CallStatus.OK, validate=True, upstream_status_code=200)
    assert built.prompt_prefix == PromptPrefix(call_id="c-0", tokens=2, digest=prefix_digest(TokenIds([1, 2]).to_bytes()),
                                               messages=1, tools=True)
    assert list(built.prompt_token_ids) == [3]
    assert built.request.messages == CHAT["messages"][1:] and built.request.tools is None
    exchange_record = pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica=None)
    call_record = pack_raw_call(capture, CallStatus.OK, upstream_status_code=200)

    def refuse(*args: Any, **kwargs: Any) -> ModelCallV1:
        raise AssertionError("the event was built")

    monkeypatch.setattr("producers.raw_calls.event_from_fields", refuse)  # the vouched path takes prefixes too
    for record in (exchange_record, call_record):
        topic, _, value, headers = ship_record(REGISTRY, *record, seq=1)
        event = decode(list(headers), value)
        assert topic == REGISTRY[CALLS].name and isinstance(event, ModelCallV1)
        assert (event.prompt_prefix, list(event.prompt_token_ids)) == (built.prompt_prefix, [3])
        assert event.request == built.request
