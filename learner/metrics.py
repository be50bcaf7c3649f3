"""The learner's metric names, in one place, recorded through the OpenTelemetry API.

Without an SDK configured the instruments are no-ops; the same values also travel in each
``CheckpointV1.metrics`` so dashboards without a collector can plot training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry import metrics, trace

tracer = trace.get_tracer("openforge.learner")

STEPS = "openforge.learner.steps"
TOKENS = "openforge.learner.tokens"
TRAJECTORIES = "openforge.learner.trajectories"
DROPPED = "openforge.learner.dropped"
STALE_TOKENS = "openforge.learner.stale_tokens"
SKIPPED_STEPS = "openforge.learner.skipped_steps"
SHORT_GROUPS = "openforge.learner.short_groups"
STALENESS = "openforge.learner.staleness"
STEP_SECONDS = "openforge.learner.step.duration"
LOSS = "openforge.learner.loss"
ENTROPY = "openforge.learner.entropy"
IS_WEIGHT = "openforge.learner.importance_weight"
IS_WEIGHT_MAX = "openforge.learner.importance_weight.max"
IS_ESS = "openforge.learner.effective_sample_size"
REWARD_MEAN = "openforge.learner.reward.mean"
VERSION = "openforge.learner.version"

# Reasons a trajectory is not trained (the ``reason`` attribute of DROPPED).
DROP_STALE = "stale"
"""Every trained token of the trajectory was beyond the staleness bound."""
DROP_INFRA = "infrastructure_failure"
DROP_SMALL_GROUP = "small_group"
DROP_DUPLICATE = "duplicate"
DROP_NO_TOKENS = "no_trained_tokens"
DROP_ALIKE = "alike_group"
DROP_NONFINITE = "nonfinite_step"
"""Its step was skipped: the loss or the gradient was not finite."""
DROP_LATE = "late_member"
"""It arrived after its group had been released (trained or dropped) at its deadline."""

# Outcomes of a group released at its deadline with members missing (the ``outcome`` of SHORT_GROUPS).
SHORT_TRAINED = "trained"
SHORT_DROPPED = "dropped"

# Importance weights are ratios around 1: buckets fine near 1, coarse in the tails that truncation cuts.
_IS_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)


class LearnerMetrics:
    """Instruments of one learner process.

    The instruments are created with their names written out (module constants) so the chart's
    test can read them from the source and check every dashboard query against them.
    """

    def __init__(self) -> None:
        meter = metrics.get_meter("openforge.learner")
        self.steps = meter.create_counter(STEPS, unit="{step}", description="Optimizer steps taken")
        self.tokens = meter.create_counter(TOKENS, unit="{token}", description="Trained tokens")
        self.trajectories = meter.create_counter(TRAJECTORIES, unit="{trajectory}",
                                                 description="Trajectories trained")
        self.dropped = meter.create_counter(DROPPED, unit="{trajectory}",
                                            description="Trajectories not trained, by reason")
        self.stale_tokens = meter.create_counter(
            STALE_TOKENS, unit="{token}",
            description="Sampled tokens masked out of the loss for being older than the staleness bound")
        self.skipped_steps = meter.create_counter(
            SKIPPED_STEPS, unit="{step}", description="Steps skipped because the loss or gradient was not finite")
        self.short_groups = meter.create_counter(
            SHORT_GROUPS, unit="{group}",
            description="Groups released at their deadline with members missing, by outcome (trained, dropped)")
        self.staleness = meter.create_histogram(
            STALENESS, unit="{version}",
            description="Published versions between the learner and a trajectory's oldest token",
            explicit_bucket_boundaries_advisory=_STALENESS_BUCKETS)
        self.step_seconds = meter.create_histogram(STEP_SECONDS, unit="s", description="Wall time of one step")
        self.importance_weight = meter.create_histogram(
            IS_WEIGHT, description="Per-token importance weights (current over behaviour policy) of trained tokens",
            explicit_bucket_boundaries_advisory=_IS_BUCKETS)
        self._gauges = {
            "loss": meter.create_gauge(LOSS, description="Policy loss of the last step"),
            "entropy": meter.create_gauge(ENTROPY, description="Mean token entropy of the last batch"),
            "is_weight_max": meter.create_gauge(IS_WEIGHT_MAX,
                                                description="Largest importance weight of the last batch"),
            "is_ess": meter.create_gauge(IS_ESS, description="Kish effective sample size of the importance weights, "
                                                             "as a fraction of the batch's tokens"),
            "reward_mean": meter.create_gauge(REWARD_MEAN, description="Mean reward of the last batch"),
            "version": meter.create_gauge(VERSION, description="Newest weight version the learner has published"),
        }

    def record_step(self, values: Mapping[str, float], importance_weights: Sequence[float] = ()) -> None:
        """Record a step's scalar metrics (keys as in the worker's and trainer's dicts) and its IS weights."""
        for key, gauge in self._gauges.items():
            if key in values:
                gauge.set(values[key])
        for weight in importance_weights:
            self.importance_weight.record(weight)
