"""The learner's metric names, in one place, recorded through the OpenTelemetry API.

Without an SDK configured the instruments are no-ops; the same values also travel in each
``CheckpointV1.metrics`` so dashboards without a collector can plot training.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import metrics

STEPS = "openforge.learner.steps"
TOKENS = "openforge.learner.tokens"
TRAJECTORIES = "openforge.learner.trajectories"
DROPPED = "openforge.learner.dropped"
STALENESS = "openforge.learner.staleness"
STEP_SECONDS = "openforge.learner.step.duration"
LOSS = "openforge.learner.loss"
ENTROPY = "openforge.learner.entropy"
IS_WEIGHT_MEAN = "openforge.learner.is_weight.mean"
IS_WEIGHT_MAX = "openforge.learner.is_weight.max"
IS_ESS = "openforge.learner.is_weight.ess"
REWARD_MEAN = "openforge.learner.reward.mean"
VERSION = "openforge.learner.version"

# Reasons a trajectory is not trained (the ``reason`` attribute of DROPPED).
DROP_STALE = "stale"
DROP_INFRA = "infrastructure_failure"
DROP_SMALL_GROUP = "small_group"
DROP_DUPLICATE = "duplicate"
DROP_NO_TOKENS = "no_trained_tokens"

_GAUGES = {"loss": LOSS, "entropy": ENTROPY, "is_weight_mean": IS_WEIGHT_MEAN, "is_weight_max": IS_WEIGHT_MAX,
           "is_ess": IS_ESS, "reward_mean": REWARD_MEAN, "version": VERSION}


class LearnerMetrics:
    """Instruments of one learner process."""

    def __init__(self) -> None:
        meter = metrics.get_meter("openforge.learner")
        self.steps = meter.create_counter(STEPS, description="Optimizer steps taken")
        self.tokens = meter.create_counter(TOKENS, unit="{token}", description="Trained tokens")
        self.trajectories = meter.create_counter(TRAJECTORIES, description="Trajectories trained")
        self.dropped = meter.create_counter(DROPPED, description="Trajectories not trained, by reason")
        self.staleness = meter.create_histogram(
            STALENESS, unit="{version}", description="Versions between the learner and a trajectory's sampler")
        self.step_seconds = meter.create_histogram(STEP_SECONDS, unit="s", description="Wall time of one step")
        self._gauges = {key: meter.create_gauge(name) for key, name in _GAUGES.items()}

    def record_step(self, values: Mapping[str, float]) -> None:
        """Record a step's scalar metrics (keys as in the worker's and trainer's dicts)."""
        for key, gauge in self._gauges.items():
            if key in values:
                gauge.set(values[key])
