"""Noticing a harness that hung up while its whole answer was still being made.

Once a request's body is read, an ASGI server's ``receive`` waits until the connection closes and
then returns ``http.disconnect``. Stepping its coroutine by hand (rather than awaiting it in a
task of its own, which every call would pay for) tells at once whether the harness is still
there, and the future it waits on says when it leaves. A streamed answer needs none of this:
the server cancels its body when the harness goes.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

Receive = Callable[[], Awaitable[Any]]


def _disconnect(message: object) -> bool:
    return isinstance(message, dict) and message.get("type") == "http.disconnect"


def harness_gone(receive: Receive) -> bool:
    """Whether the harness has hung up, asked without waiting (about a microsecond).

    The coroutine of ``receive`` is stepped once: finished at once, a disconnect was already
    there; suspended, the harness is still connected, and the coroutine is closed.
    """
    probe = receive()
    if not inspect.iscoroutine(probe):
        return False
    try:
        probe.send(None)
    except StopIteration as done:
        return _disconnect(done.value)
    probe.close()
    return False


HARNESS_GONE = "the harness hung up before the whole answer was ready"
"""Why a whole answer's call is recorded ``client_disconnected`` (its engine work cut short, or its answer untaken)."""


class HarnessGoneError(Exception):
    """The harness had already hung up when an armed block began."""


class HangupWatch:
    """Cancels the task that made it when the harness hangs up, but only while :meth:`armed`.

    Armed around the waits for the engine, a hang-up cancels the engine request there (the engine
    client cuts its connection, and vLLM aborts a request whose connection closes), instead of
    the engine making an answer nobody takes while the harness already sends the call again.
    Disarmed, for instance while the call is being recorded, a hang-up is only noted in
    :attr:`gone`. The task sees ``CancelledError`` at the armed wait; :attr:`cancelled` tells it
    that the cancellation was this watch's, to be taken back with ``Task.uncancel``. A block
    armed after the harness left raises :class:`HarnessGoneError` at once.
    """

    def __init__(self, receive: Receive, *, enabled: bool = True) -> None:
        self.gone = False
        """The harness hung up (seen by this watch)."""
        self.cancelled = False
        """This watch cancelled its task."""
        self._armed = False
        self._task = asyncio.current_task()
        self._probe: Coroutine[Any, Any, Any] | None = None
        if not enabled:
            return
        probe = receive()
        if not inspect.iscoroutine(probe):
            return
        try:
            waiting = probe.send(None)
        except StopIteration as done:
            self.gone = _disconnect(done.value)
            return
        except Exception:  # noqa: BLE001 - a receive that fails (an emptied one, say): no watching
            return
        self._wait_on(probe, waiting)

    def _wait_on(self, probe: Coroutine[Any, Any, Any], waiting: object) -> None:
        if isinstance(waiting, asyncio.Future):
            self._probe = probe
            waiting.add_done_callback(self._woken)
        else:
            probe.close()

    def _woken(self, _: asyncio.Future[Any]) -> None:
        probe, self._probe = self._probe, None
        if probe is None:
            return  # stopped
        try:
            waiting = probe.send(None)
        except StopIteration as done:
            if _disconnect(done.value):
                self.gone = True
                if self._armed and self._task is not None:
                    self.cancelled = True
                    self._task.cancel()
            return  # any other message (none comes once the body is read): stop watching
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - a receive that failed: stop watching
            return
        self._wait_on(probe, waiting)

    def armed(self) -> HangupWatch:
        """A context in which a hang-up cancels the task (at the wait in progress)."""
        return self

    def __enter__(self) -> None:
        if self.gone:
            # Gone before the block. A cancellation scheduled now would land at the task's next
            # wait, which may come after the block (if its code raises without waiting).
            raise HarnessGoneError(HARNESS_GONE)
        self._armed = True

    def __exit__(self, *_: object) -> None:
        self._armed = False

    def stop(self) -> None:
        """Stop watching. Idempotent."""
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()


__all__ = ["HARNESS_GONE", "HangupWatch", "HarnessGoneError", "harness_gone"]
