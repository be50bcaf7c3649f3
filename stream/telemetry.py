"""Instruments every Kafka-reading process shares, named in this one place (OpenTelemetry API only).

Consumer lag is measured where the records are handled, not from committed offsets alone: the
assembler commits inside transactions, the learner stores offsets with checkpoints, so "handled
up to" is the one position every consumer in the project knows. Rollout outcomes are counted
here because two sides report them (the local backend in ``consumers`` and the pod watcher in
``producers``) and neither may import the other.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

__all__ = ["CONSUMER_LAG", "ROLLOUT_OUTCOMES", "ConsumerLag", "count_rollout_outcome", "track_consumer_lag"]

logger = logging.getLogger(__name__)

CONSUMER_LAG = "openforge.consumer.lag"
ROLLOUT_OUTCOMES = "openforge.rollout.outcomes"

_meter = metrics.get_meter("openforge.stream")
_rollout_outcomes = _meter.create_counter(
    ROLLOUT_OUTCOMES, unit="{rollout}",
    description="Finished rollouts, by outcome (phase), reason and whether infrastructure caused it.")


def count_rollout_outcome(phase: str, reason: str | None, infrastructure: bool) -> None:
    """Count one finished rollout (completed, failed, timed_out, ...) under its reason.

    Args:
        phase: The lifecycle phase that ended the rollout (``RolloutPhase`` value).
        reason: Why it ended (exit code name, eviction, deadline); ``none`` when not given.
        infrastructure: Whether the infrastructure, not the agent, caused the end (so dashboards can
            tell a broken cluster from a bad policy).
    """
    _rollout_outcomes.add(1, {"outcome": phase, "reason": reason or "none",
                              "infrastructure": "true" if infrastructure else "false"})


class ConsumerLag:
    """One consumer's lag source: records between its handled position and the partition's end.

    The end is the last stable offset for ``read_committed`` consumers (aborted and open
    transactions are not work to do) and the high watermark otherwise, both as the consumer's
    last fetch saw them; partitions not yet fetched or not yet handled are left out rather than
    guessed.
    """

    def __init__(self, group: str, consumer: AIOKafkaConsumer,
                 positions: Callable[[], Mapping[TopicPartition, int]]) -> None:
        self.group = group
        self._consumer = consumer
        self._positions = positions

    def lag(self) -> dict[str, int]:
        """Records behind, summed per topic over the partitions this consumer holds."""
        out: dict[str, int] = {}
        positions = dict(self._positions())  # a copy: the event loop may change it meanwhile
        for tp in list(self._consumer.assignment()):
            position = positions.get(tp)
            if position is None:
                continue
            end = self._consumer.last_stable_offset(tp)
            if end is None or end < 0:
                end = self._consumer.highwater(tp)
            if end is None or end < 0:
                continue
            out[tp.topic] = out.get(tp.topic, 0) + max(0, end - position)
        return out

    def close(self) -> None:
        """Stop reporting this consumer (its process part stopped)."""
        with _lock:
            _sources.discard(self)


_lock = threading.Lock()
_sources: weakref.WeakSet[ConsumerLag] = weakref.WeakSet()


def _observe_lag(_options: CallbackOptions) -> Iterable[Observation]:
    # Runs on the SDK's export thread: read under the lock, and let one broken source cost only itself.
    with _lock:
        sources = list(_sources)
    for source in sources:
        try:
            lags = source.lag()
        except Exception:  # a rebalance mid-read must not break every other metric
            logger.debug("lag of %s not readable now", source.group, exc_info=True)
            continue
        for topic, lag in lags.items():
            yield Observation(lag, {"group": source.group, "topic": topic})


# One gauge per process over every live consumer: instruments are created once, and a callback must
# not keep a stopped consumer alive.
_meter.create_observable_gauge(CONSUMER_LAG, callbacks=[_observe_lag], unit="{message}",
                               description="Records not yet handled, per consumer group and topic.")


def track_consumer_lag(group: str, consumer: AIOKafkaConsumer,
                       positions: Callable[[], Mapping[TopicPartition, int]]) -> ConsumerLag:
    """Report ``consumer``'s lag in the ``openforge.consumer.lag`` gauge while the returned object lives.

    Args:
        group: The consumer group (or, for group-less readers like the learner, a stable name for it).
        consumer: The aiokafka consumer whose fetches tell where each partition ends.
        positions: Next offset to handle, per partition (what the owner has fully handled).

    Returns:
        The source; keep a reference and ``close()`` it when the consumer stops.
    """
    source = ConsumerLag(group, consumer, positions)
    with _lock:
        _sources.add(source)
    return source
