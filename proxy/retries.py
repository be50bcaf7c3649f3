"""Linking a harness's retries to the attempt they repeat.

Harnesses re-send a request unchanged after a 5xx or a dropped stream. The retry
is recorded as its own call (it consumed engine work and has its own tokens), but
linked to the earlier attempt, so the assembler does not count it as a new turn.
A repeat of a request that succeeded is a new call, not a retry.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from schemas._base import new_event_id


@dataclass
class _Attempt:
    call_id: str
    attempt: int
    finished_ok: bool | None  # None while in flight
    at: float
    before: _Attempt | None = None  # the attempt this one replaced, while it is in flight


class RetryTracker:
    """Remembers recent attempts per (rollout, request fingerprint), bounded in size and age."""

    def __init__(self, window_s: float, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._attempts: OrderedDict[tuple[str, bytes], _Attempt] = OrderedDict()

    @staticmethod
    def fingerprint(canonical_request: bytes) -> bytes:
        """A short digest of the request as the engine would see it."""
        return hashlib.blake2b(canonical_request, digest_size=16).digest()

    def begin(self, rollout_id: str, fingerprint: bytes) -> tuple[str, int, str | None]:
        """Start an attempt; return its call id, attempt number and the call it retries."""
        now = time.monotonic()
        key = (rollout_id, fingerprint)
        previous = self._attempts.get(key)
        call_id = new_event_id()
        if previous is not None and now - previous.at <= self.window_s and previous.finished_ok is not True:
            attempt, retry_of = previous.attempt + 1, previous.call_id
        else:
            attempt, retry_of = 0, None
        self._attempts[key] = _Attempt(call_id, attempt, None, now, previous)
        self._attempts.move_to_end(key)
        while len(self._attempts) > self.max_entries:
            self._attempts.popitem(last=False)
        return call_id, attempt, retry_of

    def end(self, rollout_id: str, fingerprint: bytes, call_id: str, ok: bool) -> None:
        """Record how the attempt ended (a later identical request retries it only if it failed)."""
        entry = self._attempts.get((rollout_id, fingerprint))
        if entry is not None and entry.call_id == call_id:
            entry.finished_ok = ok
            entry.at = time.monotonic()
            entry.before = None

    def forget(self, rollout_id: str, fingerprint: bytes, call_id: str) -> None:
        """Take back an attempt that left no record (its journal write failed).

        A re-send must not be linked to a call id no event carries: it retries the attempt
        before this one, if any, as if this one had never begun.
        """
        key = (rollout_id, fingerprint)
        entry = self._attempts.get(key)
        if entry is not None and entry.call_id == call_id:
            if entry.before is None:
                del self._attempts[key]
            else:
                self._attempts[key] = entry.before
