"""The replica pool's view of engines that accept connections and never answer.

The wedged engine here is a real listening socket that reads and never writes, as a server
stuck in its handler (or a node whose replies are lost) is seen from the proxy; the healthy
one is the real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.engine_client import EngineUnreachableError
from proxy.upstream import VERSION_READ_S, UpstreamPool


@pytest.fixture
async def wedged_url() -> AsyncIterator[str]:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the proxy gives up and closes
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await _close_all(held)
        server.close()
        await server.wait_closed()


async def test_one_wedged_replica_does_not_hold_readiness_when_another_is_healthy(
        wedged_url: str, vllm_url: str) -> None:
    # Asked in turn, the wedged replica (listed first, as in every proxy's settings alike) held
    # each readiness probe for its whole timeout, past what the probe waits: every proxy went
    # NotReady at once while an engine was serving.
    pool = UpstreamPool([wedged_url, vllm_url], timeout_s=30)
    try:
        started = time.monotonic()
        assert await pool.ready(timeout_s=10.0)
        assert time.monotonic() - started < 5.0  # the healthy answer decided, not the wedged one's timeout
        assert not await UpstreamPool([wedged_url], timeout_s=30).ready(timeout_s=0.5)
    finally:
        await pool.aclose()


async def test_a_replica_whose_weight_version_cannot_be_read_has_none() -> None:
    # A scripted engine: reports version 7, then answers 503 (an engine restarting, say). A reading
    # is taken fresh each time: the earlier one must not stand in for it.
    healthy = [True]

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while await reader.readuntil(b"\r\n\r\n"):
                body = b'{"weight_version": "7"}' if healthy[0] else b"{}"
                status = b"200 OK" if healthy[0] else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        writer.close()

    opened: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool([url], timeout_s=30)
    try:
        assert await pool.read_weight_version(url) == "7"
        healthy[0] = False
        assert await pool.read_weight_version(url) is None
    finally:
        await pool.aclose()
        await _close_all(opened)
        server.close()
        await server.wait_closed()


async def test_a_wedged_replica_s_weight_version_is_unknown_after_the_read_s_deadline(
        wedged_url: str, vllm_url: str) -> None:
    pool = UpstreamPool([wedged_url, vllm_url], timeout_s=30)
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            served = (await http.get(f"{vllm_url}/weight_info")).json()["weight_version"]
        assert await pool.read_weight_version(vllm_url) == str(served)
        # Not the call's deadline (30 s here): the read gives up after its own.
        assert await asyncio.wait_for(pool.read_weight_version(wedged_url), VERSION_READ_S + 5.0) is None
    finally:
        await pool.aclose()


async def test_an_engine_gone_silent_since_its_last_answer_fails_fast_instead_of_holding_the_call() -> None:
    # A scripted engine answers one call on a kept-alive connection and then vanishes without a
    # word: it stops listening (new connections are refused, as at a node that is gone) but its
    # open connection is neither answered nor closed (the close never arrives). A live engine
    # closes idle connections itself after 5 s; reused after that, this one took the next call
    # into the void until the upstream timeout (600 s in the proxy's settings), with no failover.
    opened: list[asyncio.StreamWriter] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.read()  # held open, unanswered

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = UpstreamPool([url], timeout_s=20, keepalive_s=0.2)
    try:
        assert (await pool.client.get_json(f"{url}/health", timeout_s=5))[0] == 200
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.3)  # idle past the engine's keep-alive
        started = time.monotonic()
        with pytest.raises(EngineUnreachableError):
            await pool.client.get_json(f"{url}/health", timeout_s=20)
        assert time.monotonic() - started < 5.0
        assert opened and not opened[0].is_closing()  # the silent connection was still open
    finally:
        await pool.aclose()
        await _close_all(opened)


def test_idle_engine_connections_are_reused_for_less_than_vllms_keep_alive() -> None:
    # vLLM's uvicorn closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); ours must
    # be given up first for the case above to be caught.
    assert UpstreamPool(["http://127.0.0.1:9"], timeout_s=1).client.keepalive_s < 5.0


async def test_engine_connections_probe_their_peer_so_a_lost_node_is_found_within_a_minute(vllm_url: str) -> None:
    # A whole answer keeps its connection silent while the engine generates; a node lost then
    # (its packets dropped, no reset) held the call for the whole upstream timeout, 600 s.
    pool = UpstreamPool([vllm_url], timeout_s=30)
    try:
        assert (await pool.client.get_json(f"{vllm_url}/health", timeout_s=10))[0] == 200
        [conn] = [c for kept in pool.client._idle.values() for c in kept]
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle, interval, probes = (sock.getsockopt(socket.IPPROTO_TCP, option)
                                  for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT))
        assert idle + interval * probes <= 60
        # A request sent to a peer gone silent is retransmitted, not probed: bounded apart.
        unacked_ms = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert (idle + interval * probes) * 1000 <= unacked_ms <= 60_000
    finally:
        await pool.aclose()


async def _close_all(writers: list[asyncio.StreamWriter]) -> None:
    """Close a scripted server's connections (one left open fails a later test as a ResourceWarning)."""
    for writer in writers:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
