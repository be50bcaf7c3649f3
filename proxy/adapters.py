"""What differs between the three harness protocols, behind one small interface.

Every protocol reaches the engine as a chat completion; an adapter translates the
harness's request to that form and the engine's answer (whole or streamed) back.
The call pipeline in :mod:`proxy.service` is the same for all of them.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from producers.capture import REASONING_KEYS
from proxy.chat_fields import admit
from proxy.errors import InvalidRequestError
from proxy.media import ImagePolicy, check_chat_media
from schemas.call.v1 import ApiProtocol

#: Fields vLLM's answers carry, null unless a request asked for them (``prompt_logprobs``,
#: ``kv_transfer_params``): left out when null, as OpenAI's answers have no such fields.
_NULL_ENGINE_KEYS = ("prompt_logprobs", "kv_transfer_params")


class StreamSession(Protocol):
    """Translates one streamed answer, chunk by chunk."""

    @property
    def failure(self) -> str | None:
        """Why the session itself ended the stream with its error event, else None.

        A translator may refuse what the engine sent (a chunk it cannot translate, an answer
        that never ends): the harness then gets an error it retries, and the call must be
        recorded as failed, so that the retry is linked to it.
        """

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """Bytes to send the harness for this engine chunk (may be empty)."""

    def finish(self) -> bytes:
        """Closing bytes (terminal events); sent only after the call's event is durable."""

    def fail(self, message: str) -> bytes:
        """An in-stream error event, for an engine that fails mid-stream."""

    def hold(self) -> None:
        """What the last call made, and everything after it, is held back until the call is recorded."""

    def unrecorded(self, message: str) -> bytes:
        """The stream's error, sent instead of everything held back, when the call's record was lost.

        The harness must not keep an answer whose record is lost: it gets an error it retries.
        """

    def prompt_length(self, tokens: int) -> None:
        """The prompt's length in tokens, from the engine's first chunk (its usage comes last)."""

    def keepalive(self) -> bytes:
        """An event that only says the answer is still coming (may be empty: none needed or possible yet)."""

    @property
    def tool_closed(self) -> bool:
        """Whether what the session made so far closes a tool call (its whole arguments).

        Harnesses run the tool on that event (Anthropic's ``content_block_stop``, Responses'
        ``response.output_item.done``), so it and everything after it wait for the call's record,
        as the terminal events do.
        """

    @property
    def ended(self) -> bool:
        """Whether what the session made so far already ends the harness's answer (its terminal event).

        Translated streams end on the engine's usage chunk, before its ``[DONE]``: an engine
        stream that breaks after that has delivered a whole answer, and is recorded as one.
        """


class Adapter(Protocol):
    """One harness protocol."""

    protocol: ApiProtocol
    content_type: str

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completions request for the engine (raises InvalidRequestError)."""

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], asked: dict[str, Any], *,
                  context: int | None = None) -> dict[str, Any]:
        """The harness-facing answer for a whole chat completion.

        ``context`` is the engine's context length when known: an answer that filled it may be
        told apart from one that spent its budget.
        """

    def stream(self, body: dict[str, Any], asked: dict[str, Any], *, context: int | None = None) -> StreamSession:
        """A translator for a streamed answer (``context`` as for :meth:`from_chat`)."""

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        """The protocol's error body; ``param`` is the request field at fault, where the protocol has a place for it."""


def strip_capture(payload: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    """Remove what the proxy asked the engine for and the harness did not."""
    if not asked.get("return_token_ids"):
        payload.pop("prompt_token_ids", None)
    for key in _NULL_ENGINE_KEYS:
        if key in payload and payload[key] is None:
            del payload[key]
    hide_reasoning = asked.get("include_reasoning") is False
    for choice in payload.get("choices") or ():
        if not asked.get("return_token_ids"):
            choice.pop("token_ids", None)
        if not asked.get("return_weight_versions"):
            choice.pop("weight_versions", None)
        if not asked.get("logprobs"):
            choice.pop("logprobs", None)
        if hide_reasoning:  # the proxy asked the engine to include it (proxy/service.py)
            # As vLLM: an answer whose reasoning is hidden has none of its tokens shown, since
            # the reasoning's would spell out what was hidden.
            for key in ("logprobs", "token_ids"):
                if key in choice:
                    choice[key] = None
            for part in (choice.get("message"), choice.get("delta")):
                if isinstance(part, dict):
                    for key in REASONING_KEYS:
                        part.pop(key, None)
    return payload


class ChatAdapter:
    """OpenAI Chat Completions: passed through, with capture fields stripped."""

    protocol = ApiProtocol.OPENAI_CHAT
    content_type = "application/json"

    def __init__(self, images: ImagePolicy = "refuse") -> None:
        self.images: ImagePolicy = images

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The fields the engine may get (:mod:`proxy.chat_fields`), with the minimum it needs and its media checked.

        The values of the passed fields are the engine's to judge.
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("every entry of messages must be an object")
        sent = admit(body)
        sent["messages"] = check_chat_media(messages, self.images)
        # The fields the proxy itself reads (to record the call, to stream it) are checked here,
        # so a wrong type is a 400 and a recorded refusal, not a fault of the proxy; "false" as
        # stream would have been read as a stream the engine never sent.
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of objects")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise InvalidRequestError("stream must be a boolean")
        if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
            raise InvalidRequestError("stream_options must be an object")
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            # The engine refuses it too, but the proxy turns logprobs on for capture (and takes
            # them out of the answer again): the harness would get 200 and no logprobs.
            raise InvalidRequestError("when using top_logprobs, logprobs must be set to true")
        return sent

    def from_chat(self, chat: dict[str, Any], body: dict[str, Any], asked: dict[str, Any], *,
                  context: int | None = None) -> dict[str, Any]:
        """The engine's answer minus the capture fields, under the model name asked for."""
        if "model" in body:
            chat["model"] = body["model"]
        return strip_capture(chat, asked)

    def stream(self, body: dict[str, Any], asked: dict[str, Any], *, context: int | None = None) -> StreamSession:
        """Chunks pass through one by one."""
        return _ChatStream(body.get("model"), asked)

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        """OpenAI's error shape: the openai SDKs raise ``param`` as the error's ``.param``."""
        return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


class _ChatStream:
    failure = None  # chunks pass through as the engine sent them
    tool_closed = False  # a chat tool call has no event of its own that ends it: the finish chunk does

    def __init__(self, model: str | None, asked: dict[str, Any]) -> None:
        self.model = model
        self.asked = asked
        self.want_usage = bool((asked.get("stream_options") or {}).get("include_usage"))

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if not chunk.get("choices") and chunk.get("usage") and not self.want_usage:
            return b""  # the usage-only chunk the proxy asked for
        if not self.want_usage and "usage" in chunk:
            chunk.pop("usage")
        if self.model is not None:
            chunk["model"] = self.model
        return b"data: " + orjson.dumps(strip_capture(chunk, self.asked)) + b"\n\n"

    def finish(self) -> bytes:
        return b"data: [DONE]\n\n"

    def fail(self, message: str) -> bytes:
        return b"data: " + orjson.dumps({"error": {"message": message, "type": "api_error"}}) + b"\n\n"

    def hold(self) -> None:
        """Chunks stand alone: the error replaces them whatever they were."""

    def unrecorded(self, message: str) -> bytes:
        return self.fail(message)

    def prompt_length(self, tokens: int) -> None:
        """Chunks pass through as the engine sent them."""

    def keepalive(self) -> bytes:
        """Never needed: every engine chunk, reasoning included, goes to the harness."""
        return b""

    @property
    def ended(self) -> bool:
        """A chat stream ends with the ``[DONE]`` only :meth:`finish` sends."""
        return False
