"""OpenAI Responses as a proxy adapter (translation lives in :mod:`proxy.responses.translate`)."""

from __future__ import annotations

from typing import Any

from proxy.adapters import StreamSession
from proxy.errors import ProxyError, context_overflow
from proxy.media import ImagePolicy
from proxy.responses.translate import (
    StreamTranslator,
    UpstreamFormatError,
    error_body,
    from_chat_response,
    sse_encode,
    to_chat_request,
)
from schemas.call.v1 import ApiProtocol


class EngineAnswerError(ProxyError):
    """The engine's answer could not be expressed as a response (502)."""

    status_code = 502
    error_type = "api_error"


class ResponsesAdapter:
    """``POST /v1/responses``."""

    protocol = ApiProtocol.OPENAI_RESPONSES
    content_type = "application/json"

    def __init__(self, images: ImagePolicy = "refuse") -> None:
        self.images: ImagePolicy = images

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Responses request → chat request."""
        return to_chat_request(body, images=self.images)

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], asked: dict[str, Any], *,
                  context: int | None = None) -> dict[str, Any]:
        """Chat completion → response object (Responses has no reason for a full context)."""
        try:
            return from_chat_response(chat, request=body)
        except UpstreamFormatError as exc:
            raise EngineAnswerError(str(exc)) from exc

    def stream(self, body: dict[str, Any], asked: dict[str, Any], *, context: int | None = None) -> StreamSession:
        """Chat chunks → Responses stream events."""
        return _ResponsesStream(StreamTranslator(request=body))

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        """OpenAI's error shape; a prompt over the engine's context gets OpenAI's code for it.

        Codex compacts the conversation when an error's code is ``context_length_exceeded``; the
        openai SDKs raise ``param`` (the field at fault) as the error's ``.param``.
        """
        body = error_body(status, message, error_type)
        body["error"]["param"] = param
        if status == 400 and context_overflow(message) is not None:
            body["error"]["code"] = "context_length_exceeded"
        return body


class _ResponsesStream:
    def __init__(self, translator: StreamTranslator) -> None:
        self.translator = translator
        self._call_mark = 0  # the sequence number the last call's first event took
        self._held_from: int | None = None

    @property
    def failure(self) -> str | None:
        return self.translator.failure

    def feed(self, chunk: dict[str, Any]) -> bytes:
        self._call_mark = self.translator.next_sequence
        return b"".join(sse_encode(name, data) for name, data in self.translator.feed(chunk))

    def finish(self) -> bytes:
        self._call_mark = self.translator.next_sequence
        return b"".join(sse_encode(name, data) for name, data in self.translator.finish())

    def fail(self, message: str) -> bytes:
        self._call_mark = self.translator.next_sequence
        return b"".join(sse_encode(name, data) for name, data in self.translator.failed_event(message))

    def hold(self) -> None:
        if self._held_from is None:
            self._held_from = self._call_mark

    def unrecorded(self, message: str) -> bytes:
        """``response.failed`` numbered on from the last event sent; the held ones are never sent.

        The held events may already end the stream (``response.completed``, or a failure of
        its own): a stream carries one terminal event, and its sequence numbers have no gap.
        """
        held_from = self.translator.next_sequence if self._held_from is None else self._held_from
        events = self.translator.failed_instead(message, held_from)
        return b"".join(sse_encode(name, data) for name, data in events)

    def prompt_length(self, tokens: int) -> None:
        """Responses streams report usage only in their terminal event, as OpenAI's do."""

    def keepalive(self) -> bytes:
        self._call_mark = self.translator.next_sequence
        return b"".join(sse_encode(name, data) for name, data in self.translator.keepalive())

    @property
    def tool_closed(self) -> bool:
        return self.translator.tool_closed

    @property
    def ended(self) -> bool:
        return self.translator.terminated
