"""The replica pool's view of engines that accept connections and never answer.

The wedged engine here is a real listening socket that reads and never writes, as a server
stuck in its handler (or a node whose replies are lost) is seen from the proxy; the healthy
one is the real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest

from proxy.upstream import UpstreamPool


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
        for writer in held:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
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


async def test_a_replica_whose_weight_version_cannot_be_read_has_none_rather_than_a_stale_one() -> None:
    # A scripted engine: reports version 7, then answers 503 (an engine restarting, say). The
    # last reading must not go on labelling answers sampled after it.
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
    pool.start_version_poll(0.02)
    try:
        await _until(lambda: pool.weight_version(url) == "7")
        assert pool.weight_version(url) == "7"
        healthy[0] = False
        await _until(lambda: pool.weight_version(url) is None)
        assert pool.weight_version(url) is None
    finally:
        await pool.aclose()
        for writer in opened:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        server.close()
        await server.wait_closed()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
