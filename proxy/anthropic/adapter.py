"""Anthropic Messages as a proxy adapter (translation lives in :mod:`proxy.anthropic.translate`)."""

from __future__ import annotations

from typing import Any

from proxy.adapters import StreamSession
from proxy.anthropic.translate import (
    StreamTranslator,
    error_body,
    error_event,
    from_chat_response,
    sse_encode,
    thinking_display,
    to_chat_request,
)
from proxy.errors import context_overflow
from proxy.media import ImagePolicy
from schemas.call.v1 import ApiProtocol


class AnthropicAdapter:
    """``POST /v1/messages`` (also ``?beta=true``)."""

    protocol = ApiProtocol.ANTHROPIC_MESSAGES
    content_type = "application/json"

    def __init__(self, images: ImagePolicy = "refuse") -> None:
        self.images: ImagePolicy = images

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Messages request → chat request."""
        return to_chat_request(body, images=self.images)

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], asked: dict[str, Any], *,
                  context: int | None = None) -> dict[str, Any]:
        """Chat completion → Message, under the model name the harness asked for."""
        return from_chat_response(chat, model=str(body.get("model") or chat.get("model") or ""),
                                  max_tokens=body.get("max_tokens"), context=context,
                                  thinking=thinking_display(body))

    def stream(self, body: dict[str, Any], asked: dict[str, Any], *, context: int | None = None) -> StreamSession:
        """Chat chunks → Messages stream events."""
        return _AnthropicStream(StreamTranslator(model=str(body.get("model") or ""), max_tokens=body.get("max_tokens"),
                                                 context=context, thinking=thinking_display(body)))

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        """Anthropic's error shape; a prompt over the engine's context in Anthropic's words.

        Anthropic's errors have no field for ``param``: the message names it.

        Claude Code compacts the conversation on "prompt is too long: N tokens > M maximum" and
        reads the two numbers to decide how much to cut.
        """
        overflow = context_overflow(message) if status == 400 else None
        if overflow is not None:
            tokens, limit = overflow
            message = (f"prompt is too long: {tokens} tokens > {limit} maximum" if tokens is not None
                       else f"prompt is too long: more than the {limit} tokens the model's context holds")
        return error_body(status, message, error_type)


class _AnthropicStream:
    failure = None  # an answer without an end closes with a null stop reason (see finish)

    def __init__(self, translator: StreamTranslator) -> None:
        self.translator = translator

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(sse_encode(name, data) for name, data in self.translator.feed(chunk))

    def finish(self) -> bytes:
        return b"".join(sse_encode(name, data) for name, data in self.translator.finish())

    def fail(self, message: str) -> bytes:
        return sse_encode(*error_event(message))

    def hold(self) -> None:
        """An ``error`` event ends a Messages stream wherever it comes: nothing to remember."""

    def unrecorded(self, message: str) -> bytes:
        return self.fail(message)

    def prompt_length(self, tokens: int) -> None:
        self.translator.prompt_tokens = tokens

    def keepalive(self) -> bytes:
        return b"".join(sse_encode(name, data) for name, data in self.translator.keepalive())

    @property
    def tool_closed(self) -> bool:
        return self.translator.tool_closed

    @property
    def ended(self) -> bool:
        return self.translator.done
