"""The proxy's HTTP client to the engines, over real sockets.

Well-behaved answers come from a real uvicorn server (what vLLM serves with). Misbehaving
engines (a kept-alive connection closed as a request crosses it, a reset mid-answer, bytes
that are not HTTP, an engine that never answers) cannot be had from a real engine on demand:
those tests talk to a scripted socket server, and their names say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import uvicorn
from inloop_server import InLoopServer

from proxy.engine_client import IDLE, EngineClient, EngineError, EngineTimeoutError, EngineUnreachableError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """A small ASGI app under a real uvicorn server: whole answers, streams, and what it saw."""

    def __init__(self) -> None:
        self.clients: list[tuple[str, int]] = []  # the client address of each request: one port per connection
        self.disconnected = asyncio.Event()
        self.release_stream = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        self.clients.append(tuple(scope["client"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: one\r\n\r\n", "more_body": True})
            await self.release_stream.wait()
            for k in range(3):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % k, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        if scope["path"] == "/late-end":  # the body's end written apart from its last event, as uvicorn does
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: one\n\ndata: [DONE]\n\n", "more_body": True})
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["path"] == "/hang-stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
            return
        status = 404 if scope["path"] == "/missing" else 200
        answer = orjson.dumps({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                               "echo": body.decode()})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    app = Engine()
    port = _free_port()
    server = InLoopServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=30, lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engine_client = EngineClient(timeout_s=10.0, connect_timeout_s=2.0)
    try:
        yield engine_client
    finally:
        await engine_client.aclose()


async def test_whole_answers_reuse_one_kept_alive_connection(engine: tuple[Engine, str],
                                                             client: EngineClient) -> None:
    app, url = engine
    for k in range(5):
        status, answer = await client.post_json(f"{url}/v1/chat/completions?x={k}", b'{"n": %d}' % k, timeout_s=5)
        assert status == 200
        assert orjson.loads(answer) == {"method": "POST", "path": "/v1/chat/completions", "query": f"x={k}",
                                        "echo": f'{{"n": {k}}}'}
    status, info = await client.get_json(f"{url}/health", timeout_s=5)
    assert (status, info["method"], info["echo"]) == (200, "GET", "")
    assert len(set(app.clients)) == 1, app.clients
    assert client.connections == 1


async def test_an_error_status_is_an_answer_not_a_transport_error(engine: tuple[Engine, str],
                                                                  client: EngineClient) -> None:
    _app, url = engine
    response = await client.post(f"{url}/missing", b"{}")
    assert response.status == 404
    assert orjson.loads(await response.read())["path"] == "/missing"
    response.close(finished=True)


async def test_an_error_answer_read_and_closed_leaves_its_connection_for_the_next_call(
        engine: tuple[Engine, str], client: EngineClient) -> None:
    app, url = engine
    response = await client.post(f"{url}/missing", b"{}")
    assert response.status == 404
    assert orjson.loads(await response.read_and_close())["path"] == "/missing"
    assert client.connections == 1
    assert (await client.post_json(f"{url}/after", b"{}", timeout_s=5))[0] == 200
    assert len(set(app.clients)) == 1, app.clients


async def test_concurrent_calls_get_connections_of_their_own(engine: tuple[Engine, str],
                                                             client: EngineClient) -> None:
    app, url = engine
    answers = await asyncio.gather(*(client.post_json(f"{url}/c", b'"%d"' % k, timeout_s=5) for k in range(8)))
    assert sorted(orjson.loads(body)["echo"] for _status, body in answers) == [f'"{k}"' for k in range(8)]
    assert client.connections == len(set(app.clients)) >= 2


async def test_a_stream_is_read_line_by_line_as_it_arrives(engine: tuple[Engine, str],
                                                           client: EngineClient) -> None:
    app, url = engine
    response = await client.post(f"{url}/stream", b"{}")
    lines = response.lines()
    # The first event is readable while the engine still holds the rest back: nothing is buffered.
    assert await asyncio.wait_for(anext(lines), 5) == b"data: one"
    assert await anext(lines) == b""
    app.release_stream.set()
    rest = [line async for line in lines]
    assert rest == [b"data: 0", b"", b"data: 1", b"", b"data: 2", b"", b"data: [DONE]", b""]
    response.close(finished=True)
    # The connection went back to the pool and serves the next call.
    status, _ = await client.post_json(f"{url}/after", b"{}", timeout_s=5)
    assert status == 200
    assert len(set(app.clients)) == 1


async def test_a_stream_read_to_its_last_event_keeps_its_connection_when_the_body_ends_late(
        engine: tuple[Engine, str], client: EngineClient) -> None:
    # The caller stops at [DONE]; the chunked body's end comes in a later read. Cut at once, the
    # connection was lost to nearly every stream (a new one per call, an abort at the engine).
    app, url = engine
    for _ in range(3):
        response = await client.post(f"{url}/late-end", b"{}")
        async for line in response.lines():
            if line == b"data: [DONE]":
                break
        response.close(finished=True)
        for _ in range(100):  # its end arrives 50 ms later
            if sum(map(len, client._idle.values())) == 1:  # back in the pool
                break
            await asyncio.sleep(0.01)
    status, _ = await client.post_json(f"{url}/after", b"{}", timeout_s=5)
    assert status == 200
    assert len(set(app.clients)) == 1, app.clients


async def test_cutting_a_stream_tells_the_engine_the_caller_left(engine: tuple[Engine, str],
                                                                 client: EngineClient) -> None:
    app, url = engine
    response = await client.post(f"{url}/hang-stream", b"{}")
    assert await anext(response.lines()) == b"data: one"
    response.close(finished=False)
    response.close(finished=False)  # idempotent
    await asyncio.wait_for(app.disconnected.wait(), 5)
    assert client.connections == 0


async def test_a_refused_connection_is_unreachable(client: EngineClient) -> None:
    with pytest.raises(EngineUnreachableError, match="127.0.0.1"):
        await client.post(f"http://127.0.0.1:{_free_port()}/v1/chat/completions", b"{}")
    with pytest.raises(EngineUnreachableError, match="not an http"):
        await client.post("ftp://127.0.0.1/x", b"{}")


async def test_a_closed_client_refuses_calls(engine: tuple[Engine, str]) -> None:
    _app, url = engine
    closed = EngineClient(timeout_s=5)
    assert (await closed.post_json(f"{url}/x", b"{}", timeout_s=5))[0] == 200
    await closed.aclose()
    await closed.aclose()
    assert closed.connections == 0
    with pytest.raises(EngineUnreachableError, match="closed"):
        await closed.post(f"{url}/x", b"{}")


# --- misbehaving engines: a scripted socket server -------------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted_server(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server running ``script(reader, writer, connection_number)`` per connection."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            await script(reader, writer, len(connections) - 1)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_scripted_server_closing_a_kept_alive_connection_under_a_request_is_sent_again(
        client: EngineClient) -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        seen.append(await _read_request(reader))
        writer.write(_answer(b'{"n": 1}'))
        await writer.drain()
        if number == 0:
            # The next request arrives, and the connection closes without a byte of answer.
            seen.append(await _read_request(reader))
            return
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:
                seen.append(await _read_request(reader))
                writer.write(_answer(b'{"n": 2}'))
                await writer.drain()

    async with scripted_server(script) as (url, connections):
        assert await client.post_json(f"{url}/a", b"{}", timeout_s=5) == (200, b'{"n": 1}')
        assert await client.post_json(f"{url}/b", b'{"second": true}', timeout_s=5) == (200, b'{"n": 1}')
        assert len(connections) == 2
        # Sent twice: once on the stale connection, once on the new one.
        assert [request.endswith(b'{"second": true}') for request in seen] == [False, True, True]


async def test_scripted_server_closing_a_new_connection_before_answering_is_unreachable(
        client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)

    async with scripted_server(script) as (url, connections):
        with pytest.raises(EngineUnreachableError, match="before answering"):
            await client.post(f"{url}/a", b"{}")
        assert len(connections) == 1  # a new connection is not tried again


async def test_scripted_server_breaking_off_mid_answer_is_an_engine_error(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\":")
        await writer.drain()

    async with scripted_server(script) as (url, _connections):
        response = await client.post(f"{url}/a", b"{}")
        assert response.status == 200
        with pytest.raises(EngineError, match="mid-answer"):
            await response.read()
        response.close(finished=False)
        assert client.connections == 0


async def test_scripted_server_sending_what_is_not_http_is_an_engine_error(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with scripted_server(script) as (url, _connections):
        with pytest.raises(EngineError, match="malformed engine answer"):
            await client.post(f"{url}/a", b"{}")


async def test_scripted_server_that_never_answers_times_out_at_the_deadline(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        if number == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
        await asyncio.sleep(5)

    async with scripted_server(script) as (url, _connections):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(EngineTimeoutError, match="0.3 s"):
            await client.post(f"{url}/a", b"{}", timeout_s=0.3)
        assert 0.25 < loop.time() - started < 2.0
        # The deadline covers the whole answer, not only its headers.
        response = await client.post(f"{url}/a", b"{}", timeout_s=0.3)
        with pytest.raises(EngineTimeoutError):
            await response.read()
        response.close(finished=False)


async def test_scripted_server_a_body_that_ends_with_the_connection_is_read_whole(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 70_000)
        await writer.drain()

    async with scripted_server(script) as (url, connections):
        for _ in range(2):
            assert await client.post_json(f"{url}/a", b"{}", timeout_s=5) == (200, b"x" * 70_000)
        assert len(connections) == 2  # "Connection: close" is honoured: not kept for reuse


async def test_scripted_server_a_stream_nobody_reads_stops_being_read_from_the_socket(client: EngineClient) -> None:
    total = 128 << 20
    written = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        nonlocal written
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        line = b"x" * 1023 + b"\n"
        chunk = line * 64
        while written < total:
            writer.write(chunk)
            written += len(chunk)
            await writer.drain()

    async with scripted_server(script) as (url, _connections):
        response = await client.post(f"{url}/a", b"{}")
        lines = response.lines()
        assert len(await anext(lines)) == 1023
        await asyncio.sleep(1.0)
        # The engine is held back by the proxy not reading (socket buffers are a few MiB), not
        # allowed to fill the proxy's memory with an answer nobody consumes yet.
        assert written < total // 4
        count = 1 + sum([1 async for _ in lines])
        assert count == total // 1024
        response.close(finished=True)


async def test_closing_the_client_fails_calls_in_flight_at_once(engine: tuple[Engine, str]) -> None:
    app, url = engine
    closing = EngineClient(timeout_s=30)
    response = await closing.post(f"{url}/hang-stream", b"{}")
    lines = response.lines()
    assert [await anext(lines), await anext(lines)] == [b"data: one", b""]
    waiting = asyncio.ensure_future(anext(lines))
    await asyncio.sleep(0.05)
    await closing.aclose()
    with pytest.raises(EngineUnreachableError, match="closed by the proxy"):
        await asyncio.wait_for(waiting, 2)
    await asyncio.wait_for(app.disconnected.wait(), 5)


async def test_an_answer_dropped_without_close_cuts_its_connection(engine: tuple[Engine, str],
                                                                   client: EngineClient) -> None:
    app, url = engine
    response = await client.post(f"{url}/hang-stream", b"{}")
    assert client.connections == 1
    del response  # the caller was cancelled before it could read or close
    await asyncio.wait_for(app.disconnected.wait(), 5)
    assert client.connections == 0


async def test_a_cancelled_read_cuts_the_connection(engine: tuple[Engine, str], client: EngineClient) -> None:
    app, url = engine
    response = await client.post(f"{url}/hang-stream", b"{}")
    reading = asyncio.ensure_future(response.read())
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    response.close(finished=False)  # what the proxy's call service does in its finally
    await asyncio.wait_for(app.disconnected.wait(), 5)


async def test_calls_beyond_the_in_flight_bound_wait_for_a_free_slot(engine: tuple[Engine, str]) -> None:
    app, url = engine
    bounded = EngineClient(timeout_s=10, max_in_flight=2)
    try:
        first = await bounded.post(f"{url}/stream", b"{}")
        second = await bounded.post(f"{url}/stream", b"{}")
        third = asyncio.ensure_future(bounded.post_json(f"{url}/x", b"{}", timeout_s=5))
        await asyncio.sleep(0.2)
        assert not third.done() and bounded.connections == 2
        first.close(finished=False)
        assert (await asyncio.wait_for(third, 5))[0] == 200
        app.release_stream.set()
        assert [line async for line in second.lines()][-2:] == [b"data: [DONE]", b""]
        second.close(finished=True)
    finally:
        app.release_stream.set()  # a failed check must not leave the engine's handlers waiting
        await bounded.aclose()


async def test_with_every_slot_taken_health_reads_still_answer_and_calls_wait_only_their_deadline(
        engine: tuple[Engine, str]) -> None:
    """A proxy full of long streams must still answer its readiness probe (which reads the
    engine's health) and follow weight versions; a model call waits for a slot within its
    deadline, not for ever."""
    app, url = engine
    bounded = EngineClient(timeout_s=10, max_in_flight=2)
    try:
        streams = [await bounded.post(f"{url}/stream", b"{}") for _ in range(2)]
        status, _ = await asyncio.wait_for(bounded.get_json(f"{url}/health", timeout_s=2), 1)
        assert status == 200
        started = time.monotonic()
        with pytest.raises(EngineTimeoutError, match="every slot is taken"):
            await bounded.post_json(f"{url}/x", b"{}", timeout_s=0.5)
        assert time.monotonic() - started < 2
        for stream in streams:
            stream.close(finished=False)
        assert (await bounded.post_json(f"{url}/x", b"{}", timeout_s=5))[0] == 200  # the slots came back
    finally:
        app.release_stream.set()
        await bounded.aclose()


async def test_a_short_deadline_does_not_outlive_its_exchange(engine: tuple[Engine, str],
                                                              client: EngineClient) -> None:
    _app, url = engine
    assert (await client.post_json(f"{url}/a", b"{}", timeout_s=0.2))[0] == 200
    await asyncio.sleep(0.3)  # past the first call's deadline, on the same kept-alive connection
    assert (await client.post_json(f"{url}/b", b"{}", timeout_s=5))[0] == 200
    assert client.connections == 1


async def test_a_bad_port_is_unreachable(client: EngineClient) -> None:
    with pytest.raises(EngineUnreachableError, match="(?i)port"):
        await client.post("http://127.0.0.1:99999/x", b"{}")


async def test_scripted_server_a_continue_before_the_answer_is_skipped(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_answer(b'{"after": "continue"}'))
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            await _read_request(reader)
            writer.write(_answer(b'{"second": 1}'))
            await writer.drain()

    async with scripted_server(script) as (url, connections):
        assert await client.post_json(f"{url}/a", b"{}", timeout_s=5) == (200, b'{"after": "continue"}')
        assert await client.post_json(f"{url}/a", b"{}", timeout_s=5) == (200, b'{"second": 1}')
        assert len(connections) == 1


async def test_scripted_server_a_close_long_after_the_request_is_reported_not_resent(
        client: EngineClient) -> None:
    requests = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        nonlocal requests
        await _read_request(reader)
        requests += 1
        writer.write(_answer(b"{}"))
        await writer.drain()
        await _read_request(reader)
        requests += 1
        await asyncio.sleep(1.3)  # the engine worked on it, then went away without a byte

    async with scripted_server(script) as (url, connections):
        assert (await client.post_json(f"{url}/a", b"{}", timeout_s=5))[0] == 200
        with pytest.raises(EngineUnreachableError, match="before answering") as raised:
            await client.post(f"{url}/a", b"{}")
        assert type(raised.value) is EngineUnreachableError
        assert (requests, len(connections)) == (2, 1)


async def test_scripted_server_a_reset_cuts_a_body_that_ends_with_the_connection(client: EngineClient) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset

    async with scripted_server(script) as (url, _connections):
        response = await client.post(f"{url}/a", b"{}")
        with pytest.raises(EngineError, match="mid-answer"):
            await response.read()
        response.close(finished=False)


async def test_a_replica_that_takes_no_connection_is_unreachable_not_slow() -> None:
    """A listener whose backlog is full drops new SYNs, as a replica gone from the network does:
    the connect deadline passes, and that is unreachability (the proxy may try another replica)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(4):  # fill the accept queue; nobody accepts
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            queued.append(filler)
        client = EngineClient(timeout_s=30, connect_timeout_s=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(EngineUnreachableError, match="no connection within"):
                await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}")
            assert time.monotonic() - started < 5
            # A call whose own deadline ends first timed out; that says nothing about the replica.
            with pytest.raises(EngineTimeoutError, match="deadline passed while connecting") as caught:
                await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", timeout_s=0.2)
            assert not isinstance(caught.value, EngineUnreachableError)
        finally:
            await client.aclose()
    finally:
        for filler in queued:
            filler.close()
        listener.close()


async def test_a_long_stream_line_in_many_reads_is_whole_and_an_endless_one_is_refused(
        client: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first chunk carries the prompt's token ids: one line of megabytes, arriving in many reads."""
    monkeypatch.setattr("proxy.engine_client._MAX_LINE_BYTES", 1 << 20)
    long_line = b"data: " + b"7," * 200_000  # 400 KB, under the limit

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        request = await _read_request(reader)
        body = long_line if b"/fits" in request else b"data: " + b"9" * (2 << 20)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for start in range(0, len(body), 4096):  # many small writes: many reads on the other side
            writer.write(body[start:start + 4096])
            await writer.drain()
        writer.write(b"\n\ndata: [DONE]\n\n")
        await writer.drain()
        writer.close()

    async with scripted_server(script) as (url, _connections):
        response = await client.post(f"{url}/fits", b"{}")
        lines = [line async for line in response.lines()]
        response.close(finished=True)
        assert lines[0] == long_line and lines[-2:] == [b"data: [DONE]", b""]
        endless = await client.post(f"{url}/endless", b"{}")
        with pytest.raises(EngineError, match="stream line over"):
            _ = [line async for line in endless.lines()]
        endless.close(finished=False)


async def test_scripted_server_a_silent_stream_gives_idle_marks_only_while_silent(client: EngineClient) -> None:
    # An engine that goes quiet mid-stream (a pause for new weights): the reader is told, so its
    # harness can be sent a keep-alive, and the lines themselves come as they were.
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event, pause in ((b"data: one\n\n", 0.7), (b"data: two\n\n", 0.0)):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(pause)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with scripted_server(script) as (url, _connections):
        response = await client.post(f"{url}/a", b"{}")
        seen = [line async for line in response.lines(idle_s=0.1)]
        response.close(finished=True)
        marks = [line for line in seen if line is IDLE]
        assert [line for line in seen if line is not IDLE] == [b"data: one", b"", b"data: two", b""]
        # Silent 0.7 s, told within 0.1 to 0.2 s of silence and every 0.1 s after: three to six marks.
        assert 3 <= len(marks) <= 7, seen
        assert seen.index(IDLE) > seen.index(b"data: one") and seen[-1] is not IDLE
        assert response._ticker is not None and response._ticker._handle is None  # stopped with the stream
        again = await client.post(f"{url}/a", b"{}")
        assert IDLE not in [line async for line in again.lines()]  # asked for lines only
        again.close(finished=True)
