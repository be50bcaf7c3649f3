"""The one retry rule (``schemas/backoff.py``) every retrying loop waits by."""

from __future__ import annotations

import math

from schemas.backoff import Backoff


def test_pauses_double_after_each_failure_up_to_the_cap_and_start_over_after_a_success() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next_s() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.failures == 5
    backoff.reset()
    assert backoff.next_s() == 0.5


def test_without_a_cap_hours_of_failures_neither_overflow_nor_shrink() -> None:
    backoff = Backoff(0.1)
    backoff.failures = 5000
    assert math.isfinite(backoff.next_s()) and backoff.next_s() > 3600
    assert Backoff(0.0).next_s() == 0.0  # no pause at all, as a test setting asks
