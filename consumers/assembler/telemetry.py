"""The assembler's OpenTelemetry instruments, named in this one place (API only)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

tracer = trace.get_tracer("openforge.assembler")
_meter = metrics.get_meter("openforge.assembler")

trajectories = _meter.create_counter(
    "openforge.assembler.trajectories", unit="{trajectory}",
    description="Trajectories published, by finalize_reason and harness.")
failures = _meter.create_counter(
    "openforge.assembler.failures", unit="{trajectory}",
    description="Trajectories published without a scored result, by failure reason and whether the "
                "infrastructure caused it (those are left out of group statistics).")
merge_calls = _meter.create_counter(
    "openforge.assembler.merge.calls", unit="{call}",
    description="Calls that went into samples (the denominator of the break rate), by harness.")
merge_breaks = _meter.create_counter(
    "openforge.assembler.merge.breaks", unit="{call}",
    description="Calls whose prompt did not extend the previous context and started a new sample, by harness "
                "and drift reason.")
tool_results = _meter.create_counter(
    "openforge.assembler.tool.results", unit="{result}",
    description="Tool results the harnesses sent back, by harness.")
tool_errors = _meter.create_counter(
    "openforge.assembler.tool.errors", unit="{result}",
    description="Tool results marked as errors, by harness and whether a later call of the same tool succeeded "
                "(recovered).")
duplicates = _meter.create_counter(
    "openforge.assembler.duplicates", unit="{event}",
    description="Events dropped as duplicates (same event_id, or a second reward), by topic.")
late_events = _meter.create_counter(
    "openforge.assembler.late_events", unit="{event}",
    description="Events for a rollout already finalized; dead-lettered, by topic.")
replayed_events = _meter.create_counter(
    "openforge.assembler.replayed_events", unit="{event}",
    description="Events re-read after a restart for rollouts already published; ignored.")
dead_letters = _meter.create_counter(
    "openforge.assembler.dead_letters", unit="{record}",
    description="Records sent to the dead-letter topic, by error_type.")
reward = _meter.create_histogram(
    "openforge.assembler.reward", unit="{reward}",
    description="Verifier reward of each published trajectory that has one, by task.",
    explicit_bucket_boundaries_advisory=[-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0])
oversized = _meter.create_counter(
    "openforge.assembler.oversized", unit="{trajectory}",
    description="Trajectories too large for the topic, published without samples.")


class _Counted(Protocol):
    @property
    def open_count(self) -> int: ...


_tables: weakref.WeakSet[_Counted] = weakref.WeakSet()


def _observe(_options: CallbackOptions) -> Iterable[Observation]:
    yield Observation(sum(table.open_count for table in list(_tables)))


# One gauge for the process, summing every live table: instruments must be created once, and a
# callback must not keep a stopped service alive.
_meter.create_observable_gauge("openforge.assembler.open_rollouts", callbacks=[_observe], unit="{rollout}",
                               description="Rollouts joined but not yet finalized.")


def observe_open_rollouts(table: _Counted) -> None:
    """Count ``table``'s open rollouts in the ``open_rollouts`` gauge while it lives."""
    _tables.add(table)
