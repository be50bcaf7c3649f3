"""A call's capture, journalled as it is; its event is built by whoever ships the journal.

Why: building a ``ModelCallV1`` (packing the token arrays, the checks that stand in for
validation) and encoding it cost the proxy about half of capture's CPU, on the event loop that
also serves every call. The journal only needs the call's fields to be durable before the answer
completes, not the event. So the proxy journals one of two records, under reserved topic names,
and the shipper, which can run in a process of its own, turns each into the event on its way to
Kafka:

* :data:`RAW_EXCHANGES`, for a whole answer that ended ``ok``: a little metadata, then the request
  body sent to the engine and the engine's answer, bytes the proxy holds anyway;
* :data:`RAW_CALLS`, for everything else (streams, failures): :meth:`CallCapture.fields` as one
  ``orjson`` dump.

The record carries the event's id, creation time and trace context, fixed when the call
finished: a record shipped twice (after a failed batch, or a restart before the ``shipped`` mark
moved) gives the same event twice, which the assembler drops by id, and its span links to the
call's trace whichever process ships it.

A record that does not make a valid event (an engine that reported something the schema
refuses) must neither block the journal nor be lost: it becomes a dead letter carrying the record
byte for byte and the validation error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from array import array
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel

from producers.capture import (
    CallCapture,
    _clip_versions,
    _logprob_values,
    event_from_fields,
    event_json,
    linked,
    normalize_request,
    reasoning_text,
)
from producers.journal import Record
from schemas import DeadLetterV1, ModelCallV1
from schemas._base import new_event_id
from schemas._errors import DeadLetterErrorType
from schemas.call.v1 import ApiProtocol, CallStatus, NormalizedRequest
from schemas.drift import DriftReason
from stream import CALLS, DEAD_LETTERS, TopicRegistry
from stream.producer import encode_record, encoded_record
from stream.tracing import inject_trace_context

RAW_CALLS = "openforge/raw-calls"
"""The topic name raw call records are journalled under. The ``/`` makes it an illegal Kafka
topic name, so it can never be mistaken for a real topic, and a shipper that did not know it
would fail loudly rather than send it."""

RAW_EXCHANGES = "openforge/raw-exchanges"
"""The topic name whole answers are journalled under: the call's metadata, then the request body
sent to the engine and the engine's answer, byte for byte (:func:`pack_raw_exchange`)."""

_LENGTHS = struct.Struct("<II")  # metadata length, request body length

#: Consumer group named in the dead letters of records that could not be made events.
SHIPPER_GROUP = "openforge-proxy-shipper"

#: Largest raw record copied whole into a dead letter (base64 grows it by a third; the topic takes 48 MiB).
_MAX_LETTER_VALUE = 32 * 1024 * 1024


def _json_default(value: object) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def pack_raw_call(capture: CallCapture, status: CallStatus, *, upstream_status_code: int | None = None,
                  error_message: str | None = None, upstream_replica: str | None = None) -> Record:
    """The journal record of a finished call: its fields, id, time and trace context as JSON.

    Runs on the proxy's event loop for every call, so it does no more than one ``orjson`` dump.
    """
    data = capture.fields(status, upstream_status_code=upstream_status_code, error_message=error_message,
                          upstream_replica=upstream_replica, prompt_ids_unparsed=True)
    request = data["request"]
    # A constructed request's __dict__ holds its fields as plain JSON values.
    data["request"] = dict(request.__dict__) if isinstance(request, NormalizedRequest) else request
    for choice in data["choices"]:
        # JSON has no -inf or NaN; keep every logprob's 64 bits, as the event does.
        choice["logprobs"] = base64.b64encode(array("d", choice["logprobs"]).tobytes()).decode()
    trace: list[tuple[str, bytes]] = []
    inject_trace_context(trace)
    data["_event_id"] = new_event_id()
    data["_created_at"] = datetime.now(UTC)
    data["_trace"] = [(name, value.decode()) for name, value in trace]
    value = orjson.dumps(data, default=_json_default)
    return RAW_CALLS, capture.rollout_id.encode(), value, ()


@dataclass(frozen=True)
class EngineExchange:
    """A whole answer's engine exchange as it went over the wire, for :func:`pack_raw_exchange`."""

    request: bytes
    """The chat-completions body sent to the engine."""
    answer: bytes
    """The engine's answer body."""
    asked: dict[str, Any]
    """The capture fields the harness itself set (see :func:`normalize_request`)."""


def pack_raw_exchange(capture: CallCapture, exchange: EngineExchange, *, upstream_status_code: int | None,
                      upstream_replica: str | None) -> Record:
    """:func:`raw_exchange_parts` as one record, its value's parts joined."""
    topic, key, parts = raw_exchange_parts(capture, exchange, upstream_status_code=upstream_status_code,
                                           upstream_replica=upstream_replica)
    return topic, key, b"".join(parts), ()


def raw_exchange_parts(capture: CallCapture, exchange: EngineExchange, *, upstream_status_code: int | None,
                       upstream_replica: str | None) -> tuple[str, bytes, tuple[bytes, bytes, bytes]]:
    """The journal record of a whole answer: a little metadata, and the engine exchange as sent and received.

    The cheapest record of a call the proxy can write: the request body and the answer are bytes
    it holds anyway, so only the metadata is dumped; the shipper parses both again and takes the
    call's token ids, logprobs and summary from them exactly as :meth:`CallCapture.on_response`
    did here. Only for calls that ended ``ok`` with a whole answer.

    Args:
        capture: The call, after :meth:`CallCapture.on_response`.
        exchange: What was sent and received.
        upstream_status_code: The engine's HTTP status.
        upstream_replica: The replica that served the call.

    Returns:
        The record's topic, key, and value in parts (the headers are none): the lengths and
        metadata, the request, the answer.
    """
    trace: list[tuple[str, bytes]] = []
    inject_trace_context(trace)
    head = orjson.dumps({
        "rollout_id": capture.rollout_id, "task_id": capture.task_id, "call_id": capture.call_id,
        "attempt": capture.attempt, "retry_of": capture.retry_of, "protocol": capture.protocol,
        "model": capture.model, "streamed": capture.streamed, "session_headers": capture.headers,
        "started_at": capture.started_at, "first_token_s": capture.first_token_s, "total_s": capture.elapsed(),
        "weight_version": capture.weight_version, "drift_reason": capture.drift_reason, "asked": exchange.asked,
        "prompt_prefix": capture.prompt_prefix,
        "upstream_status_code": upstream_status_code, "upstream_replica": upstream_replica,
        "_event_id": new_event_id(), "_created_at": datetime.now(UTC),
        "_trace": [(name, value.decode()) for name, value in trace],
    })
    # The value in the parts it is written from (Journal.append_parts): the request and the
    # answer as they are, not copied into one more buffer.
    return RAW_EXCHANGES, capture.rollout_id.encode(), (
        _LENGTHS.pack(len(head), len(exchange.request)) + head, exchange.request, exchange.answer)


def dead_letter(registry: TopicRegistry, record: Record, seq: int, error_type: DeadLetterErrorType, reason: str,
                exc: BaseException) -> Record:
    """The dead letter that stands for journal record ``seq`` (``record`` as it was, or as it was sent).

    The same record always makes a letter with the same id, so a batch sent again repeats the
    id and consumers drop the copy. ``seq``, the journal's sequence number, stands in for the
    offset the record never had.
    """
    topic, key, value, headers = record
    truncated = len(value) > _MAX_LETTER_VALUE
    letter = DeadLetterV1(
        event_id=hashlib.sha256(value).hexdigest()[:32],
        topic=topic, partition=0, offset=seq, key=key, value=value[:_MAX_LETTER_VALUE],
        value_truncated=truncated, headers=[(name, data) for name, data in headers],
        error_type=error_type, reason=reason[:4000],
        exception_type=f"{type(exc).__module__}.{type(exc).__qualname__}", consumer_group=SHIPPER_GROUP)
    letters = registry[DEAD_LETTERS]
    record_key, encoded, event_headers = encode_record(letters, letter)
    return letters.name, record_key, encoded, tuple(event_headers)


_Fields = tuple[dict[str, Any], str, datetime, list[tuple[str, bytes]]]
"""A record's event fields (as :meth:`CallCapture.fields` gives them), event id, creation time and trace."""


def _exchange_fields(value: bytes) -> _Fields:
    try:
        head_length, request_length = _LENGTHS.unpack_from(value)
        start = _LENGTHS.size + head_length
        view = memoryview(value)
        meta = orjson.loads(view[_LENGTHS.size:start])
        chat = orjson.loads(view[start:start + request_length])
        answer = orjson.loads(view[start + request_length:])
        data = _one_choice_fields(meta, chat, answer)
        if data is None:
            data = _answer_fields(meta, chat, answer)
        data = linked(data)
        event_id, created_at = meta["_event_id"], datetime.fromisoformat(meta["_created_at"])
        trace = [(str(name), str(text).encode()) for name, text in meta["_trace"]]
    except (struct.error, orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a raw exchange record: {exc!r}") from exc
    if type(event_id) is not str or created_at.tzinfo is None:
        raise ValueError("a raw exchange record needs a string event id and an aware creation time")
    return data, event_id, created_at.astimezone(UTC), trace


def _answer_fields(meta: dict[str, Any], chat: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The event's fields of a whole answer, as :meth:`CallCapture.fields` made them in the proxy."""
    capture = CallCapture(
        rollout_id=meta["rollout_id"], call_id=meta["call_id"], protocol=ApiProtocol(meta["protocol"]),
        model=meta["model"], request=normalize_request(chat, meta["asked"]), streamed=meta["streamed"],
        task_id=meta["task_id"], attempt=meta["attempt"], retry_of=meta["retry_of"],
        headers=meta["session_headers"])
    capture.on_response(answer)
    capture.weight_version = meta["weight_version"]
    capture.prompt_prefix = meta.get("prompt_prefix")
    capture.drift_reason = _drift(meta)
    data = capture.fields(CallStatus.OK, upstream_status_code=meta["upstream_status_code"],
                          upstream_replica=meta["upstream_replica"])
    data["timings"] = _timings(meta)
    return data


def _timings(meta: dict[str, Any]) -> dict[str, Any]:
    return {"started_at": datetime.fromisoformat(meta["started_at"]),
            "time_to_first_token_s": meta["first_token_s"], "total_s": meta["total_s"]}


def _one_choice_fields(meta: dict[str, Any], chat: Any, answer: Any) -> dict[str, Any] | None:
    """:func:`_answer_fields` for the usual answer, one choice of plain shape, without a ``CallCapture``.

    Most of what the shipper spends on a whole answer beyond parsing it went to feeding the
    capture object and reading its fields back; this maps the answer straight to the fields.
    Anything less usual (several choices, a value of an unexpected type) gives None, and
    :func:`_answer_fields` decides, so both always agree (the unit tests compare them).
    """
    if type(answer) is not dict or type(chat) is not dict:
        return None
    choices = answer.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(raw := choices[0]) is not dict:
        return None
    index = raw.get("index", 0)
    ids = raw.get("token_ids") or []
    versions = raw.get("weight_versions") or []
    message = raw.get("message") or {}
    prompt = answer.get("prompt_token_ids") or []
    usage = answer.get("usage") or None
    if (type(index) is not int or index < 0 or type(ids) is not list or type(versions) is not list
            or type(message) is not dict or type(prompt) is not list or not (usage is None or type(usage) is dict)):
        return None
    content = message.get("content") or None
    tool_calls = message.get("tool_calls") or None
    if not ((content is None or type(content) is str) and (tool_calls is None or type(tool_calls) is list)):
        return None
    logprobs = _logprob_values(raw.get("logprobs"))
    n = min(len(ids), len(logprobs)) if logprobs else len(ids)
    version = meta["weight_version"]
    finish_reason = raw.get("finish_reason")
    summary: dict[str, Any] = {"role": message.get("role") or "assistant", "content": content}
    if thought := reasoning_text(message):
        summary["reasoning"] = thought
    if tool_calls:
        summary["tool_calls"] = list(tool_calls)
    return {
        "rollout_id": meta["rollout_id"], "task_id": meta["task_id"], "call_id": meta["call_id"],
        "attempt": meta["attempt"], "retry_of": meta["retry_of"], "protocol": ApiProtocol(meta["protocol"]),
        "model": meta["model"], "request": normalize_request(chat, meta["asked"]),
        "response": {"id": answer.get("id"), "model": answer.get("model"),
                     "choices": [{"index": index, "message": summary, "finish_reason": finish_reason}],
                     "usage": usage},
        "prompt_prefix": meta.get("prompt_prefix"),
        "prompt_token_ids": prompt,
        "choices": [{
            "index": index, "completion_token_ids": ids[:n], "logprobs": logprobs[:n],
            "weight_versions": _clip_versions(versions, n) if versions else (
                [{"version": version, "start": 0, "end": n}] if version and n else []),
            "finish_reason": finish_reason, "stop_reason": raw.get("stop_reason"),
        }],
        "usage": None if usage is None else {
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "cached_prompt_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")},
        "timings": _timings(meta),
        "status": CallStatus.OK, "upstream_status_code": meta["upstream_status_code"], "error_message": None,
        "upstream_replica": meta["upstream_replica"], "streamed": meta["streamed"],
        "session_headers": meta["session_headers"] or {},
        "drift_reason": _drift(meta),
    }


def _drift(meta: dict[str, Any]) -> DriftReason | None:
    reason = meta.get("drift_reason")
    return None if reason is None else DriftReason(reason)


def _call_fields(value: bytes) -> _Fields:
    try:
        data = orjson.loads(value)
        event_id = data.pop("_event_id")
        created_at = datetime.fromisoformat(data.pop("_created_at"))
        trace = [(str(name), str(text).encode()) for name, text in data.pop("_trace")]
        data["protocol"] = ApiProtocol(data["protocol"])
        data["status"] = CallStatus(data["status"])
        data["drift_reason"] = _drift(data)
        for choice in data["choices"]:
            packed = array("d")
            packed.frombytes(base64.b64decode(choice["logprobs"], validate=True))
            choice["logprobs"] = packed.tolist()
        timings = data["timings"]
        timings["started_at"] = datetime.fromisoformat(timings["started_at"])
        request = data["request"]
        if type(request) is dict and set(request) == set(NormalizedRequest.model_fields):
            data["request"] = NormalizedRequest.model_construct(**request)
        data = linked(data)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise ValueError(f"not a raw call record: {exc!r}") from exc
    if type(event_id) is not str or created_at.tzinfo is None:
        raise ValueError("a raw call record needs a string event id and an aware creation time")
    return data, event_id, created_at.astimezone(UTC), trace


def unpack_raw_exchange(value: bytes) -> tuple[ModelCallV1, list[tuple[str, bytes]]]:
    """The event a raw exchange record describes, and the trace headers it carried.

    Raises:
        ValueError: the record is not of the expected shape, or does not make a valid event.
    """
    data, event_id, created_at, trace = _exchange_fields(value)
    return event_from_fields(data, event_id=event_id, created_at=created_at), trace


def unpack_raw_call(value: bytes) -> tuple[ModelCallV1, list[tuple[str, bytes]]]:
    """The event a raw call record describes, and the trace headers it carried.

    Raises:
        ValueError: the record is not JSON of the expected shape, or its fields do not make a
            valid event (``pydantic.ValidationError`` is a ``ValueError``).
    """
    data, event_id, created_at, trace = _call_fields(value)
    return event_from_fields(data, event_id=event_id, created_at=created_at), trace


def ship_record(registry: TopicRegistry, topic: str, key: bytes | None, value: bytes,
                headers: tuple[tuple[str, bytes], ...], seq: int) -> Record:
    """What to send to Kafka for one journal record: itself, or for a raw call its event.

    The event's JSON is written straight from the record's fields when the checks of
    :func:`producers.capture.event_json` vouch for them, which is most of the work of building and
    validating the event saved; otherwise the event is built and validated. A raw call that
    cannot be made an event is sent as a dead letter instead (``seq``, the journal's sequence
    number, stands in for the offset it never had), so the journal moves on and the call stays
    inspectable.
    """
    if topic not in (RAW_CALLS, RAW_EXCHANGES):
        return topic, key, value, headers
    try:
        calls = registry[CALLS]
        data, event_id, created_at, trace = (_call_fields if topic == RAW_CALLS else _exchange_fields)(value)
        vouched = event_json(data, event_id=event_id, created_at=created_at)
        record_key: bytes | None
        if vouched is not None:
            record_key, encoded, event_headers = encoded_record(calls, ModelCallV1, data["rollout_id"].encode(),
                                                                vouched)
        else:
            event = event_from_fields(data, event_id=event_id, created_at=created_at)
            record_key, encoded, event_headers = encode_record(calls, event)
    except Exception as exc:  # noqa: BLE001 - whatever the record holds, the journal must move on
        return dead_letter(registry, (topic, key, value, ()), seq, DeadLetterErrorType.INVALID_EVENT,
                           f"call capture made no valid event: {exc}", exc)
    # The event's own trace context replaces any the shipper's encoding added.
    names = {name for name, _ in trace}
    kept = [(name, raw) for name, raw in event_headers if name not in names]
    return calls.name, record_key, encoded, tuple(kept + trace)


__all__ = ["RAW_CALLS", "RAW_EXCHANGES", "EngineExchange", "Record", "dead_letter", "pack_raw_call",
           "pack_raw_exchange", "raw_exchange_parts", "ship_record", "unpack_raw_call", "unpack_raw_exchange"]
