"""The engine replicas behind the proxy, and which one serves which rollout.

A rollout's prompts grow turn by turn; sending all of them to one replica lets
vLLM's prefix cache reuse the shared part. Rendezvous hashing picks that replica
from the rollout id alone, so every proxy instance agrees without coordination,
and when a replica is down its rollouts move to their next choice while the
others stay put.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time

from proxy.engine_client import IDLE_REUSE_S, EngineClient, EngineError

logger = logging.getLogger(__name__)

READY_FOR_S = 1.0
"""How long one readiness probe of the replicas answers for (see :meth:`UpstreamPool.ready`)."""

VERSION_READ_S = 2.0
"""Longest wait for a replica's weight version; a call whose reading did not come is labelled unknown."""


class UpstreamPool:
    """Replica choice with a short memory of failures, and one shared HTTP client."""

    def __init__(self, urls: list[str], *, timeout_s: float, down_for_s: float = 5.0,
                 keepalive_s: float = IDLE_REUSE_S) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.down_for_s = down_for_s
        self._down_until: dict[str, float] = {}
        self._probe: asyncio.Future[bool] | None = None
        self._probed_at = -math.inf
        self.client = EngineClient(timeout_s=timeout_s, keepalive_s=keepalive_s)

    def order(self, rollout_id: str) -> list[str]:
        """Replicas in preference order for this rollout: healthy first, by rendezvous score."""
        def score(url: str) -> bytes:
            return hashlib.blake2b(f"{url}|{rollout_id}".encode(), digest_size=8).digest()

        ranked = sorted(self.urls, key=score, reverse=True)
        now = time.monotonic()
        return [u for u in ranked if self._down_until.get(u, 0) <= now] + \
            [u for u in ranked if self._down_until.get(u, 0) > now]

    def mark_down(self, url: str) -> None:
        """Skip ``url`` for a while after a connection failure."""
        logger.warning("upstream %s unreachable; trying others for %.0fs", url, self.down_for_s)
        self._down_until[url] = time.monotonic() + self.down_for_s

    def mark_up(self, url: str) -> None:
        """Forget an earlier failure."""
        self._down_until.pop(url, None)

    async def ready(self, timeout_s: float = 2.0) -> bool:
        """True when at least one replica answered its health check within the last :data:`READY_FOR_S`.

        ``/ready`` needs no credential: asked afresh for each probe, anyone reaching the proxy
        could have it send every replica a request per request it sent. So one probe's answer
        serves for a second, and probes arriving while one is under way share it.
        """
        if time.monotonic() - self._probed_at < READY_FOR_S and self._probe is not None and self._probe.done():
            return self._probe.result()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_replicas(timeout_s))
            self._probe.add_done_callback(self._probed)
        return await asyncio.shield(self._probe)

    def _probed(self, probe: asyncio.Future[bool]) -> None:
        self._probed_at = time.monotonic() if not probe.cancelled() and probe.exception() is None else -math.inf

    async def _probe_replicas(self, timeout_s: float) -> bool:
        """Ask every replica's ``/health`` at once; the first healthy answer decides.

        Asked in turn, a replica that accepts connections and never answers (a wedged server, a
        node whose packets vanish) held every readiness probe for its whole timeout, longer than
        the probe waits, and so took every proxy out of service while the other replicas were healthy.
        """
        async def healthy(url: str) -> bool:
            try:
                status, _ = await self.client.get_json(f"{url}/health", timeout_s=timeout_s)
            except EngineError:
                return False
            return status == 200

        asked = [asyncio.ensure_future(healthy(url)) for url in self.urls]
        try:
            for answer in asyncio.as_completed(asked):
                if await answer:
                    return True
            return False
        finally:
            for task in asked:
                task.cancel()

    async def read_weight_version(self, url: str) -> str | None:
        """The weight version ``url`` serves now (``GET /weight_info``); None when it cannot tell.

        Read fresh for every chat-mode call, before it is sent and after its answer ends: vLLM's
        chat endpoint does not say which version sampled each token, and equal readings around the
        call are the only proof that one version made all of it. A remembered reading is no proof:
        an update may have landed since.
        """
        try:
            status, info = await self.client.get_json(f"{url}/weight_info", timeout_s=VERSION_READ_S)
        except EngineError:
            return None
        if status != 200 or not isinstance(info, dict) or info.get("weight_version") is None:
            return None
        return str(info["weight_version"])

    async def aclose(self) -> None:
        """Stop polling and probing, and close the shared client."""
        if self._probe is not None:  # its health requests end before the client they use closes
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a probe's failure was its callers'
                await self._probe
        await self.client.aclose()
