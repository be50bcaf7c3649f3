"""Errors the proxy turns into HTTP answers the harness understands."""

from __future__ import annotations

import re

# vLLM's words when a prompt does not fit the context: "This model's maximum context length is
# 1024 tokens. However, your prompt contains [at least] 1500 input tokens, ..." (or "... 6000
# characters (more than ...", a check made before tokenizing). Before 0.10 it said "... However, you
# requested 1500 tokens (1400 in the messages, 100 in the completion)": there the prompt may fit
# and only the room left for the answer not, which is no reason to compact the conversation.
_CONTEXT_OVERFLOW = re.compile(r"maximum context length is (\d+) tokens\. However, (?:your prompt contains "
                               r"(at least )?(\d+) input tokens|you requested \d+ tokens \((\d+) in the messages)?")


class ProxyError(Exception):
    """Base of errors with an HTTP status; the message is shown to the client."""

    status_code: int = 500
    error_type: str = "api_error"
    headers: dict[str, str] = {}  # read only; subclasses replace it

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CallLogUnavailableError(ProxyError):
    """The call's record could not be written (a full or failing disk): 503, retry later.

    The harness is told to send the call again rather than be answered without a record.
    """

    status_code = 503
    error_type = "overloaded_error"
    headers = {"retry-after": "5"}


class InvalidRequestError(ProxyError):
    """The request is malformed: bad JSON, wrong types, missing fields (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedFeatureError(InvalidRequestError):
    """The request uses something that cannot be translated for the engine (400).

    ``field`` is the JSON path of the offending part (``messages[2].content[0].type``),
    so a harness author sees at once what to turn off.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"unsupported field {field}: {detail}")
        self.field = field
        self.detail = detail


def context_overflow(message: str) -> tuple[int | None, int] | None:
    """``(prompt tokens or None, context length)`` when an engine's error says the prompt does not fit.

    Harnesses recover from a full context by compacting the conversation, and they recognise
    that case by their own API's words: the translated protocols rephrase the engine's message
    (see the adapters' ``error``). The prompt's size is None when the engine did not count it
    in tokens, or only as a lower bound ("at least", where it stopped counting): a harness cuts
    the conversation by the difference, so a too-small figure would have it cut too little.
    """
    found = _CONTEXT_OVERFLOW.search(message)
    if found is None:
        return None
    limit = int(found.group(1))
    if found.group(4) is not None:  # the older wording: only a prompt over the limit is one
        prompt = int(found.group(4))
        return (prompt, limit) if prompt > limit else None
    tokens = None if found.group(2) else found.group(3)
    return (int(tokens) if tokens else None), limit
