"""Reading the engine's streamed chat completion: what the protocol translators share.

The Anthropic Messages and OpenAI Responses translators (:mod:`proxy.anthropic.translate`,
:mod:`proxy.responses.translate`) turn the same vLLM chunks into different events. What a chunk
says is the same for both and is read here, once: its usage, its first choice's reasoning, text,
tool-call fragments and finish reason (in that order), and the usage-only chunk that ends the
stream; each tool call as its fragments add up; the whitespace a model writes between two tool
calls; and the frame of a keep-alive.
Each translator says what those parts become (the hooks of :class:`ChunkTranslator`) and how
strict it is with a chunk of the wrong shape (:meth:`ChunkTranslator._malformed`): an Anthropic
stream passes over what it cannot read, a Responses stream fails.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.reasoning import engine_reasoning

Event = tuple[str, dict[str, Any]]
"""One server-sent event: its name and its JSON data."""


@dataclass(slots=True)
class ToolCall:
    """One tool call as far as the engine sent it: vLLM sends its id and name first, then its arguments in pieces."""

    key: int
    """Which call: the engine's index, else the call's position in its first chunk."""
    call_id: str | None = None
    """The first id the engine gave it."""
    name: str | None = None
    """The first name the engine gave it."""
    arguments: str = ""
    """The arguments' JSON text so far."""


class ChunkTranslator(ABC):
    """Walks the engine's chunks and hands their parts to a protocol's translator, in the engine's order.

    A subclass implements the hooks (``_on_reasoning``, ``_on_text``, ``_on_tool_call``, ``_on_finish``,
    ``_on_last_chunk``, ``_begin``, ``_idle``, ``_ended``, ``_opened``), each appending the events
    it makes to the list it is given, and calls :meth:`_read` for each chunk it takes.
    """

    def __init__(self) -> None:
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._held_between_calls = ""
        self._tool_calls: dict[int, ToolCall] = {}
        self.tool_closed = False
        """A tool call's closing event (its whole arguments) is out: harnesses run the tool on it."""
        """The answer's tool calls by their key, in the engine's order."""

    def _read(self, chunk: dict[str, Any], events: list[Event]) -> None:
        """Hand the parts of one chunk's first choice to the hooks; the usage-only last chunk ends the answer.

        Responses and Messages have one answer per call: other choices are never asked for.
        """
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            self._malformed("a stream chunk's choices is not a list")
            choices = []
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                self._malformed("a stream chunk's delta is not an object")
                delta = {}
            thought = engine_reasoning(delta)
            if thought:
                self._on_reasoning(thought, events)
            content = delta.get("content")
            if isinstance(content, str) and content:
                self._on_text(content, events)
            tool_calls = delta.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                self._malformed("a stream chunk's tool_calls is not a list")
                tool_calls = []
            for position, call in enumerate(tool_calls):
                self._add_to_tool_call(call, position, events)
            finish_reason = choice.get("finish_reason")
            if finish_reason is not None:
                self._finish_reason = str(finish_reason)
                self._on_finish(choice, events)
        if not choices and isinstance(usage, dict) and self._finish_reason is not None:
            self._on_last_chunk(events)

    def _add_to_tool_call(self, call: Any, position: int, events: list[Event]) -> None:
        """Add one chunk's fragment of a tool call to the call, then hand both to :meth:`_on_tool_call`."""
        if not isinstance(call, dict):
            self._malformed("a streamed tool call is not an object")
            return
        index = call.get("index")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            self._malformed("a streamed tool call has no integer index")
            index = None
        function = call.get("function") or {}
        if not isinstance(function, dict):
            self._malformed("a streamed tool call's function is not an object")
            function = {}
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        if not isinstance(arguments, str):  # an engine that sent an object: its JSON text
            arguments = orjson.dumps(arguments).decode() if arguments else ""
        key = position if index is None else index
        tool = self._tool_calls.get(key)
        new = tool is None
        if tool is None:
            tool = self._tool_calls[key] = ToolCall(key)
        if tool.call_id is None and isinstance(call_id, str) and call_id:
            tool.call_id = call_id
        if tool.name is None and isinstance(name, str) and name:
            tool.name = name
        tool.arguments += arguments
        self._on_tool_call(tool, arguments, new, events)

    def _between_calls(self, text: str, text_open: bool) -> str | None:
        r"""``text`` as it may go out now; None while it is whitespace that follows a tool call.

        Parsers stream what a model writes between two calls of one turn ("</tool_call>\n
        <tool_call>") as text. Sent, it would come back with the harness's history as text
        before the calls, which the model never wrote there, and split the turn in two (and
        Anthropic's API refuses whitespace-only text): held until text follows, and dropped if
        none does, as vLLM drops it from a whole answer. ``text_open``: the answer's text is
        open (its block or item), so ``text`` continues it.
        """
        if text_open or not self._tool_calls:
            return text
        text = self._held_between_calls + text
        if text.isspace():
            self._held_between_calls = text
            return None
        self._held_between_calls = ""
        return text

    def keepalive(self) -> list[Event]:
        """Events that only say the answer is still coming; none once it ended.

        Harnesses abort a stream after minutes without an event (Claude Code and Codex after
        five) and send the call again. Before the engine's first chunk (a queue, a long prefill)
        the answer is opened, as the vendors' APIs open it at once; after it, :meth:`_idle`.
        """
        events: list[Event] = []
        if self._ended():
            return events
        if not self._opened():
            self._begin({}, events)
        else:
            self._idle(events)
        return events

    # ---- hooks

    @abstractmethod
    def _malformed(self, what: str) -> None:
        """A chunk's part has the wrong shape: raise to fail the stream, or return to pass over it."""

    @abstractmethod
    def _on_reasoning(self, text: str, events: list[Event]) -> None:
        """A piece of the engine's reasoning."""

    @abstractmethod
    def _on_text(self, text: str, events: list[Event]) -> None:
        """A piece of the answer's text (see :meth:`_between_calls`)."""

    @abstractmethod
    def _on_tool_call(self, call: ToolCall, fragment: str, new: bool, events: list[Event]) -> None:
        """``fragment`` ("" for none) was just added to ``call``; ``new``: it is the call's first."""

    @abstractmethod
    def _on_finish(self, choice: dict[str, Any], events: list[Event]) -> None:
        """The engine sent a finish reason (in :attr:`_finish_reason`); ``choice`` is its choice."""

    @abstractmethod
    def _on_last_chunk(self, events: list[Event]) -> None:
        """The usage-only chunk after the finish reason: the engine's last word."""

    @abstractmethod
    def _begin(self, chunk: dict[str, Any], events: list[Event]) -> None:
        """Open the answer (its first events) from its first chunk, or from ``{}`` before any."""

    @abstractmethod
    def _idle(self, events: list[Event]) -> None:
        """A keep-alive within an open answer."""

    @abstractmethod
    def _ended(self) -> bool:
        """Whether the answer's last event is out."""

    @abstractmethod
    def _opened(self) -> bool:
        """Whether the answer's first events are out."""


__all__ = ["ChunkTranslator", "Event", "ToolCall"]
