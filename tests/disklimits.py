"""A disk that refuses a write, for real: the kernel's file size limit on this process."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Let this process grow no file past ``limit`` bytes: the kernel cuts a ``write`` short there,
    and refuses one that starts past it (``EFBIG``), as a full disk refuses it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
