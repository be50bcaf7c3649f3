"""Linking a harness's retries to the attempt they repeat.

Harnesses re-send a request unchanged after a 5xx or a dropped stream. The retry
is recorded as its own call (it consumed engine work and has its own tokens), but
linked to the earlier attempt, so the assembler does not count it as a new turn.
A repeat of a request that succeeded is a new call, not a retry.

The link is settled when the later call is recorded, not when it begins: the same request
sent twice at once (two sub-agents with one prompt, best-of-n inside one rollout) is two
calls, and the assembler leaves out every call another names in ``retry_of``, so linking
the second to the first while both run would drop a call whose answer the harness used.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Attempt:
    call_id: str
    attempt: int
    finished_ok: bool | None  # None while in flight
    at: float
    before: _Attempt | None = None  # the attempt this one replaced, while it is in flight
    retries: _Attempt | None = None  # the attempt this one was linked to when it began


class RetryTracker:
    """Remembers recent attempts per (rollout, request fingerprint), bounded in size and age.

    Only attempts that failed (and those in flight) are kept: one that succeeded links
    nothing, exactly as if it had never been seen, so it leaves at once and the bound is
    spent on the attempts a re-send may retry.
    """

    def __init__(self, window_s: float, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._attempts: OrderedDict[tuple[str, bytes], _Attempt] = OrderedDict()
        self._in_flight: dict[str, _Attempt] = {}

    @staticmethod
    def fingerprint(canonical_request: bytes) -> bytes:
        """A short digest of the request as the engine would see it."""
        return hashlib.blake2b(canonical_request, digest_size=16).digest()

    def begin(self, rollout_id: str, fingerprint: bytes, call_id: str) -> tuple[int, str | None]:
        """Start attempt ``call_id``; return its attempt number and the call it retries.

        As they stand now: :meth:`settle` has the last word when the call is recorded.
        """
        now = time.monotonic()
        key = (rollout_id, fingerprint)
        previous = self._attempts.get(key)
        linked = previous if (previous is not None and now - previous.at <= self.window_s
                              and previous.finished_ok is not True) else None
        entry = _Attempt(call_id, 0 if linked is None else linked.attempt + 1, None, now, previous, linked)
        self._attempts[key] = entry
        self._attempts.move_to_end(key)
        self._in_flight[call_id] = entry
        if len(self._in_flight) > self.max_entries:  # only calls that never ended (a fault) pile up here
            del self._in_flight[next(iter(self._in_flight))]
        self._expire(now)
        return entry.attempt, None if linked is None else linked.call_id

    def settle(self, call_id: str) -> tuple[int, str | None]:
        """The attempt number and the call it retries of ``call_id``, as its event is made.

        A link to an attempt that failed holds. A link made to an attempt then still in flight
        holds only if that attempt has failed since; one that succeeded, or still runs, is
        another call of the same request, and this one is then a call of its own (attempt 0).
        """
        entry = self._in_flight.get(call_id)
        if entry is None or entry.retries is None:
            return (0, None) if entry is None else (entry.attempt, None)
        if entry.retries.finished_ok is not False:
            entry.retries, entry.attempt = None, 0
            return 0, None
        return entry.attempt, entry.retries.call_id

    def end(self, rollout_id: str, fingerprint: bytes, call_id: str, ok: bool) -> None:
        """Record how the attempt ended (a later identical request retries it only if it failed)."""
        entry = self._in_flight.pop(call_id, None)
        if entry is None:
            return
        entry.finished_ok = ok
        entry.at = time.monotonic()
        entry.before = entry.retries = None
        key = (rollout_id, fingerprint)
        if self._attempts.get(key) is entry:
            if ok:
                del self._attempts[key]  # a success links nothing: as if never seen
            else:
                self._attempts.move_to_end(key)  # in the order of `at`, which expiry reads from the oldest end

    def forget(self, rollout_id: str, fingerprint: bytes, call_id: str) -> None:
        """Take back an attempt that left no record (its journal write failed).

        A re-send must not be linked to a call id no event carries: it retries the attempt
        before this one, if any, as if this one had never begun.
        """
        self._in_flight.pop(call_id, None)
        key = (rollout_id, fingerprint)
        entry = self._attempts.get(key)
        if entry is not None and entry.call_id == call_id:
            if entry.before is None:
                del self._attempts[key]
            else:
                self._attempts[key] = entry.before

    def _expire(self, now: float) -> None:
        """Drop attempts past the window from the oldest end, then any over the size bound.

        An attempt still in flight stays (a re-send may retry it) but goes behind the rest, so
        that one long call does not hold every failure after it past the window; :meth:`end`
        puts it back in order. Each is passed over at most once per window.
        """
        for _ in range(len(self._attempts)):
            key, oldest = next(iter(self._attempts.items()))
            if now - oldest.at <= self.window_s:
                break
            if oldest.finished_ok is None:
                self._attempts.move_to_end(key)
            else:
                self._attempts.popitem(last=False)
        while len(self._attempts) > self.max_entries:
            self._attempts.popitem(last=False)

    def __len__(self) -> int:
        """Attempts remembered (those that failed within the window, and those in flight)."""
        return len(self._attempts)
