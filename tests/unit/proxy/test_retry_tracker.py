"""How re-sent requests are linked to the attempts they repeat."""

from __future__ import annotations

from proxy.retries import RetryTracker


def test_a_resend_after_a_failure_is_linked_and_after_a_success_is_not() -> None:
    tracker = RetryTracker(window_s=60)
    first, attempt, retry_of = tracker.begin("r", b"f")
    assert (attempt, retry_of) == (0, None)
    tracker.end("r", b"f", first, ok=False)
    second, attempt, retry_of = tracker.begin("r", b"f")
    assert (attempt, retry_of) == (1, first)
    tracker.end("r", b"f", second, ok=True)
    assert tracker.begin("r", b"f")[1:] == (0, None)


def test_an_attempt_that_left_no_record_is_taken_back() -> None:
    tracker = RetryTracker(window_s=60)
    failed, _, _ = tracker.begin("r", b"f")
    tracker.end("r", b"f", failed, ok=False)
    lost, attempt, retry_of = tracker.begin("r", b"f")  # its record could not be written
    assert (attempt, retry_of) == (1, failed)
    tracker.forget("r", b"f", lost)
    # The next re-send retries the attempt that has an event, as if the lost one never began.
    assert tracker.begin("r", b"f")[1:] == (1, failed)
    alone, _, _ = tracker.begin("r", b"g")
    tracker.forget("r", b"g", alone)
    # Only the attempt named is taken back: a later one that began meanwhile stays.
    later, attempt, retry_of = tracker.begin("r", b"g")
    assert (attempt, retry_of) == (0, None)
    tracker.forget("r", b"g", alone)
    assert tracker.begin("r", b"g")[2] == later
