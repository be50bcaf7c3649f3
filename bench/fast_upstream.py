"""A minimal, fast stand-in for a vLLM server on loopback, for the proxy and loop benchmarks.

Run with ``python -m bench.fast_upstream --port 8000`` (``bench.proxy`` and ``bench.loop`` start it in
its own process).

It honours the parts of vLLM's chat-completions contract that a capturing proxy relies on:

* ``POST /v1/chat/completions``, whole answer: top-level ``prompt_token_ids``, ``choices[0].token_ids``,
  ``choices[0].logprobs.content[j].logprob`` and ``usage``;
* the same with ``"stream": true``: server-sent events over chunked transfer encoding, the first chunk
  carrying the role and the top-level ``prompt_token_ids``, then one chunk per token with its
  ``token_ids`` and ``logprobs`` (``finish_reason`` on the last), a usage-only chunk (``choices: []``)
  when ``stream_options.include_usage`` is set, and ``data: [DONE]``;
* ``GET /v1/models``, ``GET /health``, ``GET /weight_info`` (the weight version label, ``"0"`` until
  changed), and ``GET /stats`` (chat calls served so far, for checks);
* the dev-mode RL endpoints the checkpoint publisher drives, as vLLM's RL build answers them:
  ``POST /pause`` (chat requests that arrive are held, unanswered, until ``POST /resume``, and then
  answered with the version set meanwhile), ``POST /collective_rpc`` (``reload_weights``: answered
  after ``--reload-s`` seconds, the time a real engine spends loading; nothing is read),
  ``POST /reset_prefix_cache`` and ``POST /update_weight_version`` (``{"new_version": label}``);
* with ``--weight-versions``, every answer says which version sampled its tokens
  (``choices[0].weight_versions``, one range over the whole completion; on the last chunk when
  streamed), as an engine that reports per-token versions does.

Every answer is the same canned completion, encoded once at startup and again when the version
changes: per request the server only parses the HTTP head, reads the JSON body (to see ``stream``
and ``stream_options``) and writes a precomputed byte string. It is a bare :class:`asyncio.Protocol`
(uvloop when installed), HTTP/1.1 with keep-alive, so that a proxy in front of it is measured, not
this server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, cast

import orjson

MODEL = "bench-model"
"""The model name served (what ``/v1/models`` reports)."""

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024


class Canned:
    """The precomputed responses (whole HTTP messages, head included)."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, version: str = "0", *,
                 weight_versions: bool = False) -> None:
        """Encode every answer for ``version``; ``weight_versions`` adds the version range to answers."""
        ranges = [{"version": version, "start": 0, "end": completion_tokens}] if weight_versions else None
        versioned = {} if ranges is None else {"weight_versions": ranges}
        prompt_ids = [(i * 7919) % 150_000 for i in range(prompt_tokens)]
        token_ids = [(i * 104_729 + 17) % 150_000 for i in range(completion_tokens)]
        words = [f" w{i}" for i in range(completion_tokens)]
        logprobs = [-((i % 13) + 1) / 16 for i in range(completion_tokens)]
        created = int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None}
        whole = {
            "id": "chatcmpl-bench", "object": "chat.completion", "created": created, "model": MODEL,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "".join(words), "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": {"content": [
                    {"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
                    for w, lp in zip(words, logprobs, strict=True)]},
                "finish_reason": "stop", "stop_reason": None, "token_ids": token_ids, **versioned,
            }],
            "service_tier": None, "system_fingerprint": None, "usage": usage,
            "prompt_logprobs": None, "prompt_token_ids": prompt_ids, "kv_transfer_params": None,
        }
        self.whole = _message(200, "application/json", orjson.dumps(whole))

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": created,
                    "model": MODEL, "choices": choices, **extra}
            return b"data: " + orjson.dumps(body) + b"\n\n"

        events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], prompt_token_ids=prompt_ids)]
        last = completion_tokens - 1
        for i, (word, token, lp) in enumerate(zip(words, token_ids, logprobs, strict=True)):
            events.append(chunk([{
                "index": 0, "delta": {"content": word},
                "logprobs": {"content": [{"token": word, "logprob": lp, "bytes": list(word.encode()),
                                          "top_logprobs": []}]},
                "finish_reason": "stop" if i == last else None, "stop_reason": None, "token_ids": [token],
                **(versioned if i == last else {}),
            }]))
        usage_event = chunk([], usage=usage)
        done = b"data: [DONE]\n\n"
        self.stream = _chunked([*events, done])
        self.stream_usage = _chunked([*events, usage_event, done])
        self.models = _message(200, "application/json", orjson.dumps({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": created, "owned_by": "bench", "root": MODEL,
             "parent": None, "max_model_len": 32768}]}))
        self.health = _message(200, "application/json", b"{}")
        self.weight_info = _message(200, "application/json", orjson.dumps({"weight_version": version}))
        self.empty = _message(200, "application/json", b"{}")
        self.not_found = _message(404, "application/json", b'{"error":{"message":"not found"}}')
        self.bad_request = _message(400, "application/json", b'{"error":{"message":"bad request"}}')


def _message(status: int, content_type: str, body: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _chunked(events: Sequence[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class Stats:
    """Calls served, by kind."""

    def __init__(self) -> None:
        self.chat = 0
        self.streamed = 0


class Engine:
    """What the server is: its canned answers for the current version, and the RL endpoints' state."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, *, weight_versions: bool = False,
                 reload_s: float = 0.0) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.weight_versions = weight_versions
        self.reload_s = reload_s
        self.version = "0"
        self.canned = Canned(prompt_tokens, completion_tokens, self.version, weight_versions=weight_versions)
        self.stats = Stats()
        self.paused = False
        self.held: list[HttpProtocol] = []
        """Connections whose chat request waits for ``/resume``."""

    def set_version(self, label: str) -> None:
        """Serve ``label`` from now on (answers are encoded again, once)."""
        self.version = label
        self.canned = Canned(self.prompt_tokens, self.completion_tokens, label, weight_versions=self.weight_versions)

    def resume(self) -> None:
        """Answer every held chat request (with the version set meanwhile), then go on serving."""
        self.paused = False
        held, self.held = self.held, []
        for protocol in held:
            protocol.release()


class HttpProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order as they complete.

    A request the engine cannot answer yet (a chat request while paused, a reload that takes its
    time) holds the connection: nothing after it on the connection is read until it is answered,
    which keeps answers in request order.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self._held: tuple[str, str, bytes, bool] | None = None
        """(method, path, body, close) of the request being held."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and self._held is None:
            canned = self.engine.canned
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    self._close(canned.bad_request)
                return
            head = bytes(self.buffer[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                self._close(canned.bad_request)
                return
            method, target, _ = parts
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip() or 0)
                elif name == "connection":
                    close = value.strip().lower() == "close"
                elif name == "transfer-encoding":  # no client of this server sends chunked bodies
                    self._close(canned.bad_request)
                    return
            if length > _MAX_BODY:
                self._close(canned.bad_request)
                return
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4:total])
            del self.buffer[:total]
            path = target.split("?", 1)[0]
            if method == "POST" and path == "/v1/chat/completions" and self.engine.paused:
                self._held = (method, path, body, close)
                self.engine.held.append(self)
                return
            if method == "POST" and path == "/collective_rpc" and self.engine.reload_s > 0:
                self._held = (method, path, body, close)
                asyncio.get_running_loop().call_later(self.engine.reload_s, self.release)
                return
            self._send(self._answer(method, path, body), close)

    def release(self) -> None:
        """Answer the held request now, then read on."""
        if self._held is None:
            return
        method, path, body, close = self._held
        self._held = None
        if self.transport is None:
            return
        self._send(self._answer(method, path, body), close)
        self.data_received(b"")

    def _send(self, answer: bytes, close: bool) -> None:
        if close:
            self._close(answer)
        elif self.transport is not None:
            self.transport.write(answer)

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        engine = self.engine
        canned = engine.canned
        stats = engine.stats
        if method == "POST" and path == "/v1/chat/completions":
            try:
                request = orjson.loads(body)
            except orjson.JSONDecodeError:
                return canned.bad_request
            if not isinstance(request, dict):
                return canned.bad_request
            stats.chat += 1
            if request.get("stream"):
                stats.streamed += 1
                options = request.get("stream_options") or {}
                return canned.stream_usage if options.get("include_usage") else canned.stream
            return canned.whole
        if method == "GET":
            if path == "/v1/models":
                return canned.models
            if path in ("/health", "/ping"):
                return canned.health
            if path == "/weight_info":
                return canned.weight_info
            if path == "/stats":
                return _message(200, "application/json", orjson.dumps({"chat": stats.chat, "streamed": stats.streamed}))
        if method == "POST":
            if path == "/pause":
                engine.paused = True
                return canned.empty
            if path == "/resume":
                engine.resume()
                return canned.empty
            if path in ("/collective_rpc", "/reset_prefix_cache"):
                return canned.empty
            if path == "/update_weight_version":
                try:
                    label = orjson.loads(body).get("new_version")
                except (orjson.JSONDecodeError, AttributeError):
                    label = None
                if not isinstance(label, str) or not label:
                    return canned.bad_request
                engine.set_version(label)
                return engine.canned.empty
        return canned.not_found

    def _close(self, answer: bytes) -> None:
        if self.transport is not None:
            self.transport.write(answer)
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        with contextlib.suppress(ValueError):
            self.engine.held.remove(self)


async def serve(host: str, port: int, engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpProtocol(engine), host, port, backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fast upstream serving on http://{host}:{port}", file=sys.stderr, flush=True)
    async with server:
        await stop.wait()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fast_upstream", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument("--prompt-tokens", type=int, default=400,
                        help="length of prompt_token_ids in every answer (default 400)")
    parser.add_argument("--completion-tokens", type=int, default=32,
                        help="tokens (and stream chunks) of every answer (default 32)")
    parser.add_argument("--weight-versions", action="store_true",
                        help="say in every answer which weight version sampled it (choices[].weight_versions)")
    parser.add_argument("--reload-s", type=float, default=0.0,
                        help="seconds a reload_weights call takes to answer (default 0)")
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.completion_tokens < 1:
        parser.error("token counts must be positive")
    if args.reload_s < 0:
        parser.error("--reload-s must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    engine = Engine(args.prompt_tokens, args.completion_tokens, weight_versions=args.weight_versions,
                    reload_s=args.reload_s)
    runner: Any = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    runner(serve(args.host, args.port, engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
