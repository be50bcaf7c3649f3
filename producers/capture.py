"""Call capture: turn one engine exchange into one token-exact ``ModelCallV1``.

The proxy feeds this object what vLLM sends back (a whole chat completion, or the
streamed chunks as they pass through) and, at the end, how the call ended. Token
ids and logprobs are taken exactly as the engine reported them; nothing is ever
re-tokenized. The same object serves every harness protocol, because every
protocol reaches the engine as a chat completion.
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel

from schemas import Logprobs, ModelCallV1, TokenIds
from schemas._base import new_event_id
from schemas._common import WeightVersionRange
from schemas.call.linear import prefix_digest
from schemas.call.v1 import (
    _CREDENTIAL_HEADERS,
    ApiProtocol,
    CallChoice,
    CallStatus,
    CallTimings,
    CallUsage,
    NormalizedRequest,
    PromptPrefix,
)
from schemas.drift import DriftReason

#: Sampling parameters kept apart in the normalized request (the rest goes to ``extra``).
SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "seed",
    "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
})
#: Request fields the proxy adds or overrides for capture; the harness's own values go to ``extra``.
CAPTURE_KEYS = frozenset({"logprobs", "top_logprobs", "return_token_ids", "return_weight_versions",
                          "stream_options", "include_reasoning"})
_STRUCTURE_KEYS = frozenset({"messages", "tools", "tool_choice", "model", "stream"})

#: Headers never recorded: credentials, and transport details that say nothing about the session.
_UNRECORDED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
    "host", "content-length", "content-type", "accept", "accept-encoding", "connection",
    "transfer-encoding", "keep-alive", "te", "upgrade",
})


#: Words that mark a header as a credential whatever its exact name (``x-goog-api-key``,
#: ``x-auth-token``, ``ocp-apim-subscription-key``, ``cf-access-client-secret``, ...): session
#: headers go to Kafka in the clear, so a name the list above misses must not leak a secret.
_CREDENTIAL_WORDS = re.compile("auth|key|token|secret|cookie|passw|credential|signature")


@functools.lru_cache(maxsize=1024)
def _recorded_name(name: str) -> str | None:
    """The name a header is recorded under, or None when it is not recorded.

    Remembered per name: a harness sends the same dozen or two headers on every call, and
    checking each against the words above cost several microseconds per call on the proxy's
    event loop.
    """
    lowered = name.strip().lower()
    if lowered in _UNRECORDED_HEADERS or _CREDENTIAL_WORDS.search(lowered) is not None:
        return None
    return lowered


def session_headers(headers: Any) -> dict[str, str]:
    """The harness's headers worth keeping (session ids, user agent, SDK retry counts)."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        lowered = _recorded_name(name)
        if lowered is not None and lowered not in out:
            out[lowered] = value
    return out


_PROMPT_IDS_KEY = b'"prompt_token_ids":['
_DIGITS_AND_COMMAS = b"0123456789,"


def cut_prompt_ids(body: bytes) -> tuple[bytes, bytes | None]:
    """The engine's JSON with its prompt token ids set to null, and the ids' JSON array (None: left in).

    vLLM sends the whole prompt's ids with every answer (the first chunk of a stream). The
    proxy only carries them into the call's event, so it need not turn them into Python ints on
    its event loop, which for a 40k-token prompt cost 1.1 ms of a 1.14 ms parse. The key cannot
    start inside a JSON string (a string escapes its quotes, so no ``s"`` in one is followed by
    ``:``). Only an array as vLLM writes it is cut, non-negative integers and single commas, no
    spaces (so that it is valid JSON as it stands); anything else is left for the parser.
    """
    start = body.find(_PROMPT_IDS_KEY)
    if start < 0:
        return body, None
    opening = start + len(_PROMPT_IDS_KEY) - 1
    end = body.find(b"]", opening)
    inner = body[opening + 1:end]
    if (end < 0 or inner.translate(None, _DIGITS_AND_COMMAS) or inner.startswith(b",") or inner.endswith(b",")
            or b",," in inner or _leading_zero(inner)):
        return body, None
    return body[:start] + b'"prompt_token_ids":null' + body[end + 1:], body[opening:end + 1]


def _leading_zero(numbers: bytes) -> bool:
    """Whether a number in ``numbers`` (digits and commas) starts with a 0 another digit follows (not JSON)."""
    if numbers[:1] == b"0" and numbers[1:2].isdigit():
        return True
    at = numbers.find(b",0")
    while at >= 0:  # only the id 0 itself starts with 0: few matches
        if numbers[at + 2:at + 3].isdigit():
            return True
        at = numbers.find(b",0", at + 2)
    return False


def normalize_request(chat: dict[str, Any], asked: dict[str, Any]) -> NormalizedRequest:
    """The chat-form request as the engine got it, without the fields the proxy adds for capture.

    Sampling the proxy forces (``OPENFORGE_PROXY_SAMPLING``) is in ``chat`` already: the event
    records what the engine sampled with.

    Args:
        chat: The chat-completions body sent upstream.
        asked: The capture fields the harness itself set (they stay in ``extra``).
    """
    sampling = {k: v for k, v in chat.items() if k in SAMPLING_KEYS}
    extra = {k: v for k, v in chat.items()
             if k not in SAMPLING_KEYS and k not in _STRUCTURE_KEYS and k not in CAPTURE_KEYS}
    extra.update(asked)
    messages = chat.get("messages") or []
    tools = chat.get("tools")
    fields = {"messages": messages, "tools": tools, "tool_choice": chat.get("tool_choice"),
              "sampling": sampling, "extra": extra}
    if type(messages) is list and (tools is None or type(tools) is list):
        # The body came from a JSON parser (and, for the translated protocols, from the
        # adapters, which build plain JSON values), so validating it as JSON again only costs
        # time, which grows with the conversation. ``build`` validates it if the event's other
        # checks fail.
        return _construct(NormalizedRequest, fields)
    return NormalizedRequest.model_validate(fields)


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    role: str = "assistant"

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": "".join(self.text) or None}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


#: Where vLLM puts an answer's reasoning (a message's, a stream delta's): ``reasoning``, and
#: ``reasoning_content`` in older releases and other engines.
REASONING_KEYS = ("reasoning", "reasoning_content")


def reasoning_text(fields: dict[str, Any]) -> str:
    """The reasoning text of an engine message or delta; empty when it has none.

    vLLM's reasoning parsers put what the model thought before answering in ``reasoning``
    (``reasoning_content`` in older releases and other engines). Its tokens are in the
    completion ids either way; the summary keeps its text so that a reader of the event sees
    what those ids say.
    """
    newer, older = REASONING_KEYS
    text = fields.get(newer)
    if type(text) is not str or not text:
        text = fields.get(older)
    return text if type(text) is str else ""


def _logprob_values(logprobs: Any) -> list[float]:
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content") or []
    return [float(item["logprob"]) for item in content if isinstance(item, dict) and "logprob" in item]


class CallCapture:
    """Accumulates one call; :meth:`build` makes its event."""

    def __init__(
        self,
        *,
        rollout_id: str,
        call_id: str,
        protocol: ApiProtocol,
        model: str,
        request: NormalizedRequest,
        streamed: bool,
        task_id: str | None = None,
        attempt: int = 0,
        retry_of: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.rollout_id = rollout_id
        self.call_id = call_id
        self.protocol = protocol
        self.model = model
        self.request = request
        self.streamed = streamed
        self.task_id = task_id
        self.attempt = attempt
        self.retry_of = retry_of
        self.headers = headers or {}
        self.started_at = datetime.now(UTC)
        self._t0 = time.perf_counter()
        self.recording = False
        """Set when the proxy begins to record the call: one call, one event, whatever interrupts it."""
        self.first_token_s: float | None = None
        self._prompt_ids: list[int] = []
        self.prompt_ids_json: bytes | None = None
        """The prompt's ids as the engine's JSON array, when the proxy cut them out of the answer
        unparsed (:func:`cut_prompt_ids`); :attr:`prompt_token_ids` parses them when asked."""
        self._choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.weight_version: str | None = None
        """Version the engine served throughout the call, when the proxy could tell."""
        self.prompt_prefix: dict[str, Any] | None = None
        """What the call repeats of an earlier call of the rollout: ``call_id``, ``tokens``,
        ``messages`` and ``tools`` of :class:`~schemas.call.v1.PromptPrefix`, without the digest;
        set by the proxy when it records."""
        self.drift_reason: DriftReason | None = None
        """Why a continuation call's prompt is a full render although its rollout had earlier turns."""

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as the engine reported them."""
        if not self._prompt_ids and self.prompt_ids_json is not None:
            self._prompt_ids = orjson.loads(self.prompt_ids_json)
            self.prompt_ids_json = None
        return self._prompt_ids

    @prompt_token_ids.setter
    def prompt_token_ids(self, ids: list[int]) -> None:
        self._prompt_ids, self.prompt_ids_json = ids, None

    @property
    def prompt_token_count(self) -> int:
        """How many prompt ids the engine reported, without parsing ids still held as JSON."""
        if self.prompt_ids_json is not None and not self._prompt_ids:
            inner = self.prompt_ids_json[1:-1]
            return inner.count(b",") + 1 if inner else 0
        return len(self._prompt_ids)

    def first_sampled(self) -> list[int]:
        """The sampled ids the event records for its first choice: what a later prompt may extend."""
        if not self._choices:
            return []
        c = self._choices[min(self._choices)]
        return c.token_ids[:min(len(c.token_ids), len(c.logprobs))] if c.logprobs else c.token_ids

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index)
        return choice

    def on_response(self, body: dict[str, Any]) -> None:
        """Take a whole (non-streamed) chat completion from the engine."""
        self.first_token_s = self.first_token_s or self.elapsed()
        self._header_fields(body)
        for raw in body.get("choices") or []:
            choice = self._choice(int(raw.get("index", 0)))
            choice.token_ids = list(raw.get("token_ids") or [])
            choice.logprobs = _logprob_values(raw.get("logprobs"))
            choice.weight_versions = list(raw.get("weight_versions") or [])
            choice.finish_reason = raw.get("finish_reason")
            choice.stop_reason = raw.get("stop_reason")
            message = raw.get("message") or {}
            choice.role = message.get("role") or "assistant"
            if message.get("content"):
                choice.text = [message["content"]]
            if thought := reasoning_text(message):
                choice.reasoning = [thought]
            for i, call in enumerate(message.get("tool_calls") or []):
                choice.tool_calls[i] = call

    def first_answer(self) -> tuple[list[int], dict[str, Any]] | None:
        """The first choice's sampled ids and its message in chat form, when the engine sampled any."""
        if not self._choices:
            return None
        choice = self._choices[min(self._choices)]
        return (choice.token_ids, choice.message()) if choice.token_ids else None

    def discard_answer(self) -> None:
        """Forget what was taken from an answer that could not be read whole: none of it is kept."""
        self._choices.clear()
        self.usage = self.response_id = self.response_model = None
        self.first_token_s = None
        if self.prompt_ids_json is None:  # ids cut from the bytes came from a readable answer
            self._prompt_ids = []

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        """Take one streamed chat-completion chunk, as it passes through."""
        self._header_fields(chunk)
        for raw in chunk.get("choices") or []:
            choice = self._choice(int(raw.get("index", 0)))
            ids = raw.get("token_ids")
            if ids:
                if self.first_token_s is None:
                    self.first_token_s = self.elapsed()
                choice.token_ids.extend(ids)
            choice.logprobs.extend(_logprob_values(raw.get("logprobs")))
            if raw.get("weight_versions"):
                choice.weight_versions = list(raw["weight_versions"])
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
            if raw.get("stop_reason") is not None:
                choice.stop_reason = raw["stop_reason"]
            delta = raw.get("delta") or {}
            if delta.get("role"):
                choice.role = delta["role"]
            if delta.get("content"):
                if self.first_token_s is None:
                    self.first_token_s = self.elapsed()
                choice.text.append(delta["content"])
            if thought := reasoning_text(delta):
                choice.reasoning.append(thought)
            for call in delta.get("tool_calls") or []:
                slot = choice.tool_calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                function = call.get("function") or {}
                if function.get("name"):
                    slot["function"]["name"] += function["name"]
                if function.get("arguments"):
                    slot["function"]["arguments"] += function["arguments"]

    def _header_fields(self, body: dict[str, Any]) -> None:
        if body.get("prompt_token_ids") and not self._prompt_ids and self.prompt_ids_json is None:
            self._prompt_ids = list(body["prompt_token_ids"])
        if body.get("usage"):
            self.usage = body["usage"]
        self.response_id = self.response_id or body.get("id")
        self.response_model = self.response_model or body.get("model")

    def elapsed(self) -> float:
        """Seconds since the call began."""
        return time.perf_counter() - self._t0

    def outcome(self, status: CallStatus) -> CallStatus:
        """The status the call's event records for ``status`` (an ``ok`` without choices is an engine error)."""
        return CallStatus.UPSTREAM_ERROR if status is CallStatus.OK and not self._choices else status

    @property
    def completion_tokens(self) -> int:
        """Tokens sampled so far, over all choices."""
        return sum(len(c.token_ids) for c in self._choices.values())

    def response_summary(self) -> dict[str, Any]:
        """The answer in chat form, without the token arrays (those are fields of their own)."""
        return {
            "id": self.response_id,
            "model": self.response_model,
            "choices": [
                {"index": c.index, "message": c.message(), "finish_reason": c.finish_reason}
                for c in sorted(self._choices.values(), key=lambda c: c.index)
            ],
            "usage": self.usage,
        }

    def fields(
        self,
        status: CallStatus,
        *,
        upstream_status_code: int | None = None,
        error_message: str | None = None,
        upstream_replica: str | None = None,
        prompt_ids_unparsed: bool = False,
    ) -> dict[str, Any]:
        """The event's fields (all but ``event_id`` and ``created_at``), as plain values.

        The request stays the :class:`NormalizedRequest` it is; everything else is a JSON value,
        an enum or the start time. :meth:`build` makes the event of them here;
        :mod:`producers.raw_calls` journals them and has the event built by the shipper.

        Args:
            status: How the call ended.
            upstream_status_code: The engine's HTTP status, if it answered.
            error_message: What went wrong, for a status other than ``ok``.
            upstream_replica: The replica that served the call.
            prompt_ids_unparsed: Give prompt ids still held as the engine's JSON as an
                ``orjson.Fragment`` of it, for a writer of JSON, rather than parse them.
        """
        choices: list[dict[str, Any]] = []
        for c in sorted(self._choices.values(), key=lambda c: c.index):
            # Logprobs arrive per sampled token; a cut stream may leave them one short.
            n = min(len(c.token_ids), len(c.logprobs)) if c.logprobs else len(c.token_ids)
            choices.append({
                "index": c.index,
                "completion_token_ids": c.token_ids[:n],
                "logprobs": c.logprobs[:n] if c.logprobs else [],
                "weight_versions": _clip_versions(c.weight_versions, n) if c.weight_versions else (
                    [{"version": self.weight_version, "start": 0, "end": n}] if self.weight_version and n else []),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
        if self.outcome(status) is not status:
            status, error_message = self.outcome(status), error_message or "engine returned no choices"
        usage = None
        if self.usage:
            usage = {
                "prompt_tokens": int(self.usage.get("prompt_tokens") or 0),
                "completion_tokens": int(self.usage.get("completion_tokens") or 0),
                "cached_prompt_tokens": (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            }
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "call_id": self.call_id,
            "attempt": self.attempt,
            "retry_of": self.retry_of,
            "protocol": self.protocol,
            "model": self.model,
            "request": self.request,
            "response": self.response_summary() if self._choices else None,
            "prompt_prefix": self.prompt_prefix,
            "prompt_token_ids": (orjson.Fragment(self.prompt_ids_json)
                                 if prompt_ids_unparsed and self.prompt_ids_json is not None
                                 else self.prompt_token_ids),
            "choices": choices,
            "usage": usage,
            "timings": {"started_at": self.started_at, "time_to_first_token_s": self.first_token_s,
                        "total_s": self.elapsed()},
            "status": status,
            "upstream_status_code": upstream_status_code,
            "error_message": error_message if status is not CallStatus.OK else None,
            "upstream_replica": upstream_replica,
            "streamed": self.streamed,
            "session_headers": self.headers,
            "drift_reason": self.drift_reason,
        }

    def build(
        self,
        status: CallStatus,
        *,
        upstream_status_code: int | None = None,
        error_message: str | None = None,
        upstream_replica: str | None = None,
        validate: bool = False,
    ) -> ModelCallV1:
        """The event for this call, whatever its outcome.

        Everything in the event was either produced by this object or taken from the engine's
        answer, so full pydantic validation mostly re-checks our own work; on the proxy's hot
        path it cost about as much CPU as publishing the event. The event is therefore
        constructed without validation when explicit checks (:func:`_trusted_event`) show that
        validation could not fail; anything those checks do not vouch for, for example an engine
        that reports a negative choice index, goes through full validation and fails there as
        before, with pydantic's error. Both paths give the same JSON (the unit tests compare
        them).

        Args:
            status: How the call ended.
            upstream_status_code: The engine's HTTP status, if it answered.
            error_message: What went wrong, for a status other than ``ok``.
            upstream_replica: The replica that served the call.
            validate: Always validate fully (tests, and callers that want the slow path).

        Raises:
            pydantic.ValidationError: The call's data do not make a valid event.
        """
        data = self.fields(status, upstream_status_code=upstream_status_code, error_message=error_message,
                           upstream_replica=upstream_replica)
        return event_from_fields(linked(data), validate=validate)


def linked(data: dict[str, Any]) -> dict[str, Any]:
    """The fields stored linearly: only what follows the referenced prefix, and the prefix's digest.

    The proxy names what the call repeats (:attr:`CallCapture.prompt_prefix`) but does not cut or
    digest on its event loop; whoever makes the event does it here, once. A reference that does
    not fit the call (which the proxy never makes) is dropped and the call kept whole.
    """
    prefix = data.get("prompt_prefix")  # a record journalled before prefixes has none
    if prefix is None or "digest" in prefix:
        return data
    ids, request = data["prompt_token_ids"], data["request"]
    tokens, messages, tools = prefix.get("tokens"), prefix.get("messages", 0), prefix.get("tools", False)
    fields = request.__dict__ if isinstance(request, NormalizedRequest) else request
    if (type(ids) is not list or type(tokens) is not int or not 0 < tokens <= len(ids) or type(fields) is not dict
            or type(fields.get("messages")) is not list or type(messages) is not int
            or not 0 <= messages <= len(fields["messages"]) or type(tools) is not bool):
        return {**data, "prompt_prefix": None}
    rest = {**fields, "messages": fields["messages"][messages:], "tools": None if tools else fields.get("tools")}
    return {**data,
            "prompt_prefix": {"call_id": prefix["call_id"], "tokens": tokens,
                              "digest": prefix_digest(TokenIds(ids[:tokens]).to_bytes()),
                              "messages": messages, "tools": tools},
            "request": _construct(NormalizedRequest, rest) if isinstance(request, NormalizedRequest) else rest,
            "prompt_token_ids": ids[tokens:]}


def event_from_fields(data: dict[str, Any], *, event_id: str | None = None, created_at: datetime | None = None,
                      validate: bool = False) -> ModelCallV1:
    """``ModelCallV1`` of :meth:`CallCapture.fields`: constructed when the checks vouch for it, else validated.

    Raises:
        pydantic.ValidationError: The fields do not make a valid event.
    """
    if not validate:
        event = _trusted_event(data, event_id, created_at)
        if event is not None:
            return event
    if isinstance(data["request"], NormalizedRequest):
        # A constructed request would be taken as is; validate its content too.
        data = {**data, "request": data["request"].model_dump()}
    if event_id is not None:
        data = {**data, "event_id": event_id}
    if created_at is not None:
        data = {**data, "created_at": created_at}
    return ModelCallV1.model_validate(data)


# -- construction without validation --------------------------------------------------------------
#
# Each check below mirrors one constraint of schemas.call.v1 (field types, bounds, validators).
# When a check fails the caller validates fully, so a check that is too strict costs only time;
# one that is too lax would let an invalid event through, which the unit tests guard against by
# decoding every fast-built event with full validation.

_MAX_ID = 256
_MAX_VERSION = 128
_MAX_EVENT_ID = 128
#: The fields :meth:`CallCapture.fields` gives, in the event's order (all but the id and time).
_CALL_FIELDS = tuple(name for name in ModelCallV1.model_fields if name not in ("event_id", "created_at"))
_CHOICE_FIELDS = tuple(CallChoice.model_fields)

_M = TypeVar("_M", bound=BaseModel)
_FIELDS: dict[type[BaseModel], tuple[str, ...]] = {}


def _construct(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance holding ``values`` as they are, every field given, nothing validated.

    What ``BaseModel.model_construct`` ends with, without its per-field Python loop (which
    also inspects each default factory's signature on every call, and cost more than
    validating). Values must name every field, in the model's order; a mismatch is a bug here,
    not bad input, hence the assertion-style error.
    """
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(cls.model_fields)
    if tuple(values) != names:
        raise RuntimeError(f"{cls.__name__} needs fields {names}, got {tuple(values)}")
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(names))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


def _is_id(value: object, optional: bool = False) -> bool:
    if value is None:
        return optional
    return type(value) is str and 0 < len(value) <= _MAX_ID


def _is_event_id(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= _MAX_EVENT_ID


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_seconds(value: object) -> bool:
    return type(value) is float and 0.0 <= value < math.inf


@dataclass(frozen=True)
class _Vouched:
    """What the checks of :func:`_vouch` made of an event's fields on the way."""

    prompt: TokenIds
    choices: list[tuple[dict[str, Any], TokenIds, Logprobs, list[dict[str, Any]]]]
    """Each choice's fields, its packed arrays, and its weight version ranges."""


def _vouch_choice(raw: dict[str, Any]) -> tuple[dict[str, Any], TokenIds, Logprobs, list[dict[str, Any]]] | None:
    if type(raw) is not dict or tuple(raw) != _CHOICE_FIELDS or not _is_count(raw["index"]):
        return None
    if not (raw["finish_reason"] is None or type(raw["finish_reason"]) is str):
        return None
    if not (raw["stop_reason"] is None or type(raw["stop_reason"]) in (str, int)):
        return None
    ranges = raw["weight_versions"]
    if not (type(raw["completion_token_ids"]) is list and type(raw["logprobs"]) is list and type(ranges) is list):
        return None  # validation takes fewer kinds of sequence than packing does
    ids = TokenIds(raw["completion_token_ids"])  # packing checks every value
    logprobs = Logprobs(raw["logprobs"])
    if len(ids) != len(logprobs):
        return None
    position = 0
    for r in ranges:
        if type(r) is not dict or len(r) != 3:
            return None
        version, start, end = r["version"], r["start"], r["end"]
        if not (type(version) is str and 0 < len(version) <= _MAX_VERSION
                and type(start) is int and type(end) is int and start == position and end > start):
            return None
        position = end
    if ranges and position != len(ids):
        return None
    return raw, ids, logprobs, ranges


_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_PREFIX_FIELDS = tuple(PromptPrefix.model_fields)


def _vouch_prefix(prefix: object, call_id: str) -> bool:
    if prefix is None:
        return True
    return (type(prefix) is dict and tuple(prefix) == _PREFIX_FIELDS
            and _is_id(prefix["call_id"]) and prefix["call_id"] != call_id
            and type(prefix["tokens"]) is int and prefix["tokens"] >= 1
            and type(prefix["digest"]) is str and _DIGEST.match(prefix["digest"]) is not None
            and _is_count(prefix["messages"]) and type(prefix["tools"]) is bool)


def _vouch(data: dict[str, Any]) -> _Vouched | None:
    """The fields' packed arrays when validation of the event could not fail, else None.

    The values inside the request and the response are taken to be what a JSON parser gives
    (they come from the harness's body and the engine's answer, or from the adapters, which
    build plain JSON values); their shape is checked, not each value.
    """
    try:
        if tuple(data) != _CALL_FIELDS:
            return None  # a field missing or unknown (a record of another version)
        if not (_is_id(data["rollout_id"]) and _is_id(data["call_id"]) and _is_id(data["task_id"], True)
                and _is_id(data["retry_of"], True) and _is_count(data["attempt"])):
            return None
        if (data["attempt"] == 0) != (data["retry_of"] is None) or data["retry_of"] == data["call_id"]:
            return None
        if not (type(data["model"]) is str and data["model"]):
            return None
        if type(data["protocol"]) is not ApiProtocol or type(data["status"]) is not CallStatus:
            return None
        request = data["request"]
        if not (isinstance(request, NormalizedRequest) and type(request.messages) is list
                and (request.tools is None or type(request.tools) is list)
                and type(request.sampling) is dict and type(request.extra) is dict):
            return None
        code = data["upstream_status_code"]
        if not (code is None or (type(code) is int and 100 <= code <= 599)):
            return None
        for name in ("error_message", "upstream_replica"):
            if not (data[name] is None or type(data[name]) is str):
                return None
        if type(data["streamed"]) is not bool:
            return None
        headers = data["session_headers"]
        if type(headers) is not dict or not all(
                type(k) is str and type(v) is str and k == k.lower() for k, v in headers.items()):
            return None
        if not _CREDENTIAL_HEADERS.isdisjoint(headers):
            return None
        if type(data["choices"]) is not list or type(data["prompt_token_ids"]) is not list:
            return None
        if not _vouch_prefix(data["prompt_prefix"], data["call_id"]):
            return None
        if data["prompt_prefix"] is not None and data["prompt_prefix"]["tools"] and request.tools is not None:
            return None
        choices = [_vouch_choice(raw) for raw in data["choices"]]
        if any(c is None for c in choices):
            return None
        if len({raw["index"] for raw in data["choices"]}) != len(choices):
            return None
        if data["status"] is CallStatus.OK and (not choices or data["error_message"] is not None):
            return None
        usage = data["usage"]
        if usage is not None:
            cached = usage["cached_prompt_tokens"]
            if not (len(usage) == 3 and _is_count(usage["prompt_tokens"]) and _is_count(usage["completion_tokens"])
                    and (cached is None or _is_count(cached))):
                return None
        timings = data["timings"]
        started = timings["started_at"]
        ttft = timings["time_to_first_token_s"]
        if not (len(timings) == 3 and type(started) is datetime and started.tzinfo is UTC
                and _is_seconds(timings["total_s"]) and (ttft is None or _is_seconds(ttft))):
            return None
        prompt = TokenIds(data["prompt_token_ids"])
    except (ValueError, TypeError, KeyError, OverflowError):
        return None  # full validation will say what is wrong
    return _Vouched(prompt, [c for c in choices if c is not None])


def _trusted_event(data: dict[str, Any], event_id: str | None = None,
                   created_at: datetime | None = None) -> ModelCallV1 | None:
    """``ModelCallV1`` built without validation, or None when validation could fail."""
    if not (event_id is None or _is_event_id(event_id)):
        return None
    vouched = _vouch(data)
    if vouched is None:
        return None
    choices = [
        _construct(CallChoice, {
            "index": raw["index"], "completion_token_ids": ids, "logprobs": logprobs,
            "weight_versions": [_construct(WeightVersionRange, {"version": r["version"], "start": r["start"],
                                                                "end": r["end"]}) for r in ranges],
            "finish_reason": raw["finish_reason"], "stop_reason": raw["stop_reason"]})
        for raw, ids, logprobs, ranges in vouched.choices]
    usage = data["usage"]
    timings = data["timings"]
    prefix = data["prompt_prefix"]
    return _construct(ModelCallV1, {
        "event_id": event_id or new_event_id(), "created_at": created_at or datetime.now(UTC),
        **data, "prompt_token_ids": vouched.prompt, "choices": choices,
        "prompt_prefix": None if prefix is None else _construct(PromptPrefix, dict(prefix)),
        "usage": None if usage is None else _construct(CallUsage, {
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_prompt_tokens": usage["cached_prompt_tokens"]}),
        "timings": _construct(CallTimings, {"started_at": timings["started_at"],
                                            "time_to_first_token_s": timings["time_to_first_token_s"],
                                            "total_s": timings["total_s"]}),
        "session_headers": dict(data["session_headers"])})


_JSON_OPTIONS = orjson.OPT_UTC_Z


def event_json(data: dict[str, Any], *, event_id: str, created_at: datetime) -> bytes | None:
    """The JSON of the ``ModelCallV1`` of :meth:`CallCapture.fields`, without building the event.

    The shipper turns every journalled call into its event's JSON; building the pydantic event
    and serialising it cost more than half of that. When :func:`_vouch` shows that validation
    could not fail, this writes the same JSON straight from the fields with ``orjson`` (the unit
    tests compare it byte for byte with pydantic's); otherwise it returns None and the caller
    takes the validating path, which names what is wrong.

    Args:
        data: The fields, with ``request`` a :class:`NormalizedRequest`.
        event_id: The event's id.
        created_at: The event's creation time, in UTC.
    """
    if created_at.tzinfo is not UTC or not _is_event_id(event_id):
        return None
    vouched = _vouch(data)
    if vouched is None:
        return None
    request = data["request"]
    usage = data["usage"]
    timings = data["timings"]
    try:
        return orjson.dumps({
            "event_id": event_id, "created_at": created_at,
            "rollout_id": data["rollout_id"], "task_id": data["task_id"], "call_id": data["call_id"],
            "attempt": data["attempt"], "retry_of": data["retry_of"], "protocol": data["protocol"].value,
            "model": data["model"],
            "request": {"messages": request.messages, "tools": request.tools, "tool_choice": request.tool_choice,
                        "sampling": request.sampling, "extra": request.extra},
            "response": data["response"],
            "prompt_prefix": data["prompt_prefix"],
            "prompt_token_ids": vouched.prompt.to_base64(),
            "choices": [{
                "index": raw["index"], "completion_token_ids": ids.to_base64(), "logprobs": logprobs.to_base64(),
                "weight_versions": [{"version": r["version"], "start": r["start"], "end": r["end"]} for r in ranges],
                "finish_reason": raw["finish_reason"], "stop_reason": raw["stop_reason"],
            } for raw, ids, logprobs, ranges in vouched.choices],
            "usage": None if usage is None else {
                "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                "cached_prompt_tokens": usage["cached_prompt_tokens"]},
            "timings": {"started_at": timings["started_at"], "time_to_first_token_s": timings["time_to_first_token_s"],
                        "total_s": timings["total_s"]},
            "status": data["status"].value, "upstream_status_code": data["upstream_status_code"],
            "error_message": data["error_message"], "upstream_replica": data["upstream_replica"],
            "streamed": data["streamed"], "session_headers": data["session_headers"],
            "drift_reason": data.get("drift_reason"),
        }, option=_JSON_OPTIONS)
    except (orjson.JSONEncodeError, TypeError):
        return None  # a value JSON cannot hold as it is (the validating path may still coerce it)


def _clip_versions(ranges: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Version ranges limited to the ``n`` tokens kept (a cut stream has fewer)."""
    out = []
    for r in ranges:
        start, end = int(r["start"]), min(int(r["end"]), n)
        if start < end:
            out.append({"version": str(r["version"]), "start": start, "end": end})
    return out
