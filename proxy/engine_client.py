"""HTTP to the engines: a small HTTP/1.1 client on asyncio and httptools, with long-lived connections.

The proxy spends much of its own CPU on the client side of each engine call. aiohttp cost
about a fifth of the capture-off proxy's CPU per call (py-spy, ``bench/proxy.py`` at
concurrency 1), most of it in generality the proxy never uses: cookies, redirects, auth,
multipart, header multidicts, per-request timer objects. This client does only what the proxy
needs: send one request with a JSON body over a kept-alive connection to one of a few engine
URLs, read the answer whole or as it streams, and cut the connection when the caller goes
away (vLLM aborts a request whose connection closes). httptools (llhttp) parses the answers:
the same parser uvicorn serves the proxy's own requests with.

The interface is what the proxy needs and no more, with its own errors, so the call pipeline
does not depend on how the bytes travel.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson

# A streamed body stops reading from the socket once this much is read but not yet consumed,
# so a slow harness cannot make the proxy buffer an engine's whole answer.
_HIGH_WATER = 1 << 20

# A kept-alive connection that closes this soon after a request, before any answer, was closed by
# the server while idle (the close crossed the request). Later, the engine may have been working
# on it (a crash, a reset mid-generation): that is reported, not silently sent again.
_STALE_WINDOW_S = 1.0

# How long a stream read to its last event waits for its body's end before its connection is cut.
_SETTLE_S = 1.0

# Longest stream line taken: a first chunk carries the prompt's token ids, some 7 bytes per
# token, so this is far above any context; beyond it the engine is not sending SSE.
_MAX_LINE_BYTES = 64 * 1024 * 1024


IDLE_REUSE_S = 4.0
"""How long an idle engine connection is reused: less than the engine keeps it (vLLM's uvicorn
closes idle connections after 5 s). A live engine has closed an older one itself, so one still
open points at a peer that is gone without a word (a node whose packets vanish): a call sent on
it would wait out the whole upstream timeout, while a new connection fails within the connect
deadline and the call moves to another replica. Under load connections never sit this long."""

# TCP keepalive on engine connections: a whole answer keeps its connection silent for as long as
# the engine generates, so silence says nothing, but a peer whose kernel no longer answers probes
# is gone (a node lost, its packets dropped). Found within about a minute, instead of when the
# call's whole timeout (600 s by default) runs out; the call then fails over like any lost one.
_KEEPALIVE_IDLE_S = 30
_KEEPALIVE_INTERVAL_S = 10
_KEEPALIVE_PROBES = 3
# Keepalive probes only while nothing is unacknowledged; a request sent to a vanished peer is
# retransmitted instead, for some 15 minutes of the kernel's retries. Linux's TCP_USER_TIMEOUT
# bounds how long sent data may stay unacknowledged: the same minute (it then also governs the
# probes, so it must not be shorter than they take).
_UNACKED_TIMEOUT_MS = (_KEEPALIVE_IDLE_S + _KEEPALIVE_INTERVAL_S * _KEEPALIVE_PROBES) * 1000

_KEEPALIVE_OPTIONS = [(level, option, value) for level, option, value in (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    # macOS names the idle time TCP_KEEPALIVE; an option a platform lacks is left out.
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None)), _KEEPALIVE_IDLE_S),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), _KEEPALIVE_INTERVAL_S),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), _KEEPALIVE_PROBES),
    (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), _UNACKED_TIMEOUT_MS),
) if option is not None]


def _watch_peer(sock: socket.socket) -> None:
    """Turn on TCP keepalive probes of ``sock``'s peer and bound unacknowledged sends (see above)."""
    for level, option, value in _KEEPALIVE_OPTIONS:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class EngineError(Exception):
    """The exchange with an engine failed at the transport level."""


class EngineUnreachableError(EngineError):
    """No connection could be made (refused, reset before answering, DNS)."""


class EngineTimeoutError(EngineError):
    """The engine did not answer in time."""


class EngineConnectTimeoutError(EngineUnreachableError):
    """No connection within the connect deadline (a replica gone, its packets dropped).

    Unreachable, not slow: nothing was sent, so the call may go to another replica at once,
    and this one is skipped for a while (``UpstreamPool.down_for_s``) before it is tried again.
    """


class _StaleConnectionError(EngineUnreachableError):
    """A kept-alive connection closed before the engine sent a byte of its answer.

    Servers close idle connections on their own schedule (uvicorn after 5 s by default), and
    the close can cross a request on the wire. The engine never read that request, so it is
    sent once more on a new connection.
    """


class _Target:
    """What one URL resolves to: where to connect and the request line's pieces."""

    __slots__ = ("head", "host", "key", "path", "port", "server_hostname", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EngineUnreachableError(f"{url}: not an http(s) URL")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        try:
            self.port = parts.port or (443 if self.tls else 80)
        except ValueError as exc:
            raise EngineUnreachableError(f"{url}: {exc}") from exc
        self.server_hostname = self.host if self.tls else None
        self.key = (parts.scheme, self.host, self.port)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        self.path = path.encode("ascii")
        netloc = parts.netloc.rpartition("@")[2]  # never send credentials in the Host header
        self.head = b"Host: " + netloc.encode("idna") + b"\r\n"


class _Connection(asyncio.Protocol):
    """One kept-alive connection and the answer now arriving on it (one request at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str, int]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False
        self.used = False  # has answered a request: a close before the next answer may be stale
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.on_lost: Any = None
        self.on_complete: Any = None  # called (soon) when the answer in flight ends; see EngineResponse.close
        self.sent_at = 0.0
        self.bodies = 0  # body parts received, over every exchange (the idle ticker's measure)
        self.exchange = 0  # exchanges sent on this connection
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.length_known = False
        self.received = False
        self.streaming = False
        self.paused = False
        self.informational = False
        self.error: EngineError | None = None

    # --- one exchange ------------------------------------------------------------------------------

    def send(self, request: bytes, deadline: float, timeout_s: float) -> None:
        """Write a request and arm the deadline that covers its whole answer."""
        self._reset()
        self.busy = True
        self.exchange += 1
        self.sent_at = self.loop.time()
        self.timer = self.loop.call_at(deadline, self._time_out, timeout_s)
        assert self.transport is not None
        self.transport.write(request)

    async def wait(self) -> None:
        """Until the parser or the socket has news."""
        waiter = self.loop.create_future()
        self.waiter = waiter
        try:
            await waiter
        finally:
            self.waiter = None

    async def wait_headers(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self.wait()

    def take(self) -> bytes:
        """The body read so far and not yet taken; resumes a paused socket."""
        if not self.chunks:
            return b""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def finish(self) -> None:
        """The exchange is over: disarm its deadline."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.busy = False

    def abort(self) -> None:
        """Cut the connection; an exchange still waiting on it fails instead of waiting forever."""
        if self.busy and not self.complete and self.error is None:
            self.error = EngineUnreachableError("the connection to the engine was closed by the proxy")
        self.finish()
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: EngineError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _time_out(self, timeout_s: float) -> None:
        self.timer = None
        self._fail(EngineTimeoutError(f"no complete answer within {timeout_s:g} s"))

    # --- asyncio.Protocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection cannot be trusted any more
            self._fail(EngineError("engine sent bytes on an idle connection"))
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineError(f"malformed engine answer: {exc}"))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy and not self.complete and self.error is None:
            if self.headers_done and not self.length_known and exc is None:
                self.complete = True  # a body without length or chunks ends where the connection does
            elif not self.received and self.used and self.loop.time() - self.sent_at < _STALE_WINDOW_S:
                self.error = _StaleConnectionError("engine closed a kept-alive connection before answering")
            elif not self.headers_done:
                self.error = EngineUnreachableError(f"engine closed the connection before answering ({exc!r})")
            else:
                self.error = EngineError(f"engine closed the connection mid-answer ({exc!r})")
        if self.on_lost is not None:
            self.on_lost(self)
        self._wake()

    # --- httptools callbacks ---------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.length_known = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # "100 Continue" and the like come before the answer: skip them
            self.informational = True
            return
        self.status = status
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.bodies += 1
        self.chunks.append(body)
        self.buffered += len(body)
        if self.streaming and not self.paused and self.buffered > _HIGH_WATER and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        if self.on_complete is not None:
            settle, self.on_complete = self.on_complete, None
            self.loop.call_soon(settle, self)  # once the parser has returned


IDLE = b"[idle]"
"""What :meth:`EngineResponse.lines` yields, in place of a line, when the engine has been silent
for its ``idle_s`` (told apart by identity: ``line is IDLE``; no line read is this object)."""


class _IdleTicker:
    """Wakes a stream's reader when its engine has sent nothing for a while.

    One timer per stream, run again every ``idle_s``, rather than a deadline armed around every
    read: a stream of many small chunks pays only a counter per chunk. A silence is therefore
    noticed after between one and two ``idle_s``.
    """

    __slots__ = ("_conn", "_exchange", "_handle", "_seen", "fired", "idle_s")

    def __init__(self, conn: _Connection, idle_s: float) -> None:
        self._conn = conn
        self._exchange = conn.exchange
        self.idle_s = idle_s
        self.fired = False
        self._seen = conn.bodies
        self._handle: asyncio.TimerHandle | None = conn.loop.call_later(idle_s, self._tick)

    def _tick(self) -> None:
        conn = self._conn
        if conn.exchange != self._exchange or conn.complete or conn.error is not None or conn.closed:
            self._handle = None  # this stream is over; nothing to wake
            return
        if conn.bodies == self._seen:
            self.fired = True
            conn._wake()
        self._seen = conn.bodies
        self._handle = conn.loop.call_later(self.idle_s, self._tick)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class EngineAnswer(abc.ABC):
    """An answer from an engine: its status, and a body to read whole or to leave, then closed."""

    __slots__ = ()

    status: int

    @abc.abstractmethod
    async def read(self) -> bytes:
        """The whole body.

        Raises:
            EngineError: the body could not be read whole.
        """

    @abc.abstractmethod
    def close(self, *, finished: bool) -> None:
        """Give back what the answer holds: kept for reuse when ``finished``, otherwise cut."""

    async def read_and_close(self) -> bytes:
        """The whole body, then the answer closed: its connection kept when it was read whole, else cut.

        For an answer wanted whole and nothing else (an error status, a health or metadata call),
        so that no caller can forget the close, nor cut a connection fit for reuse.

        Raises:
            EngineError: the body could not be read whole (the connection is cut).
        """
        finished = False
        try:
            body = await self.read()
            finished = True
        finally:
            self.close(finished=finished)
        return body


class EngineResponse(EngineAnswer):
    """One engine answer, read whole or line by line."""

    __slots__ = ("_client", "_conn", "_done", "_slotted", "_ticker", "status")

    def __init__(self, client: EngineClient, conn: _Connection, slotted: bool = True) -> None:
        self._client = client
        self._conn = conn
        self._done = False
        self._slotted = slotted  # holds one of the client's in-flight slots until closed
        self._ticker: _IdleTicker | None = None
        self.status = conn.status

    def __del__(self) -> None:
        # An answer dropped without close() (its caller cancelled before it got to it) must not
        # keep the engine generating for nobody until the deadline.
        if not self._done:
            self._done = True
            self._conn.abort()
            if self._slotted:
                self._client._slots_release()

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            EngineError: the connection broke or timed out while reading.
        """
        conn = self._conn
        while True:
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return conn.take()
            await conn.wait()

    async def lines(self, *, idle_s: float | None = None) -> AsyncIterator[bytes]:
        """Lines of a streamed (SSE) body, without their line ends, as they arrive.

        Args:
            idle_s: when the engine sends nothing for this long (noticed within twice that),
                :data:`IDLE` comes instead of a line, and again while the silence lasts: for a
                caller that must tell its own client it is still there. None: lines only.

        Raises:
            EngineError: the connection broke or timed out mid-stream.
        """
        conn = self._conn
        conn.streaming = True
        ticker = None
        if idle_s is not None:
            ticker = self._ticker = _IdleTicker(conn, idle_s)
        parts: list[bytes] = []  # of a line still waiting for its end: joined once, not copied per read
        size = 0
        while True:
            data = conn.take()
            if data:
                if b"\n" not in data:
                    parts.append(data)
                    size += len(data)
                    if size > _MAX_LINE_BYTES:
                        raise EngineError(f"the engine sent a stream line over {_MAX_LINE_BYTES:,} bytes")
                    continue
                if parts:
                    parts.append(data)
                    data = b"".join(parts)
                    parts, size = [], 0
                *complete, rest = data.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
                if rest:
                    parts, size = [rest], len(rest)
                continue
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                break
            await conn.wait()
            if ticker is not None and ticker.fired:
                ticker.fired = False
                yield IDLE
        if parts:
            yield b"".join(parts).rstrip(b"\r")

    def close(self, *, finished: bool) -> None:
        """Give the connection back when the body was read; otherwise cut it.

        Cutting is how an engine learns that the caller went away: vLLM aborts the
        request when its connection closes. Idempotent.
        """
        if self._done:
            return
        self._done = True
        if self._ticker is not None:
            self._ticker.cancel()
        conn = self._conn
        if finished and conn.complete and conn.error is None and conn.keep_alive and not conn.closed:
            self._client._release(conn)
        elif finished and conn.streaming and conn.error is None and not conn.closed and not conn.paused:
            # A stream read to its last event ([DONE]) whose body has not ended yet: the server
            # writes the chunked body's end apart from the last event, and the two often come in
            # separate reads. Cut now, nearly every stream would cost a new connection (and the
            # engine an abort); the connection is kept once its end arrives, shortly.
            conn.take()
            if conn.timer is not None:
                conn.timer.cancel()
            conn.timer = conn.loop.call_later(_SETTLE_S, conn.abort)
            conn.on_complete = self._client._settled
        else:
            conn.abort()
        if self._slotted:
            self._client._slots_release()


class EngineClient:
    """Kept-alive connections to the engines, shared by all engine calls of a process.

    Args:
        timeout_s: the default deadline for a whole exchange, from sending the request to the
            answer's last byte (streams included).
        connect_timeout_s: the deadline for opening a connection.
        keepalive_s: idle connections older than this are closed instead of reused.
        max_idle: idle connections kept per engine; more are closed when given back.
        max_in_flight: exchanges at once over all engines; more wait for one to end, rather
            than open sockets until the process runs out of file descriptors (and takes a
            healthy engine for unreachable).
    """

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 5.0, keepalive_s: float = IDLE_REUSE_S,
                 max_idle: int = 1024, max_in_flight: int = 1024) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._slots = asyncio.Semaphore(max_in_flight)
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._live: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        """Open connections, idle or busy."""
        return len(self._live)

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # URLs come from configuration; this only bounds a surprise
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def _connect(self, target: _Target, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop, target.key)
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        timeout_s = min(self.connect_timeout_s, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout_s):
                await loop.create_connection(lambda: conn, target.host, target.port, ssl=tls,
                                             server_hostname=target.server_hostname)
        except TimeoutError as exc:
            if timeout_s < self.connect_timeout_s:  # the call's own deadline ran out, not the replica
                raise EngineTimeoutError(f"{target.host}:{target.port}: the call's deadline passed while "
                                         "connecting") from exc
            raise EngineConnectTimeoutError(
                f"{target.host}:{target.port}: no connection within {timeout_s:g} s") from exc
        except OSError as exc:  # refused, unreachable, DNS, TLS
            raise EngineUnreachableError(f"{target.host}:{target.port}: {exc!r}") from exc
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _watch_peer(sock)
        if self._closed:
            conn.abort()
            raise EngineUnreachableError("the engine client is closed")
        conn.on_lost = self._live.discard
        self._live.add(conn)
        return conn

    def _idle_connection(self, target: _Target) -> _Connection | None:
        idle = self._idle.get(target.key)
        if not idle:
            return None
        oldest = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing() or conn.idle_since < oldest:
                conn.abort()
                continue
            return conn
        return None

    def _slots_release(self) -> None:
        self._slots.release()

    def _settled(self, conn: _Connection) -> None:
        """A finished stream's body ended after its reader was done: keep the connection if it may be."""
        if conn.error is None and conn.keep_alive and not conn.closed:
            self._release(conn)
        else:
            conn.abort()

    def _release(self, conn: _Connection) -> None:
        conn.finish()
        conn.used = True
        if self._closed or conn.closed or conn.paused:  # a paused socket would not even see a close
            conn.abort()
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _exchange(self, target: _Target, request: bytes, timeout_s: float | None, *,
                        slotted: bool = True) -> EngineResponse:
        """Send ``request`` and wait for the answer's head.

        ``slotted`` exchanges (model calls) take one of the ``max_in_flight`` slots, waiting for
        one within the deadline. Health and metadata reads take none: a proxy full of long
        streams must still answer its readiness probe and follow the engines' weight versions.
        """
        if self._closed:
            raise EngineUnreachableError("the engine client is closed")
        loop = asyncio.get_running_loop()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + timeout_s
        if slotted:
            if self._slots.locked():
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._slots.acquire()
                except TimeoutError as exc:
                    raise EngineTimeoutError(f"no free engine connection within {timeout_s:g} s: "
                                             "every slot is taken by calls in flight") from exc
            else:
                await self._slots.acquire()
        try:
            conn = self._idle_connection(target)
            fresh = conn is None
            if conn is None:
                conn = await self._connect(target, deadline)
            while True:
                try:
                    conn.send(request, deadline, timeout_s)
                    await conn.wait_headers()
                except _StaleConnectionError:
                    conn.abort()
                    if fresh:
                        raise
                    conn, fresh = await self._connect(target, deadline), True
                    continue
                except BaseException:
                    conn.abort()
                    raise
                return EngineResponse(self, conn, slotted)  # gives the slot back when closed
        except BaseException:
            if slotted:
                self._slots.release()
            raise

    async def post(self, url: str, body: bytes, *, timeout_s: float | None = None) -> EngineResponse:
        """POST JSON and return once the status line and headers arrived.

        The deadline (``timeout_s``, else the client's) covers the whole exchange, reading the
        answer included.

        Raises:
            EngineUnreachableError: no connection (refused, or none within the connect deadline),
                or it closed before the engine answered.
            EngineTimeoutError: no answer in time.
        """
        target = self._target(url)
        request = b"".join((
            b"POST ", target.path, b" HTTP/1.1\r\n", target.head,
            b"Content-Type: application/json\r\nContent-Length: ", str(len(body)).encode(), b"\r\n\r\n", body,
        ))
        return await self._exchange(target, request, timeout_s)

    async def get_json(self, url: str, *, timeout_s: float) -> tuple[int, Any]:
        """GET and parse JSON (None when the body is not JSON); takes no in-flight slot (health, metadata).

        Raises:
            EngineError: no connection or no answer in time.
        """
        target = self._target(url)
        response = await self._exchange(target, b"".join((b"GET ", target.path, b" HTTP/1.1\r\n", target.head,
                                                       b"\r\n")), timeout_s, slotted=False)
        body = await response.read_and_close()
        try:
            return response.status, orjson.loads(body)
        except orjson.JSONDecodeError:
            return response.status, None

    async def post_json(self, url: str, body: bytes, *, timeout_s: float) -> tuple[int, bytes]:
        """POST JSON and read the whole answer.

        Raises:
            EngineError: no connection or no answer in time.
        """
        response = await self.post(url, body, timeout_s=timeout_s)
        return response.status, await response.read_and_close()

    async def aclose(self) -> None:
        """Close every connection, idle or busy; later calls fail as unreachable. Idempotent."""
        self._closed = True
        for conn in list(self._live):
            conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing
