"""A uvicorn server run inside a test's event loop that leaves Ctrl-C to pytest.

uvicorn's ``serve()`` catches SIGINT and SIGTERM while it runs and raises them again when it
stops. Inside a test, an interrupted run then raises KeyboardInterrupt from the fixture teardown
that stops the server, which cuts short the teardowns after it: the session's Kafka broker and
vLLM were left running after a Ctrl-C.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class InLoopServer(uvicorn.Server):
    """``uvicorn.Server`` without its signal handling; stop it with ``should_exit``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
