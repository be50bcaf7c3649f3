"""Model calls, version 1: one event per call through the proxy, on ``openforge.calls.v1``.

A call is recorded whether it succeeded or not, because the assembler needs to know about failed
calls too (a retried call must not be merged twice, a failed one explains a broken trajectory).
The token-level data are the exact ids the engine saw and sampled, never a re-tokenization.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, JsonValue, field_validator, model_validator

from schemas._arrays import Logprobs, TokenIds
from schemas._base import EventBase, FrozenModel, UtcDatetime
from schemas._common import Identifier, JsonObject, WeightVersionRange, check_version_ranges
from schemas.drift import DriftReason

__all__ = [
    "ApiProtocol",
    "CallChoice",
    "CallStatus",
    "CallTimings",
    "CallUsage",
    "ModelCallV1",
    "NormalizedRequest",
    "PromptPrefix",
]

# Headers that carry credentials. Session headers are stored on Kafka in the clear, so the
# model refuses these even if a proxy bug forwards them.
_CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie"}
)


class ApiProtocol(StrEnum):
    """The API the harness spoke to the proxy."""

    OPENAI_CHAT = "openai_chat"
    """OpenAI Chat Completions (``/v1/chat/completions``)."""
    OPENAI_RESPONSES = "openai_responses"
    """OpenAI Responses (``/v1/responses``), translated to chat completions for the engine."""
    ANTHROPIC_MESSAGES = "anthropic_messages"
    """Anthropic Messages (``/v1/messages``), translated to chat completions for the engine."""


class CallStatus(StrEnum):
    """How the call ended, from the proxy's point of view."""

    OK = "ok"
    """The engine answered and the answer was delivered to the harness."""
    CLIENT_DISCONNECTED = "client_disconnected"
    """The harness went away before the answer was complete; choices hold what was sampled."""
    UPSTREAM_ERROR = "upstream_error"
    """The engine answered with an error status."""
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    """No engine replica could be reached (connection refused, DNS, TLS)."""
    UPSTREAM_TIMEOUT = "upstream_timeout"
    """The engine did not answer within the proxy's deadline."""
    INVALID_REQUEST = "invalid_request"
    """The proxy rejected the request or could not translate it for the engine."""
    INTERNAL_ERROR = "internal_error"
    """The proxy itself failed while handling the call."""


class NormalizedRequest(FrozenModel):
    """The request as sent to the engine, in Chat Completions form whatever the harness spoke.

    Anthropic Messages and OpenAI Responses requests are translated before they reach the engine;
    recording the translated form means every call can be replayed against the engine as is.
    """

    messages: list[JsonValue]
    """Chat messages, including tool calls and tool results, as sent to the engine."""

    tools: list[JsonValue] | None = None
    """Tool definitions offered to the model, in Chat Completions form; absent when none."""

    tool_choice: JsonValue = None
    """The ``tool_choice`` parameter as sent, if any."""

    sampling: JsonObject = Field(default_factory=dict)
    """Sampling parameters as sent: temperature, top_p, max_tokens, n, stop, seed, ...
    (the proxy's own additions such as ``logprobs`` and ``return_token_ids`` included)."""

    extra: JsonObject = Field(default_factory=dict)
    """Any other request fields passed to the engine (response_format, chat template kwargs)."""


class PromptPrefix(FrozenModel):
    """What a call shares with an earlier call of its rollout, stored by reference.

    A rollout's calls re-send their whole context, so storing every call in full makes the calls
    topic grow with the square of the turns. A call names an earlier call and what it repeats of
    it: the leading prompt ids of that call's *context* (its prompt ids followed by its first
    choice's sampled ids), the leading messages of its request, and its tools; the event then
    holds only the rest. The reference is usually the call before (the prompt extends its
    context), and a shorter token prefix where the samples forked (the template re-spelled a
    sampled turn, or the harness retried an earlier turn). Readers rebuild the whole call with
    :func:`schemas.call.linear.rebuild`, which refuses, never pads or cuts, a reference that does
    not resolve.
    """

    call_id: Identifier
    """The earlier call of the same rollout the prompt begins with."""

    tokens: int = Field(ge=1)
    """How many leading ids of that call's context the prompt begins with."""

    digest: str = Field(pattern=r"^[0-9a-f]{32}$")
    """BLAKE2b (16 bytes, hex) of those ids packed as little-endian int32, so a reader checks that
    the prefix it rebuilt is the one the proxy saw."""

    messages: int = Field(default=0, ge=0)
    """How many leading messages of ``request.messages`` are that call's, in its order; the
    event's ``request.messages`` holds the ones after them."""

    tools: bool = False
    """Whether the request offered that call's tools; ``request.tools`` is then absent."""


class CallChoice(FrozenModel):
    """One sampled completion of the call; a request with ``n > 1`` has several.

    Completion ids, logprobs and weight versions are per choice because each choice is sampled
    separately (and may straddle a weight update differently); the prompt is shared and lives on
    the call.
    """

    index: int = Field(ge=0)
    """Choice index as returned by the engine."""

    completion_token_ids: TokenIds
    """Token ids the engine sampled, in order, including any stop token it emitted."""

    logprobs: Logprobs
    """Behaviour logprob of each sampled token, aligned with ``completion_token_ids``."""

    weight_versions: list[WeightVersionRange] = Field(default_factory=list)
    """Weight version of each completion token as ranges that cover the completion without gaps;
    empty when the engine did not report a version."""

    finish_reason: str | None = None
    """Engine finish reason: ``stop``, ``length``, ``tool_calls``, ``abort``, ...; absent when the
    stream ended before the engine reported one. Kept as text so a new engine value is recorded
    rather than rejected."""

    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the completion, when the engine reports it."""

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        ids, logprobs = len(self.completion_token_ids), len(self.logprobs)
        if ids != logprobs:
            raise ValueError(
                f"choice {self.index}: logprobs has {logprobs} values but completion_token_ids "
                f"has {ids} tokens; they must be aligned one to one"
            )
        check_version_ranges(
            self.weight_versions,
            ids,
            what=f"choice {self.index} weight_versions",
            require_cover=True,
        )
        return self


class CallUsage(FrozenModel):
    """Token counts as reported by the engine."""

    prompt_tokens: int = Field(ge=0)
    """Tokens in the prompt."""

    completion_tokens: int = Field(ge=0)
    """Tokens generated, over all choices."""

    cached_prompt_tokens: int | None = Field(default=None, ge=0)
    """Prompt tokens served from the prefix cache, when reported."""


class CallTimings(FrozenModel):
    """When the call happened and how long it took, measured at the proxy."""

    started_at: UtcDatetime
    """When the proxy received the request."""

    time_to_first_token_s: float | None = Field(default=None, ge=0)
    """Seconds from receipt to the first generated token; absent when none arrived."""

    total_s: float = Field(ge=0)
    """Seconds from receipt to the end of the response (or the failure)."""


class ModelCallV1(EventBase):
    """One model call made by a harness during a rollout, successful or not.

    Keyed by ``rollout_id`` so all calls of a rollout reach the same assembler in produce order.
    """

    SCHEMA: ClassVar[str] = "model_call"
    VERSION: ClassVar[int] = 1

    rollout_id: Identifier
    """Rollout that made the call (from the path prefix, headers or key the harness used)."""

    task_id: Identifier | None = None
    """Task of the rollout, when the proxy knows it; saves replay tools a join."""

    call_id: Identifier
    """Unique id of this call."""

    attempt: int = Field(default=0, ge=0)
    """Retry number: 0 for a first try, then 1, 2, ... for retries of the same request."""

    retry_of: Identifier | None = None
    """``call_id`` of the attempt this call retries; set exactly when ``attempt > 0``. The
    assembler uses it to keep only the last attempt of a retried request."""

    protocol: ApiProtocol
    """API the harness used. ``request`` and ``response`` are in chat-completion form whatever it
    is, as the engine received and answered them."""

    model: str = Field(min_length=1)
    """Model name the harness asked for."""

    request: NormalizedRequest
    """The request in the form the engine received it."""

    response: JsonValue = None
    """The engine's answer in chat-completion form, without the token arrays (those are fields of
    their own): id, model, each choice's message (role, content, the reasoning text when the
    engine's parser separated it, tool calls) and finish reason, and usage; for a streamed call,
    assembled from the chunks. It is the engine's answer, not what the harness was sent: a
    translated protocol's body, or an answer with fields the harness did not ask for removed, is
    made from it. Absent when the engine gave no answer."""

    prompt_prefix: PromptPrefix | None = None
    """What the call repeats of an earlier call of the rollout (leading prompt ids, messages,
    tools), by reference; absent when the event holds the whole call."""

    prompt_token_ids: TokenIds = Field(default_factory=TokenIds)
    """Token ids of the prompt exactly as the engine tokenized it (chat template applied), after
    ``prompt_prefix`` when there is one. Empty when the call failed before the engine saw it."""

    choices: list[CallChoice] = Field(default_factory=list)
    """Sampled completions, one per choice (``n > 1`` gives several). Empty when the engine
    produced nothing."""

    usage: CallUsage | None = None
    """Token counts reported by the engine, when it reported them."""

    timings: CallTimings
    """When the call started and how long it took."""

    status: CallStatus
    """How the call ended."""

    upstream_status_code: int | None = Field(default=None, ge=100, le=599)
    """HTTP status the engine answered with; absent when it was never reached."""

    error_message: str | None = None
    """What went wrong, for any status other than ``ok``."""

    upstream_replica: str | None = None
    """Engine replica (URL or id) that served the call; with the weight versions it tells which
    weights produced the tokens."""

    streamed: bool = False
    """Whether the harness asked for a streamed response."""

    session_headers: dict[str, str] = Field(default_factory=dict)
    """Headers that identify the harness session (lowercased names). Never credentials: the
    proxy strips them, and the model rejects ``authorization``, ``x-api-key`` and the like."""

    drift_reason: DriftReason | None = None
    """Why the call's prompt is the template's full render although the proxy held earlier turns
    of its rollout (continuation mode): the harness rewrote its history, the tools changed, the
    proxy lost the rollout's state. None when the prompt extends an earlier turn's exact ids, on a
    rollout's first call, and in chat mode."""

    @field_validator("session_headers")
    @classmethod
    def _no_credentials(cls, headers: dict[str, str]) -> dict[str, str]:
        lowered = {name.lower(): value for name, value in headers.items()}
        if len(lowered) != len(headers):
            raise ValueError("session_headers has names that differ only by case")
        leaked = sorted(_CREDENTIAL_HEADERS.intersection(lowered))
        if leaked:
            raise ValueError(f"session_headers must not carry credentials; found {', '.join(leaked)}")
        return lowered

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.attempt == 0) != (self.retry_of is None):
            raise ValueError(
                f"retry_of must be set exactly when attempt > 0 "
                f"(attempt={self.attempt}, retry_of={self.retry_of!r})"
            )
        if self.prompt_prefix is not None and self.prompt_prefix.call_id == self.call_id:
            raise ValueError(f"call {self.call_id!r} cannot take its prompt prefix from itself")
        if self.prompt_prefix is not None and self.prompt_prefix.tools and self.request.tools is not None:
            raise ValueError("request.tools must be absent when prompt_prefix.tools takes the referenced call's")
        if self.retry_of is not None and self.retry_of == self.call_id:
            raise ValueError(f"call {self.call_id!r} cannot be a retry of itself")
        indexes = [choice.index for choice in self.choices]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"choice indexes must be unique, got {indexes}")
        if self.status is CallStatus.OK:
            if not self.choices:
                raise ValueError("a call with status 'ok' must have at least one choice")
            if self.error_message is not None:
                raise ValueError("a call with status 'ok' must not have an error_message")
        return self

    def partition_key(self) -> str:
        """Return ``rollout_id``."""
        return self.rollout_id

    def packed_items(self) -> int:
        """Prompt ids plus every choice's ids and logprobs."""
        return len(self.prompt_token_ids) + sum(2 * len(c.completion_token_ids) for c in self.choices)

    @property
    def prompt_length(self) -> int:
        """Ids in the whole prompt: the referenced prefix and the ids stored here."""
        return len(self.prompt_token_ids) + (self.prompt_prefix.tokens if self.prompt_prefix is not None else 0)

    @property
    def first_choice(self) -> CallChoice | None:
        """The choice with the lowest index (the only one unless ``n > 1``), if any."""
        return min(self.choices, key=lambda choice: choice.index, default=None)
