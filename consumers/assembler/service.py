"""The assembler process: consume calls, lifecycle and rewards; publish trajectories exactly once.

Crash safety (the scheme, in full)
----------------------------------
A rollout's events span many offsets, and the trajectory is published long after its first event
was read, so "commit what was read" would lose open rollouts on a crash. Instead:

1. **Low watermark.** For each input partition the assembler commits the lowest offset any open
   (or recently closed, see ``closed_retention_s``) rollout still needs, or the read position when
   none does. Everything below it has been turned into published trajectories.
2. **One transaction per batch.** The trajectories finalized in a poll batch, the dead letters
   it produced and the new watermarks are sent in one Kafka transaction
   (``send_offsets_to_transaction``): outputs and progress become visible together or not at all.
   The transactional id is stable per instance, so a restarted instance fences its predecessor
   and aborts the transaction it left open.
3. **Replay without republishing.** After a crash the instance re-reads from the watermark and
   rebuilds every open rollout. Rollouts finalized after the watermark are re-read too; to
   recognise them, on every partition assignment the assembler reads back the trajectories topic
   (``read_committed``) from the timestamp of the first record it is about to re-read, minus
   ``replay_clock_skew_s``, and marks those rollout ids as published. Their events are then
   counted as replayed and ignored.

Trajectory ids are a function of the rollout id, so the one case this does not cover (an event
arriving after ``closed_retention_s`` *and* a restart before the watermark passes it, or a zombie
instance that lost its partitions but has not noticed yet) yields a copy the learner drops by id.
Dead letters are at-least-once: a replay can dead-letter the same record again.

Late events (after their rollout was finalized) are counted and dead-lettered with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace

from consumers.assembler import telemetry
from consumers.assembler.settings import AssemblerSettings
from consumers.assembler.state import Finalized, Outcome, RolloutTable
from schemas import DeadLetterErrorType, DeadLetterV1, DecodeError, ModelCallV1, decode
from schemas.call.linear import UnresolvedPrefixError, rebuild
from stream.lifecycle import Managed
from stream.producer import EventProducer, EventTooLargeError, encode_record
from stream.settings import KafkaSettings
from stream.telemetry import ConsumerLag, track_consumer_lag
from stream.topics import (
    CALLS,
    DEAD_LETTERS,
    REWARDS,
    ROLLOUTS,
    TRAJECTORIES,
    Topic,
    TopicRegistry,
    start_consumer,
)
from stream.tracing import extract_trace_context

__all__ = ["AssemblerService", "AssemblerStats", "encode_trajectory"]

_MAX_LINKS = 128
"""Call spans a trajectory span links to at most: the SDK's default link limit, which drops the rest anyway."""
_MAX_LINKED_ROLLOUTS = 100_000
"""Open rollouts whose call spans are kept; the oldest are forgotten first (revoked partitions' rollouts)."""

logger = logging.getLogger(__name__)

@dataclass
class AssemblerStats:
    """What this instance did since it started (for tests and logs; metrics carry the same)."""

    published: int = 0
    duplicates: int = 0
    late: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    transactions: int = 0
    rebuilds: int = 0
    read_back: int = 0


def encode_trajectory(topic: Topic, item: Finalized) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """Encode a trajectory for ``topic``; one too large for it goes out without its samples.

    Publishing the outcome (reward, merge stats) without samples keeps the group complete for the
    learner; blocking the partition on it would stop every rollout behind it.
    """
    try:
        key, value, headers = encode_record(topic, item.trajectory)
    except EventTooLargeError as exc:
        logger.error("assembler: rollout %s: %s; publishing it without samples", item.trajectory.rollout_id, exc)
        telemetry.oversized.add(1)
        key, value, headers = encode_record(topic, item.trajectory.model_copy(update={"samples": []}))
    return key, value, list(headers)


class AssemblerService(Managed):
    """Join rollouts into trajectories with exactly-once publication (see the module docstring).

    ``start()`` / ``wait()`` / idempotent ``stop()``, so :func:`stream.supervise` can run it.
    """

    def __init__(
        self,
        settings: AssemblerSettings | None = None,
        kafka: KafkaSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or AssemblerSettings()
        self.kafka = kafka or KafkaSettings()
        self.registry = TopicRegistry.from_settings(self.kafka)
        self.group_id = self.kafka.scoped(self.settings.group_id)
        self._inputs = [self.registry[CALLS], self.registry[ROLLOUTS], self.registry[REWARDS]]
        self._output = self.registry[TRAJECTORIES]
        self._clock = clock
        self.table = RolloutTable(self.settings.policy(), self.settings.tool_error_rules())
        self.stats = AssemblerStats()
        self._producer = EventProducer(
            self.kafka, registry=self.registry, transactional_id=self.kafka.scoped(self.settings.transactional_id),
            client_id=f"{self.kafka.client_id}-assembler",
        )
        largest = max(t.spec.max_message_bytes for t in self._inputs)
        self._consumer = AIOKafkaConsumer(
            **self.kafka.client_kwargs(),
            client_id=f"{self.kafka.client_id}-assembler",
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            # Range assignment gives one member partition i of every input topic: the events of
            # one rollout (same key, same partition number) meet in one instance.
            partition_assignment_strategy=(RangePartitionAssignor,),
            max_partition_fetch_bytes=largest,
            fetch_max_bytes=max(largest, 52_428_800),
            session_timeout_ms=self.settings.session_timeout_ms,
            request_timeout_ms=self.kafka.request_timeout_ms,
        )
        self._positions: dict[TopicPartition, int] = {}
        # Span contexts of the model calls joined per open rollout: the trajectory's span links to them.
        self._call_spans: dict[str, list[trace.SpanContext]] = {}
        self._lag: ConsumerLag | None = None
        self._committed: dict[TopicPartition, int] = {}
        self._letters: list[DeadLetterV1] = []
        self._lock = asyncio.Lock()  # one batch or one rebalance step at a time
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_commit = 0.0
        self._started = False
        self._stopped = False
        telemetry.observe_open_rollouts(self.table)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Fence any predecessor, join the group, and start consuming."""
        if self._started:
            return
        self._started = True
        # The producer first: registering the transactional id aborts whatever a crashed
        # predecessor left open, which would otherwise hold back read_committed reads (the
        # read-back of published trajectories included) until the transaction timeout.
        try:
            await self._producer.start()
            self._consumer.subscribe([t.name for t in self._inputs], listener=_Rebalance(self))
            await start_consumer(self._consumer, [t.name for t in self._inputs], self.kafka)
        except BaseException:
            self._stopped = True  # nothing runs: there is nothing left to stop
            with contextlib.suppress(Exception):
                await self._consumer.stop()  # never started if the producer's start failed
            try:
                await self._producer.stop()
            except Exception:  # the start's error is the one to see; this one is logged
                logger.exception("assembler: closing the producer after a failed start failed")
            raise
        self._lag = track_consumer_lag(self.group_id, self._consumer, lambda: self._positions)
        self._task = asyncio.create_task(self._run(), name=f"assembler:{self.group_id}")

    async def wait(self) -> None:
        """Return when the service stopped; re-raise what ended it, if anything did."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Finish the batch in hand, commit the watermark, leave the group. Idempotent.

        Open rollouts are not flushed: the committed watermark keeps them, and the next owner
        of their partitions rebuilds them.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._lag is not None:
            self._lag.close()
        try:
            if self._task is not None:
                done, _ = await asyncio.wait({self._task}, timeout=self.settings.drain_timeout_s)
                if not done:
                    logger.warning("assembler: drain deadline passed; cancelling the batch in hand")
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                failed = self._task.done() and not self._task.cancelled() and self._task.exception()
                if not failed:
                    async with self._lock:
                        await self._commit([], force=True)
        finally:
            await self._consumer.stop()  # leave the group: another member takes over at once
            await self._producer.stop()


    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            batches = await self._consumer.getmany(
                timeout_ms=self.settings.poll_timeout_ms, max_records=self.settings.max_poll_records
            )
            async with self._lock:
                now = self._clock()
                assignment = self._consumer.assignment()
                for tp, records in batches.items():
                    if tp not in assignment:
                        continue  # revoked while the fetch was in flight; the new owner reads it
                    for record in records:
                        await self._handle(tp, record, now)
                        self._positions[tp] = record.offset + 1
                await self._commit(self.table.due(now))

    async def _handle(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], now: float) -> None:
        headers = tuple((k, v) for k, v in (record.headers or ()))
        try:
            event = decode(headers, record.value)
        except DecodeError as exc:
            self._dead_letter(record, exc.kind, exc.reason)
            return
        topic = self.registry.by_name(record.topic)
        if topic is None or type(event).SCHEMA not in topic.spec.schemas:
            self._dead_letter(record, DeadLetterErrorType.INVALID_EVENT,
                              f"{type(event).SCHEMA!r} events do not belong on {record.topic}")
            return
        if (isinstance(event, ModelCallV1) and event.prompt_prefix is not None
                and not self.table.finished(event.rollout_id)):
            try:  # joined whole: the prefix from the call it references, read before it
                event = rebuild(event, self.table.call(event.rollout_id, event.prompt_prefix.call_id))
            except UnresolvedPrefixError as exc:
                self._dead_letter(record, DeadLetterErrorType.INVALID_EVENT, str(exc))
                return
        outcome = self.table.add(event, tp, record.offset, now)
        attributes = {"topic": topic.spec.base_name}
        if outcome is Outcome.ACCEPTED and isinstance(event, ModelCallV1):
            self._remember_call_span(event.rollout_id, headers)
        if outcome is Outcome.DUPLICATE:
            self.stats.duplicates += 1
            telemetry.duplicates.add(1, attributes)
        elif outcome is Outcome.REPLAYED:
            self.stats.replayed += 1
            telemetry.replayed_events.add(1, attributes)
        elif outcome is Outcome.LATE:
            self.stats.late += 1
            telemetry.late_events.add(1, attributes)
            rollout_id = getattr(event, "rollout_id", "?")
            self._dead_letter(record, DeadLetterErrorType.HANDLER_ERROR,
                              f"late event: rollout {rollout_id} was already finalized and published; "
                              "this event is not in its trajectory")

    def _remember_call_span(self, rollout_id: str, headers: tuple[tuple[str, bytes], ...]) -> None:
        """Keep the span context the call's record carried, for the trajectory span to link to."""
        context = trace.get_current_span(extract_trace_context(headers)).get_span_context()
        if not context.is_valid:
            return
        if rollout_id not in self._call_spans and len(self._call_spans) >= _MAX_LINKED_ROLLOUTS:
            del self._call_spans[next(iter(self._call_spans))]  # a rollout another instance took over
        spans = self._call_spans.setdefault(rollout_id, [])
        if len(spans) < _MAX_LINKS:
            spans.append(context)

    def _encode(self, item: Finalized) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
        """Encode a trajectory inside its own span, linked to the spans of the calls it joined.

        The record's headers carry this span's context (``encode_record`` injects the current one),
        so the learner step that trains on the trajectory links back to it, and through its links
        to each model call's proxy span.
        """
        trajectory = item.trajectory
        links = [trace.Link(c) for c in self._call_spans.pop(trajectory.rollout_id, [])]
        with telemetry.tracer.start_as_current_span(
                "assemble trajectory", kind=trace.SpanKind.PRODUCER, links=links,
                attributes={"openforge.rollout_id": trajectory.rollout_id, "openforge.task_id": trajectory.task_id,
                            "openforge.finalize_reason": trajectory.finalize_reason.value,
                            "openforge.calls": len(links)}):
            return encode_trajectory(self._output, item)

    def _dead_letter(self, record: ConsumerRecord[bytes, bytes], kind: DeadLetterErrorType, reason: str) -> None:
        logger.warning("assembler: dead-lettering %s[%d]@%d (%s): %s", record.topic, record.partition,
                       record.offset, kind.value, reason)
        room = self.registry[DEAD_LETTERS].spec.max_message_bytes * 3 // 4 - 64 * 1024
        value = record.value
        truncated = value is not None and len(value) > room
        self._letters.append(DeadLetterV1(
            topic=record.topic, partition=record.partition, offset=record.offset,
            timestamp_ms=record.timestamp, key=record.key,
            value=value[:room] if truncated and value is not None else value, value_truncated=truncated,
            headers=[(k, v) for k, v in (record.headers or ())],
            error_type=kind, reason=reason, consumer_group=self.group_id,
        ))

    async def _commit(self, finalized: list[Finalized], *, force: bool = False) -> None:
        """Publish trajectories and dead letters with the new watermarks, in one transaction."""
        assignment = self._consumer.assignment()
        offsets = {tp: self.table.watermark(tp, pos) for tp, pos in self._positions.items() if tp in assignment}
        moved = {tp: off for tp, off in offsets.items() if self._committed.get(tp) != off}
        now = self._clock()
        idle = not finalized and not self._letters
        if idle and (not moved or (not force and now - self._last_commit < self.settings.commit_interval_s)):
            return
        records = [self._encode(f) for f in finalized]
        letters = [self._producer.encode(self.registry[DEAD_LETTERS], letter) for letter in self._letters]
        async with self._producer.transaction():
            for key, value, headers in records:
                await self._producer.send_raw(self._output.name, value, key=key, headers=headers)
            for key, value, headers in letters:
                await self._producer.send_raw(self.registry[DEAD_LETTERS].name, value, key=key, headers=headers)
            if offsets:
                await self._producer.send_offsets_to_transaction(offsets, self.group_id)
        self._committed.update(offsets)
        self._last_commit = now
        self.stats.transactions += 1
        self.stats.published += len(finalized)
        self.stats.dead_lettered += len(self._letters)
        for letter in self._letters:
            telemetry.dead_letters.add(1, {"error_type": letter.error_type.value})
        self._letters.clear()
        for item in finalized:
            self._record_metrics(item)

    def _record_metrics(self, item: Finalized) -> None:
        trajectory = item.trajectory
        harness = trajectory.harness or "unknown"
        telemetry.trajectories.add(1, {"finalize_reason": trajectory.finalize_reason.value, "harness": harness})
        failure = trajectory.failure_reason
        if failure is not None:
            telemetry.failures.add(1, {"reason": failure.value,
                                        "infrastructure": "true" if failure.is_infrastructure else "false"})
        if trajectory.reward is not None:
            telemetry.reward.record(trajectory.reward, {"task": trajectory.task_id})
        stats = trajectory.merge_stats
        used = stats.calls - stats.skipped
        if used:
            telemetry.merge_calls.add(used, {"harness": harness})
        for brk in item.built.breaks:
            reason = brk.reason.value if brk.reason is not None else "unknown"
            telemetry.merge_breaks.add(1, {"harness": harness, "reason": reason})
            logger.info("assembler: rollout %s (%s): call %s broke the prefix at token %d of %d (%s)",
                        trajectory.rollout_id, harness, brk.call_id, brk.common_prefix_tokens,
                        brk.context_tokens, reason)
        tools = trajectory.tool_use
        if tools is not None and tools.results:
            telemetry.tool_results.add(tools.results, {"harness": harness})
            for error in trajectory.tool_errors:
                telemetry.tool_errors.add(1, {"harness": harness, "recovered": "true" if error.recovered else "false"})

    # -- rebalances ---------------------------------------------------------------------------

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit the watermark of partitions leaving this instance, then forget their rollouts."""
        async with self._lock:
            try:
                await self._commit([], force=True)
            except Exception:
                logger.exception("assembler: commit on revoke failed; the next owner re-reads more")
            dropped = self.table.drop_partitions(revoked)
            for tp in revoked:
                self._positions.pop(tp, None)
                self._committed.pop(tp, None)
            if dropped:
                logger.info("assembler: handed %d open rollouts to the next owner", dropped)

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Learn which rollouts on the new partitions were already published (see module docs)."""
        if not assigned:
            return
        async with self._lock:
            started = time.monotonic()
            published = await self._read_back_published(assigned)
            self.table.remember_published(published)
            self.stats.rebuilds += 1
            self.stats.read_back += len(published)
            logger.info("assembler: assigned %d partitions; %d rollouts already published (%.1f s)",
                        len(assigned), len(published), time.monotonic() - started)

    async def _read_back_published(self, assigned: Iterable[TopicPartition]) -> set[str]:
        tps = sorted(assigned)
        committed = {tp: await self._consumer.committed(tp) for tp in tps}
        probe = AIOKafkaConsumer(
            **self.kafka.client_kwargs(),
            client_id=f"{self.kafka.client_id}-assembler-readback",
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=self._output.spec.max_message_bytes,
            fetch_max_bytes=max(self._output.spec.max_message_bytes, 52_428_800),
            request_timeout_ms=self.kafka.request_timeout_ms,
        )
        try:
            await probe.start()
            since_ms = await self._replay_start_ms(probe, tps, committed)
            if since_ms is None:
                return set()  # nothing to re-read, so nothing can be republished
            return await self._published_since(probe, since_ms)
        finally:
            await probe.stop()

    async def _replay_start_ms(self, probe: AIOKafkaConsumer, tps: list[TopicPartition],
                               committed: dict[TopicPartition, int | None]) -> int | None:
        """Timestamp of the earliest record this instance is about to re-read, less the skew."""
        probe.assign(tps)
        ends = await probe.end_offsets(tps)
        beginnings = await probe.beginning_offsets(tps)
        pending = set()
        for tp in tps:
            start = committed[tp] if committed[tp] is not None else beginnings[tp]
            if ends[tp] > start:
                probe.seek(tp, start)
                pending.add(tp)
        stamps: list[int] = []
        deadline = time.monotonic() + self.settings.rebuild_timeout_s
        while pending and time.monotonic() < deadline:
            batch = await probe.getmany(*pending, timeout_ms=200, max_records=len(pending))
            for tp, records in batch.items():
                if records and tp in pending:
                    stamps.append(records[0].timestamp)
                    pending.discard(tp)
                    probe.pause(tp)
            for tp in list(pending):
                if await probe.position(tp) >= ends[tp]:
                    pending.discard(tp)  # only aborted or control records were left
        if pending:
            raise TimeoutError(f"could not read the first pending record of {sorted(pending)} in time")
        if not stamps:
            return None
        return min(stamps) - int(self.settings.replay_clock_skew_s * 1000)

    async def _published_since(self, probe: AIOKafkaConsumer, since_ms: int) -> set[str]:
        tps = [TopicPartition(self._output.name, p) for p in range(self._output.partitions)]
        probe.assign(tps)
        found = await probe.offsets_for_times(dict.fromkeys(tps, max(since_ms, 0)))
        ends = await probe.end_offsets(tps)
        pending = set()
        for tp in tps:
            hit = found.get(tp)
            start = hit.offset if hit is not None else ends[tp]
            if start < ends[tp]:
                probe.seek(tp, start)
                pending.add(tp)
        published: set[str] = set()
        deadline = time.monotonic() + self.settings.rebuild_timeout_s
        while pending and time.monotonic() < deadline:
            batch = await probe.getmany(*pending, timeout_ms=200)
            for records in batch.values():
                for record in records:
                    try:
                        published.add(str(orjson.loads(record.value or b"{}")["rollout_id"]))
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        logger.warning("assembler: unreadable trajectory record at %s[%d]@%d",
                                       record.topic, record.partition, record.offset)
            for tp in list(pending):
                if await probe.position(tp) >= ends[tp]:
                    pending.discard(tp)
                    probe.pause(tp)
        if pending:
            raise TimeoutError(f"could not read back {sorted(pending)} within rebuild_timeout_s")
        return published


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: AssemblerService) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: object) -> None:
        await self._owner.on_revoked(set(revoked))  # type: ignore[call-overload]

    async def on_partitions_assigned(self, assigned: object) -> None:
        await self._owner.on_assigned(set(assigned))  # type: ignore[call-overload]
