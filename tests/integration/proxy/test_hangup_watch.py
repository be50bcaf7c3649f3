"""The hang-up watch against a real uvicorn server: an armed wait is cut, nothing else is.

A tiny ASGI app uses :class:`proxy.hangup.HangupWatch` as the proxy does around its engine
waits, with a sleep standing in for the engine; the clients are raw sockets that hang up, or
stay for the answer. (The proxy's own use, against the real vLLM, is tested in
test_proxy_robustness.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from inloop_server import InLoopServer
from netutil import free_port
from starlette.requests import Request

from proxy.hangup import HangupWatch, HarnessGoneError

Outcome = dict[str, Any]


def _app(mode: str, outcomes: asyncio.Queue[Outcome]) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        watch = HangupWatch(receive)
        outcome: Outcome = {"mode": mode}
        try:
            if mode == "disarmed":
                await asyncio.sleep(0.6)  # the harness leaves meanwhile
                outcome["gone_unarmed"] = watch.gone
            with watch.armed():
                await asyncio.sleep(0.3 if mode == "stays" else 30)
            outcome["finished"] = True
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            outcome["cancelled_by_watch"] = watch.cancelled
            outcome["still_cancelling"] = task.uncancel()
        except HarnessGoneError:
            outcome["refused_to_arm"] = True
        finally:
            watch.stop()
        outcome["gone"] = watch.gone or await Request(scope, receive).is_disconnected()
        await outcomes.put(outcome)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


@contextlib.asynccontextmanager
async def _serve(mode: str) -> AsyncIterator[tuple[int, asyncio.Queue[Outcome]]]:
    outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
    port = free_port()
    server = InLoopServer(uvicorn.Config(_app(mode, outcomes), host="127.0.0.1", port=port, log_level="warning",
                                         lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port, outcomes
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def _ask(port: int, *, hang_up_after_s: float | None) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
    await writer.drain()
    answer = b""
    if hang_up_after_s is None:
        answer = await asyncio.wait_for(reader.readline(), 10)
    else:
        await asyncio.sleep(hang_up_after_s)
    writer.close()
    await writer.wait_closed()
    return answer


@pytest.mark.parametrize("mode", ["armed", "disarmed", "stays"])
async def test_a_hang_up_cuts_only_an_armed_wait(mode: str) -> None:
    async with _serve(mode) as (port, outcomes):
        answer = await _ask(port, hang_up_after_s=None if mode == "stays" else 0.2)
        outcome = await asyncio.wait_for(outcomes.get(), 10)  # well within the armed 30 s sleep
        if mode == "armed":
            # The wait in progress was cancelled by the watch, and taking that back leaves none.
            assert outcome == {"mode": mode, "cancelled_by_watch": True, "still_cancelling": 0, "gone": True}
        elif mode == "disarmed":
            # Only noted while disarmed; arming afterwards refuses at once rather than waiting.
            assert outcome == {"mode": mode, "gone_unarmed": True, "refused_to_arm": True, "gone": True}
        else:
            # A harness that stays is never taken for gone, and gets its answer after the watch.
            assert outcome == {"mode": mode, "finished": True, "gone": False}
            assert answer.startswith(b"HTTP/1.1 200 OK")
