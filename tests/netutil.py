"""Loopback ports for the real parts the tests start (free ones from the library), and one that refuses."""

import contextlib
import socket
from collections.abc import Iterator

from stream.broker import free_port, free_port_pair

__all__ = ["free_port", "free_port_pair", "refused_address"]


@contextlib.contextmanager
def refused_address() -> Iterator[str]:
    """A loopback ``host:port`` where every connection is refused at once, for the block's length.

    The port stays bound but not listening throughout, so nothing else can take it meanwhile, as
    could happen to a free port closed before use.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"
