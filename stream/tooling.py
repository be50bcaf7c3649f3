"""Operator tooling over topics: tail, replay to a topic or a JSONL file and back, and re-drive dead letters.

Records are handled as raw bytes end to end, so a replay is byte-exact (keys,
values and headers) whatever the records hold, including undecodable ones. The one exception is
what a person reads: ``tail`` and ``replay --to-file`` show call events whole, their prompts
stored by reference to an earlier call rebuilt (:class:`~schemas.call.linear.WholeCalls`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from schemas import DeadLetterV1, DecodeError, EventBase, ModelCallV1, PackedArray, decode, encode
from schemas.call.linear import UnresolvedPrefixError, WholeCalls
from stream.admin import KafkaAdmin
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import TopicRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawRecord:
    """A record as stored in Kafka, independent of its content."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_consumer(cls, record: ConsumerRecord[bytes, bytes]) -> RawRecord:
        """Copy what matters out of an aiokafka record."""
        return cls(record.topic, record.partition, record.offset, record.timestamp, record.key,
                   record.value, tuple((k, v) for k, v in (record.headers or ())))

    def header(self, name: str) -> str | None:
        """The first header ``name`` as text, if present."""
        for key, value in self.headers:
            if key == name:
                return value.decode("utf-8", "replace")
        return None

    def decode(self) -> EventBase:
        """Decode through the schema registry (raises ``DecodeError``)."""
        return decode(self.headers, self.value if self.value is not None else b"")

    def to_json_line(self) -> bytes:
        """One JSONL line; text stays readable, other bytes go as base64."""
        doc: dict[str, Any] = {
            "topic": self.topic, "partition": self.partition, "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "key": _pack_bytes(self.key), "value": _pack_bytes(self.value),
            "headers": [[k, _pack_bytes(v)] for k, v in self.headers],
        }
        return orjson.dumps(doc) + b"\n"

    @classmethod
    def from_json_line(cls, line: bytes | str) -> RawRecord:
        """Parse a line written by :meth:`to_json_line`.

        Raises:
            ValueError: the line is not such a record (message says which field).
        """
        try:
            doc = orjson.loads(line)
            return cls(
                str(doc.get("topic", "")), int(doc.get("partition", -1)), int(doc.get("offset", -1)),
                int(doc.get("timestamp_ms", 0)), _unpack_bytes(doc.get("key")),
                _unpack_bytes(doc.get("value")),
                tuple((str(k), _unpack_bytes(v) or b"") for k, v in doc.get("headers", [])),
            )
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a replay record: {exc}") from exc


def _pack_bytes(data: bytes | None) -> str | dict[str, str] | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(data).decode()}


def _unpack_bytes(doc: Any) -> bytes | None:
    if doc is None:
        return None
    if isinstance(doc, str):
        return doc.encode("utf-8")
    if isinstance(doc, dict) and isinstance(doc.get("b64"), str):
        return base64.b64decode(doc["b64"], validate=True)
    raise ValueError(f"bad bytes field {doc!r}")


@dataclass(frozen=True)
class Range:
    """Which records of a topic to read. Offsets are inclusive start, exclusive stop."""

    partitions: tuple[int, ...] | None = None
    from_offset: int | None = None
    to_offset: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    last: int | None = None
    """Only the newest ``last`` records of each partition (tail's default view)."""


async def read_topic(
    settings: KafkaSettings, topic: str, rng: Range = Range(), *, follow: bool = False,
    isolation_level: str = "read_committed", stop: asyncio.Event | None = None,
) -> AsyncIterator[RawRecord]:
    """Yield the records of ``topic`` in ``rng``, partition by partition in offset order.

    Without ``follow`` it stops at the end offsets seen at start (or ``to_offset``,
    ``until``); with ``follow`` it keeps waiting for new records until ``stop`` is set.

    Raises:
        KeyError: the topic does not exist.
    """
    async with KafkaAdmin(settings) as admin:
        tps = await admin.partitions(topic)
    if rng.partitions is not None:
        tps = [tp for tp in tps if tp.partition in rng.partitions]
    consumer = AIOKafkaConsumer(
        **settings.client_kwargs(), client_id=f"{settings.client_id}-tooling",
        enable_auto_commit=False, isolation_level=isolation_level,
        max_partition_fetch_bytes=64 * 1024 * 1024, fetch_max_bytes=64 * 1024 * 1024,
    )
    try:
        await consumer.start()
        await asyncio.sleep(0)  # see KafkaAdmin.start: lets aiokafka's background task begin
        consumer.assign(tps)
        begins = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        starts, stops = dict(begins), dict(ends)
        if rng.since is not None:
            found = await consumer.offsets_for_times({tp: int(rng.since.timestamp() * 1000) for tp in tps})
            starts = {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}
        if rng.until is not None:
            found = await consumer.offsets_for_times({tp: int(rng.until.timestamp() * 1000) for tp in tps})
            stops = {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}
        if rng.from_offset is not None:
            starts = {tp: max(begins[tp], rng.from_offset) for tp in tps}
        if rng.to_offset is not None:
            stops = {tp: min(stops[tp], rng.to_offset) for tp in tps}
        if rng.last is not None:
            starts = {tp: max(starts[tp], stops[tp] - rng.last) for tp in tps}
        for tp in tps:
            consumer.seek(tp, starts[tp])
        bounded = not follow or rng.to_offset is not None or rng.until is not None
        active = {tp for tp in tps if not bounded or starts[tp] < stops[tp]}
        while active and not (stop is not None and stop.is_set()):
            if bounded:
                # Control records (transaction markers) take offsets too: ask where we are.
                for tp in list(active):
                    if await consumer.position(tp) >= stops[tp]:
                        active.discard(tp)
                if not active:
                    break
            batches = await consumer.getmany(*active, timeout_ms=500, max_records=500)
            for tp, records in batches.items():
                for record in records:
                    if bounded and record.offset >= stops[tp]:
                        active.discard(tp)
                        break
                    yield RawRecord.from_consumer(record)
    finally:
        await consumer.stop()


def _readable(value: Any, full: bool) -> Any:
    """Packed arrays become lists (shortened unless ``full``); long text is shortened too."""
    if isinstance(value, PackedArray):
        items = list(value)
        if full or len(items) <= 12:
            return items
        return [*items[:8], f"… {len(items):,} {type(value).__name__} in all"]
    if isinstance(value, dict):
        return {k: _readable(v, full) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_readable(v, full) for v in value]
    if isinstance(value, bytes):
        return _pack_bytes(value)
    if isinstance(value, str) and not full and len(value) > 400:
        return value[:300] + f"… ({len(value):,} chars)"
    return value


def format_record(record: RawRecord, *, full: bool = False, calls: WholeCalls | None = None) -> str:
    """Human-readable rendering: a header line, then the event as indented JSON.

    With ``calls`` (fed every record read, in order), a call is shown whole; one whose prompt
    prefix is not resolved (its call is before the records read) is shown as stored, and says so.
    """
    when = datetime.fromtimestamp(record.timestamp_ms / 1000).astimezone().isoformat(timespec="milliseconds")
    key = record.key.decode("utf-8", "replace") if record.key is not None else "-"
    head = f"{record.topic}[{record.partition}]@{record.offset}  key={key}  {when}"
    try:
        event = record.decode()
    except DecodeError as exc:
        preview = (record.value or b"")[:200]
        return f"{head}  UNDECODABLE ({exc.kind}): {exc.reason}\n  {preview!r}"
    if calls is not None and isinstance(event, ModelCallV1):
        try:
            event = calls.whole(event)
        except UnresolvedPrefixError as exc:
            head += f"  prompt prefix not rebuilt ({exc})"
    body = _readable(event.model_dump(), full)
    text = orjson.dumps(body, option=orjson.OPT_INDENT_2).decode()
    return f"{head}  {type(event).SCHEMA} v{type(event).VERSION}\n{text}"


def record_matches(record: RawRecord, *, key: str | None, schema: str | None) -> bool:
    """Filter used by tail: record key equals ``key``; schema header equals ``schema``."""
    if key is not None and (record.key or b"").decode("utf-8", "replace") != key:
        return False
    return schema is None or record.header("schema") == schema


async def replay_to_topic(
    settings: KafkaSettings, records: AsyncIterator[RawRecord] | Iterator[RawRecord], dest: str,
    *, keep_partition: bool = False, progress: Callable[[int], None] | None = None,
) -> int:
    """Produce ``records`` unchanged (key, value, headers) to ``dest``; return the count.

    Partitioning follows the key as for any producer, unless ``keep_partition``.
    """
    count = 0
    async with EventProducer(settings) as producer:
        pending = []
        async for record in _aiter(records):
            pending.append(await producer.send_raw(
                dest, record.value, key=record.key, headers=record.headers,
                partition=record.partition if keep_partition else None,
            ))
            count += 1
            if len(pending) >= 1000:
                await asyncio.gather(*pending)
                pending.clear()
                if progress:
                    progress(count)
        await asyncio.gather(*pending)
    if progress:
        progress(count)
    return count


_KAFKA_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


REDRIVEN_BY_DEFAULT = frozenset({"refused_by_broker", "handler_error"})
"""The letters whose records can go again as they are once their cause is gone (a topic's size
limit raised, a consumer fixed). Undecodable or invalid records would only be dead-lettered again
by every consumer, so they are re-driven only when asked for by name."""


@dataclass
class Redriven:
    """What :func:`redrive` did with each dead letter it read."""

    sent: Counter[str] = field(default_factory=Counter)
    """Records sent again and acknowledged (with ``dry_run``: that would be sent), per destination topic."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Letters left alone, per reason (filtered out, cut short, not a Kafka record, not a letter)."""
    failed: list[str] = field(default_factory=list)
    """Records that were not (or would not be) taken, with the letter's place and the reason; the rest went on."""
    resume: dict[int, int] = field(default_factory=dict)
    """Per dead-letter partition read, where a later run starts: after the last letter read, or at
    the first one whose record was not taken."""
    interrupted: bool = False
    """The run was stopped before the end of its range."""

    @property
    def read(self) -> int:
        """Letters read so far."""
        return sum(self.sent.values()) + sum(self.skipped.values()) + len(self.failed)


async def redrive(
    settings: KafkaSettings, letters: AsyncIterator[RawRecord], *, error_types: frozenset[str] = REDRIVEN_BY_DEFAULT,
    topics: set[str] | None = None, to_topic: str | None = None, dry_run: bool = False,
    progress: Callable[[Redriven], None] | None = None, stop: asyncio.Event | None = None,
) -> Redriven:
    """Send the records held by dead letters back to their topics (or ``to_topic``), as they were.

    A dead letter keeps its record byte for byte (key, value, headers), so once the cause is
    gone the record can go where it was headed. Letters are taken in offset order per partition;
    those whose value was cut short to fit the dead-letter topic, and raw journal records (a
    capture that made no valid event, under a name no Kafka topic can have), are skipped and
    counted. A record is refused, and the run goes on, when its destination does not exist or
    does not take its schema (raw sends skip the registry's checks), or when the broker refuses it.

    Args:
        settings: How to reach the cluster the records go to.
        letters: Records of the dead-letter topic (:func:`read_topic`).
        error_types: Only letters of these ``error_type`` values.
        topics: Only letters of records headed for these topics (all when None).
        to_topic: Send every record here instead of its own topic.
        dry_run: Count what would be sent and check where it would go; send nothing.
        progress: Called every 1,000 letters and at the end.
        stop: Set to end the run early (what was sent is still counted and settled).
    """
    done = Redriven()
    registry = TopicRegistry.from_settings(settings)
    pending: list[tuple[int, int, str, asyncio.Future[Any]]] = []
    exists: dict[str, bool] = {}

    def refused(partition: int, offset: int, why: str) -> None:
        done.failed.append(f"dead letter {partition}@{offset}: {why}")
        done.resume[partition] = min(done.resume.get(partition, offset), offset)

    async def settle() -> None:
        outcomes = await asyncio.gather(*(future for *_, future in pending), return_exceptions=True)
        for (partition, offset, dest, _), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                refused(partition, offset, repr(outcome))
            else:
                done.sent[dest] += 1
        pending.clear()

    async def where_to(record: RawRecord) -> tuple[str, DeadLetterV1] | None:
        """The destination and the letter, or None when the letter is skipped or refused (counted)."""
        try:
            letter = record.decode()
        except DecodeError:
            letter = None
        if not isinstance(letter, DeadLetterV1):
            done.skipped["not a dead letter"] += 1
        elif letter.error_type.value not in error_types:
            done.skipped[f"error type {letter.error_type.value}"] += 1
        elif topics is not None and letter.topic not in topics:
            done.skipped["another topic"] += 1
        elif letter.value_truncated:
            done.skipped["value cut short to fit the dead-letter topic"] += 1
        elif not _KAFKA_TOPIC.fullmatch(letter.topic):  # never on Kafka: no topic would know it
            done.skipped["a raw journal record, not a Kafka record"] += 1
        else:
            dest = to_topic or letter.topic
            if dest not in exists:
                exists[dest] = await _topic_exists(admin, dest)
            why = (f"topic {dest} does not exist" if not exists[dest]
                   else _not_declared(registry, dest, letter.headers))
            if why is None:
                return dest, letter
            refused(record.partition, record.offset, why)
        return None

    admin = KafkaAdmin(settings, registry)
    producer = None if dry_run else EventProducer(settings)
    await admin.start()
    try:
        if producer is not None:
            await producer.start()
        seen = 0
        async for record in letters:
            if stop is not None and stop.is_set():
                done.interrupted = True
                break
            seen += 1
            done.resume.setdefault(record.partition, record.offset + 1)
            if done.resume[record.partition] >= record.offset:  # no record before this one waits
                done.resume[record.partition] = record.offset + 1
            if (going := await where_to(record)) is not None:
                dest, letter = going
                if producer is None:
                    done.sent[dest] += 1  # would be
                else:
                    try:
                        future = await producer.send_raw(dest, letter.value, key=letter.key,
                                                         headers=letter.headers)  # type: ignore[arg-type]
                    except Exception as exc:  # noqa: BLE001 - the client's own checks: this record only
                        refused(record.partition, record.offset, repr(exc))
                    else:
                        pending.append((record.partition, record.offset, dest, future))
            if seen % 1000 == 0:
                await settle()
                if progress:
                    progress(done)
    finally:
        try:
            await settle()  # what was sent is counted, even when the run ends early
        finally:
            if producer is not None:
                await producer.stop()
            await admin.stop()
    if progress:
        progress(done)
    return done


async def _topic_exists(admin: KafkaAdmin, name: str) -> bool:
    try:
        await admin.partitions(name)
    except KeyError:
        return False
    return True


def _not_declared(registry: TopicRegistry, dest: str, headers: list[tuple[str, bytes | None]]) -> str | None:
    """Why an event may not go to ``dest`` (its schema is not the topic's), or None.

    Raw sends skip the registry's checks; a re-drive to the wrong topic (``--to-topic``) would
    put events where no consumer expects them.
    """
    topic = registry.by_name(dest)
    schema = next((value for name, value in headers if name == "schema"), None)
    if topic is None:
        return None
    if schema is None:
        return f"WrongTopicError: a record without a schema header does not go to {dest}"
    name = schema.decode("utf-8", "replace")
    if name in topic.spec.schemas:
        return None
    return f"WrongTopicError: {name} events do not go to {dest} (it takes {', '.join(topic.spec.schemas)})"


async def _aiter(records: AsyncIterator[RawRecord] | Iterator[RawRecord]) -> AsyncIterator[RawRecord]:
    if hasattr(records, "__aiter__"):
        async for record in records:
            yield record
    else:
        for record in records:
            yield record


async def whole_calls(records: AsyncIterator[RawRecord]) -> AsyncIterator[RawRecord]:
    """The records with each call event whose prompt is stored by reference re-encoded whole.

    Its key and headers stay as they were; a record that is not such a call, or whose reference
    does not resolve against the records before it, passes unchanged.
    """
    calls = WholeCalls()
    async for record in records:
        try:
            event = record.decode()
        except DecodeError:
            yield record
            continue
        if isinstance(event, ModelCallV1):
            try:
                whole = calls.whole(event)
            except UnresolvedPrefixError as exc:
                logger.warning("%s[%d]@%d kept as stored: %s", record.topic, record.partition, record.offset, exc)
            else:
                if whole is not event:
                    record = RawRecord(record.topic, record.partition, record.offset, record.timestamp_ms,
                                       record.key, encode(whole)[0], record.headers)
        yield record


async def write_jsonl(records: AsyncIterator[RawRecord], out: IO[bytes],
                      progress: Callable[[int], None] | None = None) -> int:
    """Write records as JSONL; return the count."""
    count = 0
    async for record in records:
        out.write(record.to_json_line())
        count += 1
        if progress and count % 1000 == 0:
            progress(count)
    if progress:
        progress(count)
    return count


def read_jsonl(path: Path) -> Iterator[RawRecord]:
    """Read a JSONL file written by :func:`write_jsonl`.

    Raises:
        ValueError: a line is malformed; the message names the file and line number.
    """
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield RawRecord.from_json_line(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc


__all__ = [
    "REDRIVEN_BY_DEFAULT", "Range", "RawRecord", "Redriven", "format_record", "read_jsonl", "read_topic",
    "record_matches", "redrive", "replay_to_topic", "whole_calls", "write_jsonl",
]

