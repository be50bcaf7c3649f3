"""The HTTP server under the proxy: uvicorn, with a bound on what a request's head may take.

uvicorn's httptools parser (the fast one, chosen whenever it is installed) sets no limit on a
request line or its headers: a client that never finishes its headers, or sends one header of
100 MB, has all of it read into memory, before any credential is looked at. h11, the other
parser, has such a bound but costs a third more CPU per call. So the httptools protocol is kept
and counts what arrives while a head is still open.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from proxy.settings import ProxySettings

logger = logging.getLogger(__name__)


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 to a request whose head outgrows ``max_head_bytes``.

    Two checks. Every read is counted until the parser makes progress (a head ends, body bytes
    arrive); past the bound without progress, the request is refused. That holds memory to the
    bound and one read (256 KiB) whatever arrives: a head that never ends, one long header, or
    the trailers after a chunked body's last chunk. And a head that ends is measured exactly
    (its target and headers), so one that came in a single large read is refused too.
    """

    max_head_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unparsed = 0  # bytes read since the parser last made progress
        self._refused = False

    def data_received(self, data: bytes) -> None:
        """Feed a read to the parser, and refuse the request once its head is past the bound."""
        if self._refused:
            return
        self._unparsed += len(data)
        super().data_received(data)
        if self._refused or self._unparsed > self.max_head_bytes:
            self._refuse_head()

    def on_headers_complete(self) -> None:
        """Measure the head that ended, and serve it if it is within the bound."""
        size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
        if size > self.max_head_bytes:
            self._refused = True  # answered once the parser returns (see data_received)
            return
        self._unparsed = 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """Body bytes are progress: what came before them is not a head still growing."""
        if self._refused:
            return
        self._unparsed = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        """Nothing of a refused request reaches the app."""
        if not self._refused:
            super().on_message_complete()

    def _refuse_head(self) -> None:
        self._refused = True
        if self.transport.is_closing():
            return
        message = f"request line and headers exceed {self.max_head_bytes:,} bytes"
        logger.warning("refused a request from %s: %s", self.client, message)
        if self.cycle is None or self.cycle.response_complete:
            body = message.encode("ascii")
            self.transport.write(b"".join([
                STATUS_LINE[431], b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        # else an answer is under way on this connection (the trailers of its own request, a
        # request sent behind it): a 431 written now would land inside it, so the connection
        # only closes.
        self.transport.close()


def protocol_for(settings: ProxySettings) -> type[asyncio.Protocol]:
    """The HTTP protocol class for a proxy of these settings (uvicorn makes one per connection)."""
    return type("ProxyHttpProtocol", (BoundedHeadProtocol,), {"max_head_bytes": settings.max_head_bytes})


def server_config(app: Any, settings: ProxySettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration for serving ``app`` under ``settings``: one place for the CLI and the tests."""
    options: dict[str, Any] = {
        "host": settings.host, "port": settings.port, "log_level": "warning", "access_log": False,
        "timeout_graceful_shutdown": settings.drain_s, "http": protocol_for(settings),
    }
    return uvicorn.Config(app, **{**options, **overrides})
