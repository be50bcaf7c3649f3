"""Readiness probes of the engine replicas: one probe answers for a second, and concurrent ones share it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from netutil import free_port

from proxy.upstream import READY_FOR_S, UpstreamPool


@contextlib.asynccontextmanager
async def _health_server(status: list[int], hits: list[int]) -> AsyncIterator[str]:
    """A plain HTTP server answering ``/health`` with ``status[0]``, counting requests in ``hits``."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.readuntil(b"\r\n\r\n"):
                hits[0] += 1
                await asyncio.sleep(0.05)  # a probe takes a while: others arrive meanwhile
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"
                             % status[0])
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


async def test_ready_asks_the_engine_once_a_second_however_often_it_is_asked() -> None:
    """/ready needs no credential; before, each probe sent every replica a request of its own."""
    status, hits = [200], [0]
    async with _health_server(status, hits) as url:
        pool = UpstreamPool([url], timeout_s=5.0)
        try:
            assert all(await asyncio.gather(*(pool.ready() for _ in range(50))))
            assert hits[0] == 1
            assert await pool.ready() and hits[0] == 1  # answered from the last probe
            status[0] = 503
            await asyncio.sleep(READY_FOR_S + 0.05)
            assert not await pool.ready() and hits[0] == 2  # a second later the engine is asked again
        finally:
            await pool.aclose()


@pytest.mark.parametrize("replicas", [1, 2])
async def test_ready_is_false_when_no_replica_answers(replicas: int) -> None:
    pool = UpstreamPool([f"http://127.0.0.1:{free_port()}" for _ in range(replicas)], timeout_s=1.0)
    try:
        assert not await pool.ready()
    finally:
        await pool.aclose()
