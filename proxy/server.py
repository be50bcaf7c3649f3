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

    The bytes of every read that arrives while a request's head is open are counted; once more
    than the bound has arrived without the head ending, the connection gets 431 and is closed. A
    read may also carry the start of the body, so the check is on what came before it, and at
    most one read (256 KiB) more than the bound is ever held.
    """

    max_head_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = True
        self._refused = False

    def data_received(self, data: bytes) -> None:
        """Count a read that arrives while a head is open, and refuse the request past the bound."""
        if self._refused:
            return
        if self._in_head:
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()
                return
            self._head_bytes += len(data)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        """The head ended: what follows is the body, not counted."""
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """The request ended: what follows on this connection is the next request's head."""
        self._in_head = True
        super().on_message_complete()

    def _refuse_head(self) -> None:
        self._refused = True
        message = f"request line and headers exceed {self.max_head_bytes:,} bytes"
        logger.warning("refused a request from %s: %s", self.client, message)
        body = message.encode("ascii")
        self.transport.write(b"".join([
            STATUS_LINE[431], b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
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
