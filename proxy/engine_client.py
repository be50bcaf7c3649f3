"""HTTP to the engines: aiohttp with long-lived connections, behind a small interface.

The proxy spends most of its own CPU on the client side of each engine call; aiohttp
costs about half of what httpx does per request here (bench/proxy.py), and keeps its
pool cheap under high concurrency. The interface is what the proxy needs and no more,
with its own errors, so the call pipeline does not depend on the client library.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson


class EngineError(Exception):
    """The exchange with an engine failed at the transport level."""


class EngineUnreachableError(EngineError):
    """No connection could be made (refused, reset before answering, DNS)."""


class EngineTimeoutError(EngineError):
    """The engine did not answer in time."""


class EngineResponse:
    """One engine answer, read whole or line by line."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            EngineError: the connection broke or timed out while reading.
        """
        try:
            return await self._response.read()
        except TimeoutError as exc:
            raise EngineTimeoutError(f"engine answer timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(f"engine answer broke: {exc!r}") from exc

    async def lines(self) -> AsyncIterator[bytes]:
        """Lines of a streamed (SSE) body, without their line ends.

        Lines are split here rather than with the stream reader's ``readline``, which
        refuses lines over 64 KiB: the first chunk of a long prompt carries all its ids.

        Raises:
            EngineError: the connection broke or timed out mid-stream.
        """
        pending = b""
        try:
            async for data in self._response.content.iter_any():
                pending += data
                if b"\n" not in data:
                    continue
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
        except TimeoutError as exc:
            raise EngineTimeoutError(f"engine stream timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(f"engine stream broke: {exc!r}") from exc
        if pending:
            yield pending.rstrip(b"\r")

    def close(self, *, finished: bool) -> None:
        """Give the connection back when the body was read; otherwise cut it.

        Cutting is how an engine learns that the caller went away: vLLM aborts the
        request when its connection closes.
        """
        if finished:
            self._response.release()
        else:
            self._response.close()


class EngineClient:
    """One shared aiohttp session for all engine calls of a process."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float = 5.0, keepalive_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=self.keepalive_s),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s),
                auto_decompress=False, skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def post(self, url: str, body: bytes, *, timeout_s: float | None = None) -> EngineResponse:
        """POST JSON and return once the status line and headers arrived.

        Raises:
            EngineUnreachableError: no connection.
            EngineTimeoutError: no answer in time.
        """
        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            response = await self.session.post(url, data=body, headers={"content-type": "application/json"}, **extra)
        except TimeoutError as exc:
            raise EngineTimeoutError(f"{url} timed out: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnreachableError(f"{url}: {exc!r}") from exc
        return EngineResponse(response)

    async def get_json(self, url: str, *, timeout_s: float) -> tuple[int, Any]:
        """GET and parse JSON (None when the body is not JSON).

        Raises:
            EngineError: no connection or no answer in time.
        """
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                body = await response.read()
        except TimeoutError as exc:
            raise EngineTimeoutError(f"{url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnreachableError(f"{url}: {exc!r}") from exc
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
        try:
            return response.status, await response.read()
        finally:
            response.close(finished=True)

    async def aclose(self) -> None:
        """Close every connection."""
        if self._session is not None:
            await self._session.close()
            await asyncio.sleep(0)  # let the connector finish closing its transports
