"""The compiled fast path makes exactly the event the Python path makes, or leaves the record to it.

``openforge_native.exchange_event`` repeats, in compiled code, what ``producers.raw_calls`` and
``producers.capture.event_json`` do with a whole answer's journal record. Each test here ships a
record both ways (``ship_record(..., native=True)`` and ``native=False``) and requires the same
Kafka record: topic, key, headers, and the same JSON values. Hundreds of records are made by
changing one thing at a time in a realistic one (every field's usual values, edge values and
wrong types), and the tests also count how often the compiled path answered, so that a path that
always gave up would fail them.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

import openforge_native
import orjson
import pytest
from test_capture_build import CHAT

from producers import capture as capture_module
from producers import spool as spool_module
from producers.capture import CAPTURE_KEYS, SAMPLING_KEYS, CallCapture, normalize_request
from producers.raw_calls import NATIVE, RAW_EXCHANGES, EngineExchange, pack_raw_exchange, ship_record
from schemas import ModelCallV1, decode
from schemas.call.v1 import _CREDENTIAL_HEADERS, ApiProtocol
from stream import CALLS, DEAD_LETTERS, KafkaSettings, TopicRegistry

REGISTRY = TopicRegistry.from_settings(KafkaSettings(topic_prefix="t."))
_LENGTHS = struct.Struct("<II")

ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1764600000, "model": "tiny",
    "prompt_token_ids": [0, 1, 2, 150_000, 2**31 - 1],
    "choices": [{
        "index": 0, "token_ids": [7, 8, 9],
        "message": {"role": "assistant", "content": "caf\u00e9 \"quoted\" \\ \n\t\u2028 \U0001f600", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}],
            "reasoning": "The user wants a listing.\n", "reasoning_content": None},
        "logprobs": {"content": [
            {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []},
            {"token": "b", "logprob": -9999.0, "bytes": [98], "top_logprobs": [{"token": "c", "logprob": -1.5}]},
            {"token": "c", "logprob": -1.2345678901234567e-300, "bytes": [99], "top_logprobs": []}]},
        "weight_versions": [{"version": "v3", "start": 0, "end": 2}, {"version": "v4", "start": 2, "end": 3}],
        "finish_reason": "tool_calls", "stop_reason": None}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 4}},
    "system_fingerprint": None, "kv_transfer_params": None,
}


def _base_meta() -> tuple[dict[str, Any], bytes]:
    """A whole answer's record metadata and chat request, as the proxy's own code packs them."""
    chat = {**CHAT, "top_k": 20, "user": "u-1", "stream": False, "seed": 7,
            "logprobs": True, "return_token_ids": True, "return_weight_versions": True}
    asked = {"top_logprobs": 2}
    capture = CallCapture(
        rollout_id="r-1", call_id="c-2", protocol=ApiProtocol.OPENAI_CHAT, model="tiny",
        request=normalize_request(chat, asked), streamed=False, task_id="t-1", attempt=1, retry_of="c-1",
        headers={"user-agent": "harness/1.0", "x-session-id": "s \u00e9"})
    capture.first_token_s = 0.0125
    capture.weight_version = "v4"
    sent = orjson.dumps(chat)
    _, _, value, _ = pack_raw_exchange(capture, EngineExchange(sent, orjson.dumps(ANSWER), asked),
                                       upstream_status_code=200, upstream_replica="http://engine-0:8000")
    head_length = _LENGTHS.unpack_from(value)[0]
    meta = orjson.loads(value[_LENGTHS.size:_LENGTHS.size + head_length])
    meta["_trace"] = [["traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]]
    return meta, sent


META, SENT = _base_meta()
CHAT_SENT: dict[str, Any] = orjson.loads(SENT)


def _record(meta: dict[str, Any] = META, chat: Any = CHAT_SENT, answer: Any = ANSWER, *,
            dumps: Callable[[Any], bytes] = orjson.dumps) -> bytes:
    head, request, body = orjson.dumps(meta), dumps(chat), dumps(answer)
    return _LENGTHS.pack(len(head), len(request)) + head + request + body


def _both(value: bytes) -> bool:
    """Ship ``value`` both ways, require the same Kafka record; True when the compiled path made it."""
    made = openforge_native.exchange_event(value)
    native = ship_record(REGISTRY, RAW_EXCHANGES, b"r", value, (), 3, native=True)
    python = ship_record(REGISTRY, RAW_EXCHANGES, b"r", value, (), 3, native=False)
    assert native[0] == python[0] and native[1] == python[1] and native[3] == python[3]
    native_json, python_json = orjson.loads(native[2]), orjson.loads(python[2])
    if native[0] == REGISTRY[DEAD_LETTERS].name:  # a letter's time is when it was written
        native_json.pop("created_at"), python_json.pop("created_at")
    assert native_json == python_json
    if made is not None:
        assert native[0] == REGISTRY[CALLS].name
        event = decode(list(native[3]), native[2])  # validates every field
        assert isinstance(event, ModelCallV1)
    return made is not None


def test_the_compiled_path_is_installed_and_holds_the_same_facts() -> None:
    assert NATIVE, "openforge_native is not installed: `make install` builds it (needs cargo)"
    assert openforge_native.MAX_ID == capture_module._MAX_ID
    assert openforge_native.MAX_VERSION == capture_module._MAX_VERSION
    assert openforge_native.MAX_EVENT_ID == capture_module._MAX_EVENT_ID
    assert [p.value for p in ApiProtocol] == openforge_native.PROTOCOLS
    assert set(openforge_native.CREDENTIAL_HEADERS) == _CREDENTIAL_HEADERS
    assert set(openforge_native.SAMPLING_KEYS) == SAMPLING_KEYS
    assert set(openforge_native.CAPTURE_KEYS) == CAPTURE_KEYS
    assert set(openforge_native.STRUCTURE_KEYS) == capture_module._STRUCTURE_KEYS
    assert openforge_native.RECORD_MAGIC == spool_module._MAGIC  # the journal's frame writer's


def test_a_usual_record_is_made_natively_byte_for_byte() -> None:
    value = _record()
    made = openforge_native.exchange_event(value)
    assert made is not None
    python = ship_record(REGISTRY, RAW_EXCHANGES, b"r", value, (), 3, native=False)
    assert made[0] == python[2]  # orjson's bytes exactly, escapes and floats included
    assert made[1] == "r-1"
    assert made[2] == [("traceparent", META["_trace"][0][1].encode())]
    assert _both(value)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(target: dict[str, Any]) -> None:
        for step in path[:-1]:
            target = target[step]
        if value is _DELETE:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
    return change


_DELETE = object()
_WRONG = [None, 0, -1, 1.5, True, "", "x", [], {}, [1], {"a": 1}, 2**63, 2**64 + 1]


def _answer_changes() -> Iterator[tuple[str, Callable[[dict[str, Any]], None]]]:
    choice = ("choices", 0)
    fields: dict[tuple[Any, ...], list[Any]] = {
        ("id",): [_DELETE, *_WRONG],
        ("model",): [_DELETE, None, 5, "m"],
        ("choices",): [_DELETE, None, [], [5], [[0, [7, 8, 9]]], "x", {}, ANSWER["choices"] * 2],
        ("prompt_token_ids",): [_DELETE, None, [], [-1], [2**31], [2**32], [1.0], [True], "1,2", {}, 0],
        ("usage",): [_DELETE, None, {}, 5, [], {"total_tokens": 1}],
        ("usage", "prompt_tokens"): [_DELETE, None, 0, 3.5, "3", -1, True, 2**64],
        ("usage", "completion_tokens"): [_DELETE, None, 0, 2.0],
        ("usage", "prompt_tokens_details"): [_DELETE, None, {}, 5, [], {"cached_tokens": None}],
        ("usage", "prompt_tokens_details", "cached_tokens"): [_DELETE, None, 0, -1, 1.5, "4", True],
        (*choice,): [5, [], "x", None],
        (*choice, "index"): [_DELETE, None, -1, True, 1, "0", 2**70, 0.0],
        (*choice, "token_ids"): [_DELETE, None, [], [7, 8], [7, 8, 9, 10], [7, -8, 9], [7, 8.0, 9], 0, {}],
        (*choice, "weight_versions"): [
            _DELETE, None, [], 0, {}, [{"version": "v", "start": 0, "end": 3}],
            [{"version": "v", "start": 0, "end": 99}], [{"version": "v", "start": 1, "end": 3}],
            [{"version": "v", "start": 0, "end": 1}, {"version": "w", "start": 2, "end": 3}],
            [{"version": "v", "start": 0, "end": 2}], [{"version": "", "start": 0, "end": 3}],
            [{"version": 5, "start": 0, "end": 3}], [{"version": "v" * 129, "start": 0, "end": 3}],
            [{"version": "v" * 128, "start": 0, "end": 3}], [{"version": "v", "start": 0.0, "end": 3}],
            [["v", 0, 3]], [{"version": "v", "start": 0, "end": 3, "extra": 1}],
            [{"version": "v", "start": 0, "end": 0}, {"version": "w", "start": 0, "end": 3}],
            [{"version": "v", "start": 0, "end": 3}, {"version": "w", "start": 3, "end": 5}]],
        (*choice, "message"): [_DELETE, None, {}, [], "x", {"role": "assistant"}],
        (*choice, "message", "role"): [_DELETE, None, "", 5, "tool"],
        (*choice, "message", "content"): [_DELETE, None, "", 5, ["part"], "\x00\x1f\x7f\ud7ff"],
        (*choice, "message", "tool_calls"): [_DELETE, None, [], {}, "x", 0, [1, 2]],
        (*choice, "message", "reasoning"): [_DELETE, None, "", 5, ["part"], "Think \u00e9\n\"first\"."],
        (*choice, "message", "reasoning_content"): [_DELETE, "", 5, "Older name.", "\x00\ud7ff"],
        (*choice, "logprobs"): [_DELETE, None, {}, [], "x", {"content": None}, {"content": []}, {"content": "ab"},
                                {"content": {}}],
        (*choice, "logprobs", "content", 0): [5, [], {"token": "a"}, {"logprob": 0}, {"logprob": True},
                                              {"logprob": "-1.5"}, {"logprob": None}, {"logprob": 5e-324},
                                              {"logprob": -1e308}, {"logprob": 2**64}],
        (*choice, "finish_reason"): [_DELETE, None, 5, "stop", "length", ""],
        (*choice, "stop_reason"): [_DELETE, None, "</s>", 7, -1, 0, True, 1.5, 2**63, 2**63 - 1, [1], ""],
    }
    for path, values in fields.items():
        for value in values:
            yield f"{path}={value!r:.40}", _set(path, value)


def _meta_changes() -> Iterator[tuple[str, Callable[[dict[str, Any]], None]]]:
    fields: dict[str, list[Any]] = {
        "rollout_id": [_DELETE, "", "r" * 256, "r" * 257, 5, None, "\u00e9" * 256],
        "task_id": [_DELETE, None, "", "t" * 257],
        "call_id": [_DELETE, "", "c-1", None],
        "attempt": [_DELETE, 0, -1, True, 1.0, 2**64],
        "retry_of": [_DELETE, None, "", "c-2"],
        "protocol": [_DELETE, "anthropic_messages", "openai_responses", "bogus", 5],
        "model": [_DELETE, "", 5, "m" * 300],
        "streamed": [_DELETE, True, "yes", 1],
        "session_headers": [_DELETE, None, {}, {"X-Up": "1"}, {"authorization": "x"}, {"k": 5}, {"\u00e9": "v"},
                            [], 0, {"x-api-key": "k"}, {"a": "1", "b": "\u00e9\n"}],
        "started_at": [_DELETE, "2026-12-01T17:00:00+00:00", "2026-12-01T17:00:00.000000+00:00",
                       "2026-12-01T17:00:00.5+00:00", "2026-12-01T17:00:00+01:00", "2026-12-01T17:00:00Z",
                       "2026-12-01T17:00:00", "2026-02-30T17:00:00+00:00", "2024-02-29T00:00:00+00:00",
                       "2023-02-29T00:00:00+00:00", "2026-12-01 17:00:00+00:00", "0000-01-01T00:00:00+00:00",
                       "2026-12-01T24:00:00+00:00", "2026-12-01T17:00:60+00:00", 5, None],
        "first_token_s": [_DELETE, None, 0, 0.0, -1.0, 1, "1", 1e-7, 1e308],
        "total_s": [_DELETE, None, 0, 0.0, -0.5, 2.5e-05, "2"],
        "weight_version": [_DELETE, None, "", 5, "v" * 129, "v9"],
        "asked": [_DELETE, None, {}, {"logprobs": True, "top_logprobs": 0}, {"user": "other"}, {"temperature": 2.0},
                  [], {"stream_options": {"include_usage": True}}],
        "upstream_status_code": [_DELETE, None, 99, 100, 599, 600, True, 200.0],
        "upstream_replica": [_DELETE, None, 5, ""],
        "_event_id": [_DELETE, "", "e" * 128, "e" * 129, 5],
        "_created_at": [_DELETE, "2026-12-01T17:00:00+00:00", "2026-12-01T17:00:00.000001+00:00",
                        "2026-12-01T17:00:00-05:00", "2026-13-01T00:00:00+00:00", None],
        "_trace": [_DELETE, [], [["a", "b"], ["c", "d"]], [["a", 5]], [["a"]], "x", None],
    }
    for name, values in fields.items():
        for value in values:
            yield f"{name}={value!r:.40}", _set((name,), value)


def _chat_changes() -> Iterator[tuple[str, Callable[[dict[str, Any]], None]]]:
    fields: dict[str, list[Any]] = {
        "messages": [_DELETE, None, [], "x", {}, 0, [{"role": "user", "content": "\u00e9\x00"}]],
        "tools": [_DELETE, None, [], "x", {}],
        "tool_choice": [_DELETE, None, "auto", {"type": "function", "function": {"name": "ls"}}],
        "temperature": [_DELETE, None, 0, "hot"],
        "user": [_DELETE, None],
        "model": [_DELETE],
        "stream": [_DELETE, True],
        "extra_body_field": [{"nested": [1, 2.5, None, "x"]}],
    }
    for name, values in fields.items():
        for value in values:
            yield f"{name}={value!r:.40}", _set((name,), value)


@pytest.mark.parametrize("where", ["answer", "meta", "chat"])
def test_every_change_to_one_field_gives_the_same_record_both_ways(where: str) -> None:
    changes = {"answer": _answer_changes, "meta": _meta_changes, "chat": _chat_changes}[where]()
    made = total = 0
    for name, change in changes:
        meta, chat, answer = copy.deepcopy(META), copy.deepcopy(CHAT_SENT), copy.deepcopy(ANSWER)
        change({"answer": answer, "meta": meta, "chat": chat}[where])
        try:
            value = _record(meta, chat, answer)
        except orjson.JSONEncodeError:
            continue  # a value JSON cannot hold (an int beyond 64 bits): no proxy writes it
        try:
            made += _both(value)
        except AssertionError as exc:
            raise AssertionError(f"{where} {name}: {exc}") from exc
        total += 1
    # Both outcomes happen: the compiled path takes the usual values and leaves the rest.
    print(f"{where}: {made} of {total} records made by the compiled path")
    assert 0.2 * total < made < total, (made, total)


def test_json_as_other_writers_write_it_gives_the_same_values() -> None:
    """Spaces, ASCII escapes, and floats in other spellings: copied as they are, equal as JSON values."""
    def spaced(value: Any) -> bytes:
        return json.dumps(value, indent=1, ensure_ascii=True).encode()

    assert _both(_record(answer=ANSWER, dumps=spaced))
    unnamed = {k: v for k, v in ANSWER.items() if k != "model"}
    assert _both(_LENGTHS.pack(len(orjson.dumps(META)), len(SENT)) + orjson.dumps(META) + SENT
                 + b' \n{"model":1.0e2,' + orjson.dumps(unnamed)[1:])


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -1, -40])
def test_a_cut_or_damaged_record_is_left_to_the_python_path(cut: int) -> None:
    value = _record()[:cut] if cut else b""
    assert openforge_native.exchange_event(value) is None
    assert not _both(value)  # both send the same dead letter


@pytest.mark.parametrize("answer", [b"[]", b"{\"choices\": [}", b"\xff\xfe", b"{\"id\": \"\\ud800\"}",
                                    b"{\"id\": 1e400}", b"null"])
def test_an_answer_python_cannot_read_is_left_to_it(answer: bytes) -> None:
    base = _record()
    head_length, request_length = _LENGTHS.unpack_from(base)
    value = base[:_LENGTHS.size + head_length + request_length] + answer
    assert openforge_native.exchange_event(value) is None
    assert not _both(value)


def test_lengths_that_point_past_the_record_are_refused() -> None:
    value = _record()
    assert openforge_native.exchange_event(_LENGTHS.pack(2**32 - 1, 2**32 - 1) + value[_LENGTHS.size:]) is None
    assert openforge_native.exchange_event(_LENGTHS.pack(4, 2**32 - 1) + value[_LENGTHS.size:]) is None


def test_spellings_python_reads_otherwise_are_left_to_it() -> None:
    """JSON whose meaning differs between the two parsers, or that Python reads with the last of two keys."""
    value = _record()
    minus_zero = value.replace(b'"logprob":-0.25', b'"logprob":-0', 1)  # the int 0 to Python: +0.0
    assert minus_zero != value and openforge_native.exchange_event(minus_zero) is None
    assert not _both(minus_zero)
    twice = value.replace(b'"top_k":20', b'"top_k":20,"top_k":21', 1)  # Python keeps 21, at 20's place
    assert twice != value and openforge_native.exchange_event(twice) is None
    assert not _both(twice)
    float_zero = value.replace(b'"logprob":-0.25', b'"logprob":-0.0', 1)  # -0.0 to both, but not told apart
    assert openforge_native.exchange_event(float_zero) is None and not _both(float_zero)


def test_a_request_with_many_fields_gives_the_same_record_both_ways() -> None:
    chat = {**CHAT_SENT, **{f"x_{i}": i for i in range(20_000)}}
    assert _both(_record(chat=chat))


def test_a_shipper_without_the_compiled_path_says_so(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import producers.shipper as shipper_module

    monkeypatch.setattr(shipper_module, "NATIVE", False)
    with caplog.at_level("WARNING", logger="producers.shipper"):
        shipper_module.Shipper(lambda: None, None, REGISTRY, ack_timeout_s=1.0)  # type: ignore[arg-type,return-value]
        shipper_module.Shipper(lambda: None, None, REGISTRY, ack_timeout_s=1.0,  # type: ignore[arg-type,return-value]
                               native=False)
    assert [r.message.count("not installed") for r in caplog.records] == [1]
