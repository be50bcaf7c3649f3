"""Producer throughput: ``EventProducer`` against raw aiokafka, same bytes, same config.

Run from the repository root with ``python -m bench.producer`` (``make bench``).

What is compared, in one process and one run:

* **wrapper**: ``await EventProducer.send(CALLS, event)`` for typed ``ModelCallV1`` events, so
  every event pays for the wrapper's work (topic resolution, schema check, ``schemas.encode``,
  size check, key, trace-context headers) before aiokafka queues it;
* **raw**: ``await AIOKafkaProducer.send(...)`` with the *same* records already encoded once
  with ``schemas.encode`` (identical value bytes, key and headers; checked before timing) and
  the same producer configuration (``acks=all``, idempotence, compression, ``linger_ms``,
  ``max_batch_size``, ``max_request_size``, ``request_timeout_ms``; also checked).

After one untimed warm-up pass (a quarter of the events per payload and side, so the broker's
JIT is warm before round 1), each timed run starts a fresh producer, publishes one warm-up record
(metadata, producer id), then sends N events back to back and waits for every acknowledgement;
the rate is N divided by the time from the first send to the last ack. Raw and wrapper runs
alternate (the order flips every round) and the table shows the median of the rounds, because
a shared machine is noisy.

Events come from a pool of distinct calls (different rollout ids, so keys spread over the
partitions, and different token ids, so zstd cannot fold repeated records inside a batch);
the pool is cycled to reach N. The wrapper re-encodes every send, as it does in production; an
encode cache keyed on the event object would make this benchmark flatter the wrapper. Two
payload sizes: small calls (200 prompt + 50 completion tokens, about 3 KB of JSON) and 100k-token
calls (100,000 prompt + 500 completion tokens, about 0.8 MB); the defaults (60,000 and 200
events per run) give a few seconds per run and about 1.5 to 2.5 minutes in all on two cores.

Columns: bytes/event is the uncompressed record value; ev/s is the median over the rounds;
ratio is wrapper over raw; MiB/s is uncompressed value bytes per second through the wrapper.
Below the table, the producer process's CPU time per event (median, all threads) shows how
much work the wrapper adds independently of how busy the machine was.

Topics: the registry's topics are created under a fresh ``bench<hex>.`` prefix with
``--partitions`` partitions each (3 by default: the local broker is a single node, and 3 keeps
several partition batches per produce request as in a real deployment; 1 gives one batch per
request). Without ``--bootstrap`` a private single-node broker is started on free ports in a
temporary folder and stopped at the end; with it, the given cluster is used and the prefixed
topics are left behind.

The goal is wrapper >= 80% of raw throughput per payload. Missing it is reported, not fatal:
the exit status is 0 unless something failed (broker, sends, checks).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from bench.broker import private_broker
from schemas import ModelCallV1, encode
from schemas.call.v1 import ApiProtocol, CallChoice, CallStatus, CallTimings, NormalizedRequest
from stream.admin import KafkaAdmin
from stream.broker import BROKER_MESSAGE_MAX_BYTES, LocalBroker
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CALLS

GOAL = 0.80
"""Wrapper throughput must be at least this fraction of raw aiokafka's."""

_MIB = 1024 * 1024

Record = tuple[bytes | None, bytes, list[tuple[str, bytes]]]
"""Key, value and headers of one pre-encoded record."""


@dataclass(frozen=True)
class Payload:
    """One row of the table: an event shape and how many events a run sends."""

    name: str
    prompt_tokens: int
    completion_tokens: int
    events: int
    pool: int
    """Distinct events cycled through to reach ``events``."""


@dataclass
class Row:
    """Measurements of one payload over all rounds."""

    payload: str
    events: int
    bytes_per_event: int
    raw_eps: list[float] = field(default_factory=list)
    wrapper_eps: list[float] = field(default_factory=list)
    raw_cpu_us: list[float] = field(default_factory=list)
    """Producer-process CPU time per event (all threads), one value per round."""
    wrapper_cpu_us: list[float] = field(default_factory=list)

    @property
    def raw(self) -> float:
        return statistics.median(self.raw_eps)

    @property
    def wrapper(self) -> float:
        return statistics.median(self.wrapper_eps)

    @property
    def cpu_us(self) -> tuple[float, float]:
        """Median producer CPU time per event: raw, wrapper."""
        return statistics.median(self.raw_cpu_us), statistics.median(self.wrapper_cpu_us)

    @property
    def ratio(self) -> float:
        return self.wrapper / self.raw

    @property
    def goal_met(self) -> bool:
        return self.ratio >= GOAL

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "raw_eps_median": self.raw,
            "wrapper_eps_median": self.wrapper,
            "raw_cpu_us_median": self.cpu_us[0],
            "wrapper_cpu_us_median": self.cpu_us[1],
            "ratio": self.ratio,
            "raw_mib_s": self.raw * self.bytes_per_event / _MIB,
            "wrapper_mib_s": self.wrapper * self.bytes_per_event / _MIB,
            "goal": GOAL,
            "goal_met": self.goal_met,
        }


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- events -------------------------------------------------------------------------------------


def model_call(prompt_tokens: int, completion_tokens: int, *, rollout_id: str, seed: int) -> ModelCallV1:
    """A successful chat call with random token ids, shaped like what the proxy records."""
    rng = random.Random(seed)
    return ModelCallV1(
        rollout_id=rollout_id,
        call_id=f"c-{seed:08d}",
        protocol=ApiProtocol.OPENAI_CHAT,
        model="bench-model",
        request=NormalizedRequest(messages=[{"role": "user", "content": "word " * (prompt_tokens // 2)}]),
        prompt_token_ids=[rng.randrange(150_000) for _ in range(prompt_tokens)],
        choices=[CallChoice(
            index=0,
            completion_token_ids=[rng.randrange(150_000) for _ in range(completion_tokens)],
            logprobs=[-rng.random() * 5 for _ in range(completion_tokens)],
            finish_reason="stop",
        )],
        timings=CallTimings(started_at=datetime.now(UTC), total_s=0.5),
        status=CallStatus.OK,
    )


def build_pool(payload: Payload) -> list[ModelCallV1]:
    return [
        model_call(payload.prompt_tokens, payload.completion_tokens, rollout_id=f"r-{i:05d}", seed=i)
        for i in range(payload.pool)
    ]


def pre_encode(events: Sequence[ModelCallV1]) -> list[Record]:
    records: list[Record] = []
    for event in events:
        value, headers = encode(event)
        records.append((event.kafka_key(), value, headers))
    return records


# -- producers ----------------------------------------------------------------------------------


def raw_producer(settings: KafkaSettings) -> AIOKafkaProducer:
    """aiokafka configured exactly as ``EventProducer`` configures it (checked at runtime)."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=settings.client_id,
        acks="all",
        enable_idempotence=True,
        compression_type=None if settings.compression == "none" else settings.compression,
        linger_ms=settings.linger_ms,
        max_batch_size=settings.batch_size_bytes,
        max_request_size=BROKER_MESSAGE_MAX_BYTES,
        request_timeout_ms=settings.request_timeout_ms,
    )


def _fingerprint(producer: AIOKafkaProducer) -> dict[str, Any]:
    """The settings that shape throughput, read back from a constructed aiokafka producer."""
    accumulator = getattr(producer, "_message_accumulator", None)
    sender = getattr(producer, "_sender", None)
    return {
        "compression": getattr(producer, "_compression_type", None),
        "max_request_size": getattr(producer, "_max_request_size", None),
        "request_timeout_ms": getattr(producer, "_request_timeout_ms", None),
        "idempotent": getattr(producer, "_txn_manager", None) is not None,
        "acks": getattr(sender, "_acks", None),
        "max_batch_size": getattr(accumulator, "_batch_size", None),
        "linger_s": getattr(accumulator, "_linger_time", None),
        "client_id": getattr(getattr(producer, "client", None), "_client_id", None),
    }


async def check_same_setup(settings: KafkaSettings, events: Sequence[ModelCallV1],
                           records: Sequence[Record]) -> dict[str, Any]:
    """Fail unless both sides use the same producer config and produce the same record bytes."""
    wrapper = EventProducer(settings)
    raw = raw_producer(settings)
    try:
        wrapper_config, raw_config = _fingerprint(wrapper.raw), _fingerprint(raw)
        if wrapper_config != raw_config:
            raise RuntimeError(f"producer configs differ: wrapper {wrapper_config} vs raw {raw_config}")
        topic = wrapper.topic(CALLS)
        for event, (key, value, headers) in zip(events, records, strict=True):
            if wrapper.encode(topic, event) != (key, value, headers):
                raise RuntimeError(f"wrapper and raw records differ for event {event.event_id}")
    finally:
        # Neither was started; closing the unstarted aiokafka clients keeps them quiet.
        await wrapper.raw.stop()
        await raw.stop()
    return wrapper_config


SendOne = Callable[[int], Any]


@dataclass(frozen=True)
class Timing:
    """One timed run: wall seconds from the first send to the last ack, and process CPU seconds."""

    wall_s: float
    cpu_s: float


async def _timed(send: SendOne, count: int) -> Timing:
    gc.collect()
    cpu, started = time.process_time(), time.perf_counter()
    futures = [await send(i) for i in range(count)]
    await asyncio.gather(*futures)
    return Timing(time.perf_counter() - started, time.process_time() - cpu)


async def run_raw(settings: KafkaSettings, topic: str, records: Sequence[Record], count: int) -> Timing:
    producer = raw_producer(settings)
    await producer.start()
    try:
        key, value, headers = records[0]
        await (await producer.send(topic, value=value, key=key, headers=headers))

        async def send(i: int) -> Any:
            key, value, headers = records[i % len(records)]
            return await producer.send(topic, value=value, key=key, headers=headers)

        return await _timed(send, count)
    finally:
        await producer.stop()


async def run_wrapper(settings: KafkaSettings, events: Sequence[ModelCallV1], count: int) -> Timing:
    async with EventProducer(settings) as producer:
        await producer.publish(CALLS, events[0])

        async def send(i: int) -> Any:
            return await producer.send(CALLS, events[i % len(events)])

        return await _timed(send, count)


# -- the benchmark ------------------------------------------------------------------------------


async def benchmark(settings: KafkaSettings, payloads: Sequence[Payload], rounds: int) -> tuple[
        list[Row], dict[str, Any]]:
    progress(f"creating registry topics under prefix {settings.topic_prefix!r} "
             f"({settings.partitions} partitions each)")
    async with KafkaAdmin(settings) as admin:
        await admin.create_topics()
    topic = f"{settings.topic_prefix}{CALLS.base_name}"

    pools: dict[str, tuple[list[ModelCallV1], list[Record]]] = {}
    rows: dict[str, Row] = {}
    config: dict[str, Any] = {}
    for payload in payloads:
        progress(f"building {payload.pool} distinct {payload.name} events")
        events = build_pool(payload)
        records = pre_encode(events)
        config = await check_same_setup(settings, events, records)
        pools[payload.name] = (events, records)
        size = round(statistics.mean(len(value) for _, value, _ in records))
        rows[payload.name] = Row(payload.name, payload.events, size)
    progress(f"producer config (both sides): {config}")

    # The broker's JIT and page cache warm up over the first runs; an untimed pass per payload
    # and side keeps that out of round 1.
    sent = 0
    for payload in payloads:
        events, records = pools[payload.name]
        count = max(1, payload.events // 4)
        progress(f"warm-up {payload.name:>5}: {count:,} events per side (untimed)")
        await run_raw(settings, topic, records, count)
        await run_wrapper(settings, events, count)
        sent += 2 * (count + 1)

    for round_no in range(rounds):
        for payload in payloads:
            events, records = pools[payload.name]
            row = rows[payload.name]
            order = ("raw", "wrapper") if round_no % 2 == 0 else ("wrapper", "raw")
            for side in order:
                progress(f"round {round_no + 1}/{rounds} {payload.name:>5} {side:<7} "
                         f"sending {payload.events:,} events ...")
                if side == "raw":
                    timing = await run_raw(settings, topic, records, payload.events)
                    eps, cpu = row.raw_eps, row.raw_cpu_us
                else:
                    timing = await run_wrapper(settings, events, payload.events)
                    eps, cpu = row.wrapper_eps, row.wrapper_cpu_us
                eps.append(payload.events / timing.wall_s)
                cpu.append(timing.cpu_s / payload.events * 1e6)
                sent += payload.events + 1  # the warm-up record too
                progress(f"round {round_no + 1}/{rounds} {payload.name:>5} {side:<7} "
                         f"{timing.wall_s:6.2f}s {eps[-1]:9,.0f} ev/s  "
                         f"client CPU {cpu[-1]:8,.0f} us/event "
                         f"({timing.cpu_s / timing.wall_s:.0%} of a core)")

    async with KafkaAdmin(settings) as admin:
        partitions = await admin.partitions(topic)
        stored = sum((await admin.end_offsets(partitions)).values())
    if stored != sent:
        raise RuntimeError(f"{topic} holds {stored:,} records but {sent:,} were acknowledged")
    progress(f"verified: {topic} holds all {stored:,} acknowledged records")
    return [rows[p.name] for p in payloads], config


def format_table(rows: Sequence[Row]) -> str:
    header = (f"{'payload':<8} {'events':>8} {'bytes/event':>12} {'raw ev/s':>10} {'wrapper ev/s':>13} "
              f"{'ratio':>6} {'MiB/s':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        mib_s = row.wrapper * row.bytes_per_event / _MIB
        lines.append(f"{row.payload:<8} {row.events:>8,} {row.bytes_per_event:>12,} {row.raw:>10,.0f} "
                     f"{row.wrapper:>13,.0f} {row.ratio:>6.2f} {mib_s:>8.1f}")
    lines.append("")
    lines.append("ev/s: median over rounds; ratio = wrapper/raw; "
                 "MiB/s = uncompressed values through the wrapper")
    for row in rows:
        verdict = "MET" if row.goal_met else "MISSED"
        lines.append(f"goal wrapper >= {GOAL:.0%} of raw, {row.payload}: {verdict} ({row.ratio:.0%})")
    for row in rows:
        raw_cpu, wrapper_cpu = row.cpu_us
        lines.append(f"producer CPU per event, {row.payload}: raw {raw_cpu:,.0f} us, "
                     f"wrapper {wrapper_cpu:,.0f} us ({wrapper_cpu - raw_cpu:+,.0f} us)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.producer", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="use this Kafka cluster instead of starting a private local broker")
    parser.add_argument("--rounds", type=int, default=3, help="raw/wrapper pairs per payload (default 3)")
    parser.add_argument("--small-events", type=int, default=60_000,
                        help="events per run of small calls (default 60000)")
    parser.add_argument("--large-events", type=int, default=200,
                        help="events per run of 100k-token calls (default 200)")
    parser.add_argument("--partitions", type=int, choices=(1, 3), default=3,
                        help="partitions of each benchmark topic (default 3)")
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.small_events < 1 or args.large_events < 1:
        parser.error("--rounds and event counts must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    payloads = [
        Payload("small", 200, 50, args.small_events, pool=min(args.small_events, 512)),
        Payload("100k", 100_000, 500, args.large_events, pool=min(args.large_events, 4)),
    ]
    with tempfile.TemporaryDirectory(prefix="openforge-bench-") as tmp:
        broker: LocalBroker | None = None
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            broker = private_broker(Path(tmp))
            progress(f"starting a private Kafka broker on {broker.bootstrap} ...")
            broker.start()
            bootstrap = broker.bootstrap
            progress(f"broker up after {time.perf_counter() - started:.1f}s")
        try:
            settings = KafkaSettings(
                bootstrap_servers=bootstrap,
                topic_prefix=f"bench{uuid.uuid4().hex[:10]}.",
                partitions=args.partitions,
            )
            rows, producer_config = asyncio.run(benchmark(settings, payloads, args.rounds))
        finally:
            if broker is not None:
                progress("stopping the broker")
                broker.stop()
    wall_s = time.perf_counter() - started

    print(format_table(rows))
    print(f"({args.rounds} rounds, {args.partitions} partition(s), compression={settings.compression}, "
          f"linger_ms={settings.linger_ms}, batch={settings.batch_size_bytes:,} B; wall {wall_s:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps({
            "goal": GOAL,
            "rounds": args.rounds,
            "partitions": args.partitions,
            "wall_s": wall_s,
            "bootstrap": "private local broker" if broker is not None else bootstrap,
            "producer_config": producer_config,
            "rows": [row.summary() for row in rows],
        }, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
