"""Anthropic Messages API on top of the engine's OpenAI chat completions.

Harnesses such as Claude Code speak only the Messages API, while the engine returns token ids and
logprobs only on chat completions; :mod:`proxy.anthropic.translate` converts requests, answers and
streams between the two.
"""

from __future__ import annotations

from proxy.anthropic.translate import (
    StreamTranslator,
    error_body,
    error_event,
    from_chat_response,
    sse_encode,
    to_chat_request,
)

__all__ = [
    "StreamTranslator",
    "error_body",
    "error_event",
    "from_chat_response",
    "sse_encode",
    "to_chat_request",
]
