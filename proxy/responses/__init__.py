"""OpenAI Responses API support: translation to and from the engine's chat completions.

The engine returns token ids and logprobs only on its chat-completions endpoint, so a
harness that speaks only the Responses API (Codex CLI, for one) is served by translating
each request to chat completions and each answer, streamed or not, back.
"""

from __future__ import annotations

from proxy.responses.translate import (
    CUSTOM_TOOL_ARGUMENT,
    StreamTranslator,
    UpstreamFormatError,
    error_body,
    from_chat_response,
    sse_encode,
    to_chat_request,
)

__all__ = [
    "CUSTOM_TOOL_ARGUMENT",
    "StreamTranslator",
    "UpstreamFormatError",
    "error_body",
    "from_chat_response",
    "sse_encode",
    "to_chat_request",
]
