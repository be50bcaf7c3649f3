"""A minimal, fast stand-in for a vLLM server on loopback, for proxy benchmarks.

Run with ``python -m bench.fast_upstream --port 8000`` (``bench.proxy`` starts it in its own process).

It honours the parts of vLLM's chat-completions contract that a capturing proxy relies on:

* ``POST /v1/chat/completions``, whole answer: top-level ``prompt_token_ids``, ``choices[0].token_ids``,
  ``choices[0].logprobs.content[j].logprob`` and ``usage``;
* the same with ``"stream": true``: server-sent events over chunked transfer encoding, the first chunk
  carrying the role and the top-level ``prompt_token_ids``, then one chunk per token with its
  ``token_ids`` and ``logprobs`` (``finish_reason`` on the last), a usage-only chunk (``choices: []``)
  when ``stream_options.include_usage`` is set, and ``data: [DONE]``;
* ``GET /v1/models``, ``GET /health``, ``GET /weight_info`` (a constant weight version), and
  ``GET /stats`` (chat calls served so far, for checks).

Every answer is the same canned completion, encoded once at startup: per request the server only
parses the HTTP head, reads the JSON body (to see ``stream`` and ``stream_options``) and writes a
precomputed byte string. It is a bare :class:`asyncio.Protocol` (uvloop when installed), HTTP/1.1 with
keep-alive, so that a proxy in front of it is measured, not this server.
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

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
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
                "finish_reason": "stop", "stop_reason": None, "token_ids": token_ids,
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
            }]))
        usage_event = chunk([], usage=usage)
        done = b"data: [DONE]\n\n"
        self.stream = _chunked([*events, done])
        self.stream_usage = _chunked([*events, usage_event, done])
        self.models = _message(200, "application/json", orjson.dumps({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": created, "owned_by": "bench", "root": MODEL,
             "parent": None, "max_model_len": 32768}]}))
        self.health = _message(200, "application/json", b"{}")
        self.weight_info = _message(200, "application/json", b'{"weight_version":"0"}')
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


class HttpProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order as they complete."""

    def __init__(self, canned: Canned, stats: Stats) -> None:
        self.canned = canned
        self.stats = stats
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    self._close(self.canned.bad_request)
                return
            head = bytes(self.buffer[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                self._close(self.canned.bad_request)
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
                    self._close(self.canned.bad_request)
                    return
            if length > _MAX_BODY:
                self._close(self.canned.bad_request)
                return
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4:total])
            del self.buffer[:total]
            answer = self._answer(method, target.split("?", 1)[0], body)
            if close:
                self._close(answer)
                return
            self.transport.write(answer)

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        canned = self.canned
        if method == "POST" and path == "/v1/chat/completions":
            try:
                request = orjson.loads(body)
            except orjson.JSONDecodeError:
                return canned.bad_request
            if not isinstance(request, dict):
                return canned.bad_request
            self.stats.chat += 1
            if request.get("stream"):
                self.stats.streamed += 1
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
                return _message(200, "application/json", orjson.dumps(
                    {"chat": self.stats.chat, "streamed": self.stats.streamed}))
        return canned.not_found

    def _close(self, answer: bytes) -> None:
        if self.transport is not None:
            self.transport.write(answer)
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(host: str, port: int, canned: Canned) -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    server = await loop.create_server(lambda: HttpProtocol(canned, stats), host, port, backlog=1024,
                                      reuse_address=True)
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
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.completion_tokens < 1:
        parser.error("token counts must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    canned = Canned(args.prompt_tokens, args.completion_tokens)
    runner: Any = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    runner(serve(args.host, args.port, canned))
    return 0


if __name__ == "__main__":
    sys.exit(main())
