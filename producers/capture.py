"""Call capture: turn one engine exchange into one token-exact ``ModelCallV1``.

The proxy feeds this object what vLLM sends back (a whole chat completion, or the
streamed chunks as they pass through) and, at the end, how the call ended. Token
ids and logprobs are taken exactly as the engine reported them; nothing is ever
re-tokenized. The same object serves every harness protocol, because every
protocol reaches the engine as a chat completion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from schemas import ModelCallV1
from schemas.call.v1 import (
    ApiProtocol,
    CallChoice,
    CallStatus,
    CallTimings,
    CallUsage,
    NormalizedRequest,
)

#: Sampling parameters kept apart in the normalized request (the rest goes to ``extra``).
SAMPLING_KEYS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "seed",
    "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
})
#: Request fields the proxy adds for capture; they are not part of what the harness asked.
CAPTURE_KEYS = frozenset({"logprobs", "top_logprobs", "return_token_ids", "return_weight_versions",
                          "stream_options"})
_STRUCTURE_KEYS = frozenset({"messages", "tools", "tool_choice", "model", "stream"})

#: Headers never recorded: credentials, and transport details that say nothing about the session.
_UNRECORDED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
    "host", "content-length", "content-type", "accept", "accept-encoding", "connection",
    "transfer-encoding", "keep-alive", "te", "upgrade",
})


def session_headers(headers: Any) -> dict[str, str]:
    """The harness's headers worth keeping (session ids, user agent, SDK retry counts)."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        lowered = name.lower()
        if lowered not in _UNRECORDED_HEADERS and lowered not in out:
            out[lowered] = value
    return out


def normalize_request(chat: dict[str, Any], asked: dict[str, Any]) -> NormalizedRequest:
    """The chat-form request as the harness meant it (without what the proxy added).

    Args:
        chat: The chat-completions body sent upstream.
        asked: The capture fields the harness itself set (they stay in ``extra``).
    """
    sampling = {k: v for k, v in chat.items() if k in SAMPLING_KEYS}
    extra = {k: v for k, v in chat.items()
             if k not in SAMPLING_KEYS and k not in _STRUCTURE_KEYS and k not in CAPTURE_KEYS}
    extra.update(asked)
    return NormalizedRequest(
        messages=chat.get("messages") or [],
        tools=chat.get("tools"),
        tool_choice=chat.get("tool_choice"),
        sampling=sampling,
        extra=extra,
    )


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    role: str = "assistant"

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": "".join(self.text) or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


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
        self.first_token_s: float | None = None
        self.prompt_token_ids: list[int] = []
        self._choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.weight_version: str | None = None
        """Version the engine served throughout the call, when the proxy could tell."""

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
            for i, call in enumerate(message.get("tool_calls") or []):
                choice.tool_calls[i] = call

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
        if body.get("prompt_token_ids") and not self.prompt_token_ids:
            self.prompt_token_ids = list(body["prompt_token_ids"])
        if body.get("usage"):
            self.usage = body["usage"]
        self.response_id = self.response_id or body.get("id")
        self.response_model = self.response_model or body.get("model")

    def elapsed(self) -> float:
        """Seconds since the call began."""
        return time.perf_counter() - self._t0

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

    def build(
        self,
        status: CallStatus,
        *,
        upstream_status_code: int | None = None,
        error_message: str | None = None,
        upstream_replica: str | None = None,
    ) -> ModelCallV1:
        """The event for this call, whatever its outcome."""
        choices = []
        for c in sorted(self._choices.values(), key=lambda c: c.index):
            # Logprobs arrive per sampled token; a cut stream may leave them one short.
            n = min(len(c.token_ids), len(c.logprobs)) if c.logprobs else len(c.token_ids)
            choices.append(CallChoice(
                index=c.index,
                completion_token_ids=c.token_ids[:n],
                logprobs=c.logprobs[:n] if c.logprobs else [],
                weight_versions=_clip_versions(c.weight_versions, n) if c.weight_versions else (
                    [{"version": self.weight_version, "start": 0, "end": n}] if self.weight_version and n else []),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ))
        if status is CallStatus.OK and not choices:
            status, error_message = CallStatus.UPSTREAM_ERROR, error_message or "engine returned no choices"
        usage = None
        if self.usage:
            usage = CallUsage(
                prompt_tokens=int(self.usage.get("prompt_tokens") or 0),
                completion_tokens=int(self.usage.get("completion_tokens") or 0),
                cached_prompt_tokens=(self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            )
        return ModelCallV1(
            rollout_id=self.rollout_id,
            task_id=self.task_id,
            call_id=self.call_id,
            attempt=self.attempt,
            retry_of=self.retry_of,
            protocol=self.protocol,
            model=self.model,
            request=self.request,
            response=self.response_summary() if self._choices else None,
            prompt_token_ids=self.prompt_token_ids,
            choices=choices,
            usage=usage,
            timings=CallTimings(started_at=self.started_at, time_to_first_token_s=self.first_token_s,
                                total_s=self.elapsed()),
            status=status,
            upstream_status_code=upstream_status_code,
            error_message=error_message if status is not CallStatus.OK else None,
            upstream_replica=upstream_replica,
            streamed=self.streamed,
            session_headers=self.headers,
        )


def _clip_versions(ranges: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Version ranges limited to the ``n`` tokens kept (a cut stream has fewer)."""
    out = []
    for r in ranges:
        start, end = int(r["start"]), min(int(r["end"]), n)
        if start < end:
            out.append({"version": str(r["version"]), "start": start, "end": end})
    return out
