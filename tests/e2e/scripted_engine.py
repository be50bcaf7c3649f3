"""A scripted model server that speaks vLLM's chat-completions contract, for harness end-to-end tests.

Real harnesses only finish a tool task if the model picks a tool, fills its arguments and then
answers with the tool's output; a tiny random model cannot do that, so these tests put this
*scripted* engine behind the proxy instead. (The tests against the real vLLM engine live with
the proxy's integration tests.) It follows a fixed script:

* a request that offers tools and has no tool result yet is answered with one call of the preferred
  tool (the first offered one whose name is in ``prefer``, else the first offered one), its
  arguments filled from the tool's JSON schema, with ``command`` going to the command-like property;
* a request whose messages hold a tool result is answered with final text quoting the last result;
* anything else (a title or summary request without tools) gets a short plain answer.

Answers honour what the proxy asks vLLM for: top-level ``prompt_token_ids``, per choice
``token_ids``, ``logprobs.content[].logprob`` and ``weight_versions``, usage; streamed answers send
``prompt_token_ids`` on the first chunk, ``token_ids`` and logprobs with every chunk, a usage-only
chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``. Tokenization is a
deterministic fake (word pieces hashed into a vocabulary): it only needs to be self-consistent,
and every request the engine served is kept in :attr:`ScriptedEngine.seen` with the exact ids it
sent, so a test can compare them with what the proxy recorded. By default the fake template writes
a sampled turn back with other tokens than were sampled (as real templates do); with
``exact_turns`` it writes it back token for token, so a harness that keeps its history unchanged
makes prompts that extend the earlier prompt and completion, and one that rewrites it does not.

With ``token_endpoints`` (and the exact template) the engine also offers vLLM's token-in/token-out
endpoints as the proxy's continuation mode uses them (``/v1/chat/completions/render``,
``/inference/v1/generate``, whole and streamed, and ``/v1/chat/completions/derender``), so the proxy
probes them and serves calls by continuation. Its tokenizer is then one-to-one (each new word piece
gets the next free id of its hash's probe sequence), so generate decodes the prompt ids it is given
back into the conversation and answers that by the script: the answer follows the ids, never a side
channel, and a prompt holding an id the engine never made is refused. Its template then also
spells a tool call's tags as one added id each (:data:`ADDED`) where the model samples them as
word pieces, as vLLM's hermes models do: the text is the same, the ids are not, so in chat mode a
turn written back by the template no longer extends what was sampled, and only continuation
(which reuses the sampled ids) joins the turns of a harness that keeps its history.

Faults can be injected: :class:`Fault` answers a matching request with an HTTP error a given
number of times (harnesses retry 5xx), which exercises the proxy's retry linking.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from inloop_server import InLoopServer

MODEL = "openforge-scripted"
VOCAB = 151_000
EOS_ID = 2
END_OF_TURN = "<|end|>"
"""How the exact template (``exact_turns``) closes every message, and so how an exact answer ends."""
WEIGHT_VERSION = "scripted-v1"
THOUGHT = "Let me think. "
"""One chunk of the engine's reasoning, when it is asked to think (``ScriptedEngine(reasoning=...)``)."""
_PIECE = re.compile(r"\w+|[^\w\s]|\s+")

#: Tool names that run a shell command, in the order a harness's tools are searched.
SHELL_TOOLS = ("Bash", "exec_command", "shell_command", "shell", "exec", "bash", "run_command")
_COMMAND_KEYS = ("command", "cmd", "script")


def tokenize(text: str, vocab: int = VOCAB) -> list[int]:
    """Deterministic fake token ids: each word, punctuation mark or whitespace run hashed into the vocabulary."""
    return [10 + zlib.crc32(piece.encode()) % (vocab - 10) for piece in _PIECE.findall(text)]


def logprob_of(token_id: int) -> float:
    """Deterministic fake behaviour logprob of a token."""
    return -((token_id % 97) + 1) / 100.0


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(p.get("text", "") if isinstance(p, dict) else p) for p in content)
    return "" if content is None else orjson.dumps(content).decode()


def render_prompt(body: dict[str, Any], *, exact: bool = False) -> str:
    """The prompt text the fake chat template makes of a request (tools first, then each message).

    With ``exact`` every message is written as ``<|role|>`` + text + tool calls + :data:`END_OF_TURN`,
    with nothing between messages: an answer comes back exactly as it was sampled.
    """
    if exact:
        head = ("<|tools|>" + orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode() + END_OF_TURN
                if body.get("tools") else "")
        messages = body.get("messages") or []
        open_last = bool(body.get("continue_final_message")) and bool(messages)
        turns = "".join(
            f"<|{m.get('role')}|>{_text_of(m.get('content'))}" + "".join(
                f"<tool_call>{(c.get('function') or {}).get('name')} {(c.get('function') or {}).get('arguments')}"
                "</tool_call>" for c in m.get("tool_calls") or [])
            + ("" if open_last and i == len(messages) - 1 else END_OF_TURN)
            for i, m in enumerate(messages))
        generation_prompt = body.get("add_generation_prompt", True) and not open_last
        return head + turns + ("<|assistant|>" if generation_prompt else "")
    parts = []
    if body.get("tools"):
        parts.append("<|tools|>" + orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode())
    for message in body.get("messages") or []:
        parts.append(f"<|{message.get('role')}|>{_text_of(message.get('content'))}")
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(f"<tool_call>{function.get('name')} {function.get('arguments')}</tool_call>")
    if body.get("add_generation_prompt", True):
        parts.append("<|assistant|>")
    return "\n".join(parts)


@dataclass
class Fault:
    """Fail matching requests ``times`` times, then serve them normally.

    By default the engine answers with HTTP ``status`` (harnesses retry 5xx). With ``drop_after``
    set, a streamed request is answered 200 and its stream is cut after that many chunks, without
    a finish reason or ``[DONE]``, as when an engine dies mid-answer; with ``done`` set too,
    ``[DONE]`` follows the cut, as from an engine that drops its last chunk. With ``abort_after`` set,
    the answer (whole or streamed) holds only that many pieces and ends with ``finish_reason:
    "abort"``, usage and ``[DONE]``, as vLLM ends the answers in flight when it is paused in its
    default mode. With ``body`` set, a whole request is answered with ``status`` and exactly these
    bytes, as a server that breaks the contract would. With ``drop_after`` and ``error_chunk`` set,
    the cut stream goes on with an error chunk (``message``) and ``[DONE]``, as vLLM ends a stream
    whose generation raised. With ``stream`` set, a request (streamed or not) is answered 200 with
    exactly these ``data:`` payloads (bytes) and pauses (seconds, as floats), in order, and the
    connection then closes: ``[DONE]`` only if it is listed.
    """

    match: Callable[[dict[str, Any]], bool]
    status: int = 503
    times: int = 1
    message: str = "scripted engine: injected fault, retry later"
    drop_after: int | None = None
    done: bool = False
    abort_after: int | None = None
    body: bytes | None = None
    error_chunk: bool = False
    stream: list[bytes | float] | None = None
    fired: int = 0


@dataclass
class SeenCall:
    """One chat-completions request as the engine saw and answered it."""

    index: int
    body: dict[str, Any]
    status: int
    kind: str  # "tool_call", "final", "plain", "fault" (an HTTP error), "dropped" (a cut stream), "aborted"
    streamed: bool
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    tool_name: str | None = None
    tool_arguments: dict[str, Any] | None = None
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "generate" (/inference/v1/generate)


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_ROLE = re.compile(r"<\|(\w+)\|>")


def parse_prompt(text: str) -> dict[str, Any]:
    """The chat request (tools and messages) the exact template rendered as ``text``: its inverse.

    The generation prompt at the end comes back as an empty assistant message; tool calls are kept
    as the text the template wrote (the script reads only the tools, the roles and the tool results).
    """
    tools: Any = None
    messages: list[dict[str, Any]] = []
    for segment in text.split(END_OF_TURN):
        role = _ROLE.match(segment)
        if role is None:
            if segment:
                raise ValueError(f"a prompt segment without a role: {segment[:80]!r}")
            continue
        content = segment[role.end():]
        if role.group(1) == "tools":
            tools = orjson.loads(content)
        else:
            messages.append({"role": role.group(1), "content": content})
    return {"tools": tools, "messages": messages}


def split_answer(text: str) -> tuple[str, dict[str, Any] | None]:
    """A sampled answer's text and its tool call (chat-completions form), the turn's closing left out.

    The call is None until its closing tag came (a streamed answer still being sampled).
    """
    text = text.split(END_OF_TURN)[0]
    if not text.startswith(TOOL_OPEN) or TOOL_CLOSE not in text:
        return ("" if TOOL_OPEN.startswith(text) or text.startswith(TOOL_OPEN) else text), None
    name, _, arguments = text[len(TOOL_OPEN):text.index(TOOL_CLOSE)].partition(" ")
    return "", {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}


ADDED = {TOOL_OPEN: 3, TOOL_CLOSE: 4}
"""The template's one-id spelling of the tool-call tags (token mode); the model samples them as pieces."""
_ADDED = re.compile("(" + "|".join(re.escape(tag) for tag in ADDED) + ")")


def has_tool_result(body: dict[str, Any]) -> bool:
    """Whether the conversation already holds a tool result (turn 2 of the script)."""
    return any(m.get("role") == "tool" for m in body.get("messages") or [] if isinstance(m, dict))


def first_turn(body: dict[str, Any]) -> bool:
    """A request the script answers with a tool call: tools offered, no tool result yet."""
    return bool(body.get("tools")) and not has_tool_result(body)


def _fill(schema: dict[str, Any], command: str) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    if kind == "object" or "properties" in schema:
        return _fill_object(schema, command)
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return False
    return ""


def _fill_object(schema: dict[str, Any], command: str) -> dict[str, Any]:
    properties: dict[str, Any] = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for name in _COMMAND_KEYS:
        if name in properties:
            kind = properties[name].get("type")
            out[name] = ["bash", "-lc", command] if kind == "array" else command
            break
    for name in schema.get("required") or []:
        if name not in out and name in properties:
            out[name] = _fill(properties[name], command)
    return out


def tool_arguments(tool: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for ``tool`` (chat-completions form) filled from its JSON schema."""
    parameters = (tool.get("function") or {}).get("parameters") or {}
    return _fill_object(parameters, command)


def tool_name(tool: dict[str, Any]) -> str:
    """The name of a chat-completions tool."""
    return str((tool.get("function") or {}).get("name") or tool.get("name") or "")


class ScriptedEngine:
    """The scripted server: an ASGI app plus what it saw. Use :meth:`running` to serve it."""

    def __init__(self, *, command: str, prefer: tuple[str, ...] = SHELL_TOOLS, faults: list[Fault] | None = None,
                 final_prefix: str = "Done. The command printed: ", chunk_pieces: int = 3,
                 reasoning: tuple[int, float] = (0, 0.0), queue_s: float = 0.0, stall_s: float = 0.0,
                 vocab: int = VOCAB, exact_turns: bool = False, tool_turns: int = 1,
                 token_endpoints: bool = False) -> None:
        """Args:
            command: The command a tool call runs.
            prefer: Tool names to call, in order of preference.
            faults: Faults to inject.
            final_prefix: What the final answer starts with.
            chunk_pieces: Word pieces per streamed chunk.
            reasoning: Chunks of reasoning (:data:`THOUGHT` in ``reasoning``, as vLLM's reasoning
                parser sends it) before each answer, and the seconds between them when streamed:
                a model that thinks for a while before it says anything.
            queue_s: Seconds a streamed answer sends nothing after its headers, as vLLM while a
                request waits in its queue and prefills.
            stall_s: Seconds a streamed answer sends nothing after its second chunk (in the
                middle of its text or of a tool call's arguments), as vLLM paused for new weights.
            vocab: Size of the fake vocabulary (the tiny model's 4096 lets the learner train on the ids).
            exact_turns: The template writes a sampled turn back exactly (see the module docstring).
            tool_turns: Tool results the conversation must hold before the answer is final text (each
                request with fewer gets another call of the tool).
            token_endpoints: Offer render, generate and derender (see the module docstring); needs
                ``exact_turns``, whose turn closing the proxy's probe reads.
        """
        if token_endpoints and not exact_turns:
            raise ValueError("token_endpoints needs exact_turns: the proxy continues turns the template closes")
        self.token_endpoints = token_endpoints
        self._ids: dict[str, int] = {}  # the one-to-one vocabulary of token mode, both ways
        self._words: dict[int, str] = {token: tag for tag, token in ADDED.items()} if token_endpoints else {}
        self.tool_turns = tool_turns
        self.vocab = vocab
        self.exact_turns = exact_turns
        self.command = command
        self.reasoning = reasoning
        self.queue_s = queue_s
        self.stall_s = stall_s
        self.prefer = prefer
        self.faults = list(faults or [])
        self.final_prefix = final_prefix
        self.chunk_pieces = chunk_pieces
        self.seen: list[SeenCall] = []
        self.other_requests: list[str] = []  # non-chat paths asked, for diagnostics
        self.app = self._build()

    # -- the script ---------------------------------------------------------------------------------

    def _pick_tool(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        by_name = {tool_name(t): t for t in tools}
        for name in self.prefer:
            if name in by_name:
                return by_name[name]
        return tools[0]

    def answer(self, body: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
        """(kind, text, tool call) the script gives for this request."""
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        results = sum(1 for m in messages if m.get("role") == "tool")
        if results >= self.tool_turns or (results and not body.get("tools")):
            result = next(_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "tool")
            return "final", self.final_prefix + result.strip(), None
        if body.get("tools"):
            tool = self._pick_tool(body["tools"])
            call = {"id": f"call{uuid.uuid4().hex[:20]}", "type": "function",
                    "function": {"name": tool_name(tool),
                                 "arguments": orjson.dumps(tool_arguments(tool, self.command)).decode()}}
            return "tool_call", "", call
        return "plain", "OpenForge scripted engine reply.", None

    # -- HTTP ---------------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health() -> Response:
            return Response(b"", status_code=200)

        @app.get("/v1/models")
        async def models() -> Response:
            return _json({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                      "owned_by": "openforge", "max_model_len": 262144}]})

        @app.post("/tokenize")
        async def tokenize_route(request: Request) -> Response:
            body = orjson.loads(await request.body())
            ids = self._prompt_ids(body) if "messages" in body else self._tokenize(str(body.get("prompt", "")))
            return _json({"count": len(ids), "tokens": ids, "max_model_len": 262144})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return self._chat(orjson.loads(await request.body()))

        @app.post("/v1/chat/completions/render")
        async def render(request: Request) -> Response:
            return self._token_route(request.url.path, orjson.loads(await request.body()), self._render_answer)

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Response:
            return self._token_route(request.url.path, orjson.loads(await request.body()), self._generate)

        @app.post("/v1/chat/completions/derender")
        async def derender(request: Request) -> Response:
            return self._token_route(request.url.path, orjson.loads(await request.body()), self._derender)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def other(path: str, request: Request) -> Response:
            self.other_requests.append(f"{request.method} /{path}")
            return _json({"error": {"message": f"scripted engine has no /{path}"}}, 404)

        return app

    def _chat(self, body: dict[str, Any]) -> Response:
        streamed = bool(body.get("stream"))
        index = len(self.seen)
        fault = next((f for f in self.faults if f.fired < f.times and f.match(body)
                      and (f.drop_after is None or streamed)), None)
        if fault is not None:
            fault.fired += 1
        if fault is not None and fault.body is not None:
            self.seen.append(SeenCall(index, body, fault.status, "fault", streamed))
            return Response(fault.body, status_code=fault.status, media_type="application/json")
        if fault is not None and fault.stream is not None:
            self.seen.append(SeenCall(index, body, 200, "fault", streamed))
            return StreamingResponse(_scripted(fault.stream), media_type="text/event-stream")
        if fault is not None and fault.drop_after is None and fault.abort_after is None:
            self.seen.append(SeenCall(index, body, fault.status, "fault", streamed))
            return _json({"error": {"message": fault.message, "type": "ServiceUnavailable",
                                    "code": fault.status}}, fault.status)
        kind, text, call = self.answer(body)
        prompt_ids = self._prompt_ids(body)
        pieces = self._pieces(text, call)
        thought = THOUGHT * self.reasoning[0]
        if thought:  # a whole answer holds the same thinking in one field
            pieces = [({"role": "assistant", "reasoning": THOUGHT}, self._tokenize(THOUGHT))] * self.reasoning[0] + pieces
        completion_ids = [t for _, ids in pieces for t in ids] + self._closing()
        finish = "tool_calls" if call else "stop"
        if fault is not None and fault.abort_after is not None:  # the engine aborted it after a few pieces
            pieces = pieces[:fault.abort_after]
            kind, completion_ids, finish = "aborted", [t for _, ids in pieces for t in ids], "abort"
            text = "".join(d.get("content") or "" for d, _ in pieces)
            call = None  # an unfinished call is not parsed into one
        elif fault is not None:  # a stream cut after ``drop_after`` chunks
            pieces = pieces[:fault.drop_after]
            kind, completion_ids = "dropped", [t for _, ids in pieces for t in ids]
        logprobs = [logprob_of(t) for t in completion_ids]
        seen = SeenCall(index, body, 200, kind, streamed, prompt_ids, completion_ids, logprobs, text,
                        (call or {}).get("function", {}).get("name"),
                        orjson.loads(call["function"]["arguments"]) if call else None)
        self.seen.append(seen)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                 "total_tokens": len(prompt_ids) + len(completion_ids)}
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        if not streamed:
            # As vLLM with a reasoning parser: hiding the reasoning withholds every token id and logprob.
            hidden = bool(thought) and body.get("include_reasoning") is False
            message: dict[str, Any] = {"role": "assistant", "content": text or None, "tool_calls": [call] if call
                                       else [], "reasoning": None if hidden else thought or None}
            return _json({
                "id": chat_id, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": None,
                             "logprobs": None if hidden else {"content": [_logprob_item(t) for t in completion_ids]},
                             "token_ids": None if hidden else completion_ids,
                             "weight_versions": [{"version": WEIGHT_VERSION, "start": 0,
                                                  "end": len(completion_ids)}]}],
                "usage": usage, "prompt_token_ids": prompt_ids, "prompt_logprobs": None,
            })
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._stream(chat_id, prompt_ids, pieces, completion_ids, finish, usage,
                                              include_usage, cut=fault is not None and fault.drop_after is not None,
                                              done_after_cut=fault is not None and fault.done,
                                              error=fault.message if fault is not None and fault.error_chunk else None),
                                 media_type="text/event-stream")

    def _tokenize(self, text: str) -> list[int]:
        if not self.token_endpoints:
            return tokenize(text, self.vocab)
        out = []
        for piece in _PIECE.findall(text):
            token = self._ids.get(piece)
            if token is None:
                if len(self._words) >= self.vocab - 10:
                    raise RuntimeError(f"the scripted vocabulary of {self.vocab} ids is full")
                token = tokenize(piece, self.vocab)[0]
                while token in self._words:  # taken by another piece: the next free id
                    token = 10 + (token - 9) % (self.vocab - 10)
                self._ids[piece], self._words[token] = token, piece
            out.append(token)
        return out

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The ids of the template's prompt for a chat request (token mode: its tool-call tags as added ids)."""
        text = self._render(body)
        if not self.token_endpoints:
            return self._tokenize(text)
        return [t for part in _ADDED.split(text) if part
                for t in ([ADDED[part]] if part in ADDED else self._tokenize(part))]

    def _decode(self, ids: list[int]) -> str:
        """The text of ids this engine made (token mode); KeyError for one it never made."""
        return "".join(self._words[token] for token in ids)

    def _render(self, body: dict[str, Any]) -> str:
        return render_prompt(body, exact=self.exact_turns)

    def _closing(self) -> list[int]:
        """The ids that end a whole answer: the end-of-sequence id, or the exact template's end of turn."""
        return self._tokenize(END_OF_TURN) if self.exact_turns else [EOS_ID]

    def _pieces(self, text: str, call: dict[str, Any] | None) -> list[tuple[dict[str, Any], list[int]]]:
        """The answer as (delta, token ids) pieces, one streamed chunk each."""
        out: list[tuple[dict[str, Any], list[int]]] = []
        if call is not None:
            name = call["function"]["name"]
            head = [{"index": 0, "id": call["id"], "type": "function", "function": {"name": name, "arguments": ""}}]
            out.append(({"role": "assistant", "tool_calls": head}, self._tokenize(f"<tool_call>{name} ")))
            words = _PIECE.findall(call["function"]["arguments"])
            for i in range(0, len(words), self.chunk_pieces):
                part = "".join(words[i:i + self.chunk_pieces])
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}, self._tokenize(part)))
            out.append(({}, self._tokenize("</tool_call>")))
            return out
        words = _PIECE.findall(text)
        for i in range(0, len(words), self.chunk_pieces):
            part = "".join(words[i:i + self.chunk_pieces])
            delta: dict[str, Any] = {"content": part}
            if i == 0:
                delta["role"] = "assistant"
            out.append((delta, self._tokenize(part)))
        return out or [({"role": "assistant", "content": ""}, [])]

    # -- token in / token out ------------------------------------------------------------------------

    def _token_route(self, path: str, body: Any, serve: Callable[[dict[str, Any]], Response]) -> Response:
        """Serve a token endpoint as vLLM with ``--enable-scale-out`` does: 404 without it, 400 on a bad body."""
        if not self.token_endpoints:
            self.other_requests.append(f"POST {path}")
            return _json({"error": {"message": f"scripted engine has no {path}"}}, 404)
        try:
            return serve(body if isinstance(body, dict) else {})
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            return _json({"error": {"message": f"{path}: invalid request ({exc!r})", "type": "BadRequestError",
                                    "code": 400}}, 400)

    def _render_answer(self, body: dict[str, Any]) -> Response:
        """``/v1/chat/completions/render``: the prompt ids and sampling parameters of a chat request."""
        if not isinstance(body["messages"], list):
            raise TypeError("messages must be a list")
        sampling: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "logprobs": 0, "skip_special_tokens": False}
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        if type(requested) is int and requested != 16:  # as vLLM: a value equal to the default is left out
            sampling["max_tokens"] = requested
        return _json({"request_id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "token_ids": self._prompt_ids(body),
                      "sampling_params": sampling, "model": MODEL, "output_mode": "tokens", "stream": False,
                      "stream_options": None, "priority": 0})

    def _generate(self, body: dict[str, Any]) -> Response:
        """``/inference/v1/generate``: the script's answer to the conversation the prompt ids decode to."""
        prompt_ids, sampling = body["token_ids"], body["sampling_params"]
        if not isinstance(prompt_ids, list) or not prompt_ids or not isinstance(sampling, dict):
            raise ValueError("token_ids (a non-empty list) and sampling_params are required")
        request = parse_prompt(self._decode(prompt_ids))
        kind, text, call = self.answer(request)
        completion_ids = [t for _, ids in self._pieces(text, call) for t in ids] + self._closing()
        finish = "stop"
        max_tokens = sampling.get("max_tokens")
        if type(max_tokens) is int and len(completion_ids) > max_tokens:
            completion_ids, finish = completion_ids[:max_tokens], "length"
        streamed = bool(body.get("stream"))
        self.seen.append(SeenCall(len(self.seen), request, 200, kind, streamed, list(prompt_ids), completion_ids,
                                  [logprob_of(t) for t in completion_ids], text,
                                  (call or {}).get("function", {}).get("name"),
                                  orjson.loads(call["function"]["arguments"]) if call else None, "generate"))
        head = {"request_id": f"generate-tokens-{uuid.uuid4().hex[:16]}", "model": MODEL,
                "created": int(time.time()), "output_mode": "tokens"}
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                 "total_tokens": len(prompt_ids) + len(completion_ids)}
        spans = [{"version": WEIGHT_VERSION, "start": 0, "end": len(completion_ids)}]
        if not streamed:
            return _json({**head, "usage": usage, "prompt_token_ids": None, "choices": [{
                "index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": completion_ids,
                "weight_versions": spans, "logprobs": {"content": [_token_logprob(t) for t in completion_ids]}}]})

        async def steps() -> AsyncIterator[bytes]:
            # One chunk per ``chunk_pieces`` ids; the spans, as vLLM's, only on the last chunk.
            step = max(self.chunk_pieces, 1)
            for start in range(0, max(len(completion_ids), 1), step):
                ids = completion_ids[start:start + step]
                last = start + step >= len(completion_ids)
                yield b"data: " + orjson.dumps({**head, "usage": None, "choices": [{
                    "index": 0, "finish_reason": finish if last else None, "stop_reason": None, "token_ids": ids,
                    "weight_versions": spans if last else None,
                    "logprobs": {"content": [_token_logprob(t) for t in ids]}}]}) + b"\n\n"
                await asyncio.sleep(0)
            yield b"data: " + orjson.dumps({**head, "usage": usage, "choices": []}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(steps(), media_type="text/event-stream")

    def _derender(self, body: dict[str, Any]) -> Response:
        """``/v1/chat/completions/derender``: sampled ids back into a chat answer, tool calls parsed.

        Streamed, the caller carries the state (the text so far, what was sent, the answer's id);
        a tool call is held back until it is whole, then sent in one delta, as a tool parser does.
        """
        if not isinstance(body["chat_request"], dict):
            raise TypeError("chat_request must be an object")
        if body.get("stream"):
            return self._derender_chunk(body["generate_chunk"], body.get("stream_state"))
        generated = body["generate_response"]["choices"][0]
        ids = list(generated["token_ids"])
        text, call = split_answer(self._decode(ids))
        finish = "tool_calls" if call is not None and generated.get("finish_reason") == "stop" \
            else generated.get("finish_reason")
        message = {"role": "assistant", "content": text or None, "tool_calls": [call] if call else [],
                   "reasoning": None}
        prompt_tokens = int(body["prompt_tokens"])
        return _json({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                      "model": MODEL, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                   "stop_reason": None, "token_ids": None,
                                                   "logprobs": {"content": [_logprob_item(t) for t in ids]}}],
                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                                "total_tokens": prompt_tokens + len(ids)},
                      "prompt_token_ids": None})

    def _derender_chunk(self, chunk: dict[str, Any], state: dict[str, Any] | None) -> Response:
        state = dict(state or {"id": f"chatcmpl-{uuid.uuid4().hex}", "text": "", "sent": 0, "called": False})
        generated = chunk["choices"][0]
        state["text"] += self._decode(list(generated.get("token_ids") or []))
        finished = generated.get("finish_reason")
        text, call = split_answer(state["text"])
        delta: dict[str, Any] = {}
        if TOOL_OPEN.startswith(state["text"]) or state["text"].startswith(TOOL_OPEN):
            if call is not None and not state["called"]:
                delta["tool_calls"] = [{"index": 0, **call}]
                state["called"] = True
        else:
            # Hold back what may be the start of the turn's closing until it is known not to be.
            keep = len(text) if finished or END_OF_TURN in state["text"] else next(
                (len(text) - n for n in range(min(len(END_OF_TURN), len(text)), 0, -1)
                 if END_OF_TURN.startswith(text[-n:])), len(text))
            if keep > state["sent"]:
                delta["content"] = text[state["sent"]:keep]
                state["sent"] = keep
        if finished == "stop" and state["called"]:
            finished = "tool_calls"
        out = {"id": state["id"], "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL,
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finished,
                            "stop_reason": None}]}
        return _json({"chunk": out, "stream_state": state})

    async def _stream(self, chat_id: str, prompt_ids: list[int], pieces: list[tuple[dict[str, Any], list[int]]],
                      completion_ids: list[int], finish: str, usage: dict[str, Any],
                      include_usage: bool, cut: bool = False, done_after_cut: bool = False,
                      error: str | None = None) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            payload = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                       "choices": choices, **extra}
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        await asyncio.sleep(self.queue_s)
        for i, (delta, ids) in enumerate(pieces):
            choice = {"index": 0, "delta": delta, "logprobs": {"content": [_logprob_item(t) for t in ids]},
                      "finish_reason": None, "token_ids": ids}
            extra = {"prompt_token_ids": prompt_ids} if i == 0 else {}
            yield chunk([choice], **extra)
            await asyncio.sleep(self.reasoning[1] if "reasoning" in delta else self.stall_s if i == 1 else 0)
        if cut:  # the engine "died": no finish reason, no usage, and [DONE] only if asked
            if error is not None:  # vLLM's streaming error response, then its [DONE]
                yield b"data: " + orjson.dumps({"error": {"message": error, "type": "InternalServerError",
                                                          "param": None, "code": 500}}) + b"\n\n"
                yield b"data: [DONE]\n\n"
            elif done_after_cut:
                yield b"data: [DONE]\n\n"
            return
        closing = [] if finish == "abort" else self._closing()  # an aborted answer ends where it was cut
        last = {"index": 0, "delta": {}, "logprobs": {"content": [_logprob_item(t) for t in closing]},
                "finish_reason": finish, "stop_reason": None, "token_ids": closing,
                "weight_versions": [{"version": WEIGHT_VERSION, "start": 0, "end": len(completion_ids)}]}
        yield chunk([last])
        if include_usage:
            yield chunk([], usage=usage)
        yield b"data: [DONE]\n\n"

    # -- serving ------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, port: int) -> AsyncIterator[str]:
        """Serve on 127.0.0.1:``port`` in this event loop; yields the base URL."""
        server = InLoopServer(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="off"))
        task = asyncio.create_task(server.serve())
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(200):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{url}/health")).status_code == 200:
                            break
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError("scripted engine did not start")
            yield url
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)


async def _scripted(script: list[bytes | float]) -> AsyncIterator[bytes]:
    for step in script:
        if isinstance(step, float):
            await asyncio.sleep(step)
        else:
            yield b"data: " + step + b"\n\n"


def _token_logprob(token_id: int) -> dict[str, Any]:
    """A sampled id's logprob as generate writes it (``output_mode`` tokens)."""
    return {"token_id": token_id, "logprob": logprob_of(token_id), "rank": 1, "top_logprobs": []}


def _logprob_item(token_id: int) -> dict[str, Any]:
    return {"token": f"<{token_id}>", "logprob": logprob_of(token_id), "bytes": None, "top_logprobs": []}


def _json(payload: dict[str, Any], status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")
