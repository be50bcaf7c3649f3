"""Run long-lived components until a signal, then stop them in order.

One supervisor per process (as Temporal's worker and Kopf's reactor do): start
every component, wait until one fails or SIGTERM/SIGINT arrives, then stop them
all in reverse order so each drains before the process exits. A signal sets a
flag; it never cancels work in the middle of a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import warnings
from collections.abc import Sequence
from typing import Protocol, Self

logger = logging.getLogger(__name__)


class Component(Protocol):
    """What the supervisor needs of a long-lived part."""

    async def start(self) -> None:
        """Begin work; return once running."""

    async def wait(self) -> None:
        """Return (or raise) when the component ended on its own."""

    async def stop(self) -> None:
        """Drain and release resources; idempotent."""


class Managed:
    """``async with`` and a leak warning for a component with ``start()``/``stop()``.

    The component sets ``_started`` in ``start()`` and ``_stopped`` in ``stop()``; one that was
    started and then dropped without ``stop()`` has not drained, which is worth a warning.
    """

    _started = False
    _stopped = False

    async def start(self) -> None:
        """Begin work (the component's own)."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Drain and release resources (the component's own)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __del__(self) -> None:
        if self._started and not self._stopped:
            warnings.warn(f"{self!r} was started but never stopped", ResourceWarning, stacklevel=1)


async def supervise(
    components: Sequence[Component],
    *,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Start ``components``; stop all when one ends, fails, or a signal arrives.

    Raises:
        BaseException: the first failure of a component, after every component stopped.
    """
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop_requested.set)
            installed.append(sig)
    started: list[Component] = []
    failure: BaseException | None = None
    try:
        for component in components:
            await component.start()
            started.append(component)
        waits = [asyncio.ensure_future(c.wait()) for c in started]
        stopper = asyncio.ensure_future(stop_requested.wait())
        done, _ = await asyncio.wait([*waits, stopper], return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            if fut is not stopper and not fut.cancelled() and fut.exception() is not None:
                failure = fut.exception()
        if stopper in done:
            logger.info("signal received; draining")
        stopper.cancel()
        for fut in waits:
            if not fut.done():
                fut.cancel()
    finally:
        for component in reversed(started):
            try:
                await component.stop()
            except Exception:
                logger.exception("stopping %r failed", component)
        for sig in installed:
            loop.remove_signal_handler(sig)
    if failure is not None:
        raise failure
