"""How re-sent requests are linked to the attempts they repeat."""

from __future__ import annotations

import itertools

import pytest

from proxy.retries import RetryTracker

_ids = (f"c-{n}" for n in itertools.count())


def _begin(tracker: RetryTracker, fingerprint: bytes = b"f") -> tuple[str, int, str | None]:
    call_id = next(_ids)
    return (call_id, *tracker.begin("r", fingerprint, call_id))


def test_a_resend_after_a_failure_is_linked_and_after_a_success_is_not() -> None:
    tracker = RetryTracker(window_s=60)
    first, attempt, retry_of = _begin(tracker)
    assert (attempt, retry_of) == (0, None)
    tracker.end("r", b"f", first, ok=False)
    second, attempt, retry_of = _begin(tracker)
    assert (attempt, retry_of) == (1, first) == tracker.settle(second)
    tracker.end("r", b"f", second, ok=True)
    assert _begin(tracker)[1:] == (0, None)


def test_an_attempt_that_left_no_record_is_taken_back() -> None:
    tracker = RetryTracker(window_s=60)
    failed, _, _ = _begin(tracker)
    tracker.end("r", b"f", failed, ok=False)
    lost, attempt, retry_of = _begin(tracker)  # its record could not be written
    assert (attempt, retry_of) == (1, failed)
    tracker.forget("r", b"f", lost)
    # The next re-send retries the attempt that has an event, as if the lost one never began.
    assert _begin(tracker)[1:] == (1, failed)
    alone, _, _ = _begin(tracker, b"g")
    tracker.forget("r", b"g", alone)
    # Only the attempt named is taken back: a later one that began meanwhile stays.
    later, attempt, retry_of = _begin(tracker, b"g")
    assert (attempt, retry_of) == (0, None)
    tracker.forget("r", b"g", alone)
    tracker.end("r", b"g", later, ok=False)
    assert _begin(tracker, b"g")[2] == later


@pytest.mark.parametrize("first_ends", ["ok before", "after"])
def test_the_same_request_twice_at_once_is_two_calls_when_both_succeed(first_ends: str) -> None:
    # Two sub-agents with one prompt: the second begins while the first runs. Linked, the first
    # (whose answer the harness used) would be left out of training as a superseded attempt.
    tracker = RetryTracker(window_s=60)
    first, _, _ = _begin(tracker)
    second, attempt, retry_of = _begin(tracker)
    assert (attempt, retry_of) == (1, first)  # for now: it may yet be a retry of a call that fails
    if first_ends == "ok before":
        tracker.end("r", b"f", first, ok=True)
    assert tracker.settle(second) == (0, None)
    tracker.end("r", b"f", second, ok=True)
    if first_ends == "after":
        assert tracker.settle(first) == (0, None)
        tracker.end("r", b"f", first, ok=True)
    assert len(tracker) == 0


def test_a_resend_while_the_attempt_it_repeats_is_failing_stays_linked() -> None:
    # The harness gave up on the first attempt and sent it again before the proxy had seen it go.
    tracker = RetryTracker(window_s=60)
    first, _, _ = _begin(tracker)
    second, _, _ = _begin(tracker)
    tracker.end("r", b"f", first, ok=False)
    assert tracker.settle(second) == (1, first)


def test_successes_are_not_kept_and_failures_leave_after_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("proxy.retries.time.monotonic", lambda: now[0])
    tracker = RetryTracker(window_s=60)
    for n in range(100):
        call, _, _ = _begin(tracker, str(n).encode())
        tracker.end("r", str(n).encode(), call, ok=True)
    assert len(tracker) == 0  # a success links nothing, so it holds no room
    failed, _, _ = _begin(tracker, b"x")
    tracker.end("r", b"x", failed, ok=False)
    assert len(tracker) == 1
    now[0] += 61
    assert _begin(tracker, b"y")[1:] == (0, None)
    assert len(tracker) == 1  # only the new attempt: the failure past the window is gone


def test_a_long_call_does_not_hold_the_failures_after_it_past_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("proxy.retries.time.monotonic", lambda: now[0])
    tracker = RetryTracker(window_s=60)
    long_call, _, _ = _begin(tracker, b"long")  # a stream that runs for many windows
    early, _, _ = _begin(tracker, b"early")
    for n in range(50):
        call, _, _ = _begin(tracker, str(n).encode())
        tracker.end("r", str(n).encode(), call, ok=False)
    now[0] += 30
    tracker.end("r", b"early", early, ok=False)  # ends after the fifty: its failure counts from now
    now[0] += 40  # the fifty are past the window, the early one is not
    assert _begin(tracker, b"z")[1:] == (0, None)
    assert len(tracker) == 3  # the long call (still in flight), the early one's failure, z
    assert _begin(tracker, b"early")[1:] == (1, early)
    now[0] += 1000
    tracker.end("r", b"long", long_call, ok=False)
    assert _begin(tracker, b"long")[1:] == (1, long_call)  # its failure counts from its end
    now[0] += 61
    _begin(tracker, b"last")
    assert len(tracker) == 4  # all in flight, however old: z, early's and long's re-sends, last
