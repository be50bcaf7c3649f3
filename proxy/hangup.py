"""Noticing a harness that hung up while its whole answer was still being made.

Once a request's body is read, ASGI's ``receive`` waits until the connection closes and then
returns ``http.disconnect``. :class:`HangupWatch` awaits it in a task of its own, as Starlette's
``StreamingResponse`` and vLLM's ``with_cancellation`` do; after the watch, Starlette's
``Request.is_disconnected`` asks without waiting. A streamed answer needs none of this: the
server cancels its body when the harness goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[Any]]

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
        self._listener = asyncio.create_task(self._listen(receive)) if enabled else None

    async def _listen(self, receive: Receive) -> None:
        try:
            message = await receive()
        except Exception:  # noqa: BLE001 - a receive that fails (an emptied one, say): no watching
            return
        if not isinstance(message, dict) or message.get("type") != "http.disconnect":
            return  # none other comes once the body is read; a receive that says otherwise is not watched
        self.gone = True
        if self._armed and self._task is not None:
            self.cancelled = True
            self._task.cancel()

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
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()


__all__ = ["HARNESS_GONE", "HangupWatch", "HarnessGoneError"]
