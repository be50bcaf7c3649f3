"""The proxy's journal shipper: CPU per call it ships, against shipping alone.

Run from the repository root with ``python -m bench.shipper``.

The proxy journals each whole answer as its raw engine exchange (the request it sent, the
engine's answer, a little metadata) and its shipper (``producers.shipper.Shipper``, on the proxy's
event loop) turns each record into the call's event and sends it to Kafka. Here the real shipper
runs in this process, as in the proxy, on journals of its own, sent to a private local broker,
the journals alternating round by round:

* **whole answers**: raw exchange records of one benchmark call (``--prompt-tokens`` and
  ``--completion-tokens``, the shape ``bench.proxy`` uses), as the proxy writes them;
* **built events** (the baseline): the same calls already made into their events, so the shipper
  only reads and sends them. The difference is what building an event costs.

Each is shipped two ways:

* **bulk**: ``--records`` records are journalled first, then the shipper ships them in batches
  of up to 1,024, as after a Kafka outage;
* **paced**: records are journalled at ``--rate`` per second for ``--seconds`` while the shipper
  ships them, as under steady load (the proxy's default linger between batches); the appends'
  own CPU is included, alike for both journals.

The figure is this process's CPU time (user and system) per record, from the start of shipping
to the last record's acknowledgement. The journals cycle through 97 calls, each of its own rollout
and with its own token ids. Medians over ``--rounds``. On a shared machine the absolute numbers
move from run to run; compare the two journals of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import orjson

from bench.broker import private_broker
from bench.fast_upstream import Canned
from bench.proxy import SYSTEM_PROMPT, progress
from producers.capture import CAPTURE_KEYS, CallCapture, cut_prompt_ids, normalize_request
from producers.journal import Journal
from producers.raw_calls import EngineExchange, Record, pack_raw_exchange, ship_record
from producers.shipper import Shipper
from proxy.settings import ProxySettings
from schemas.call.v1 import ApiProtocol
from stream import EventProducer, KafkaAdmin, KafkaSettings, LocalBroker, TopicRegistry

KEYS = 97


def whole_answers(prompt_tokens: int, completion_tokens: int) -> list[Record]:
    """:data:`KEYS` distinct benchmark calls' journal records, made as the proxy makes them.

    Each has its own rollout (so events spread over the partitions as the proxy's do) and its
    own token ids (so zstd cannot fold one call into the next).
    """
    return [pack_raw_exchange(capture, exchange, upstream_status_code=200, upstream_replica="http://127.0.0.1:8000")
            for capture, exchange in whole_answer_calls(prompt_tokens, completion_tokens, KEYS)]


def whole_answer_calls(prompt_tokens: int, completion_tokens: int,
                       count: int) -> list[tuple[CallCapture, EngineExchange]]:
    """``count`` distinct benchmark calls as the proxy holds them when it records each: the capture
    after the engine's answer, and the exchange as sent (capture fields added) and received."""
    base = orjson.loads(Canned(prompt_tokens, completion_tokens).whole.split(b"\r\n\r\n", 1)[1])
    chat = {"model": "bench-model", "max_tokens": 256, "temperature": 0.7, "messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Step 1: the test suite fails in tests/unit; find out why and fix it "
                                    "without changing the tests."}]}
    asked = {k: chat[k] for k in CAPTURE_KEYS if k in chat}
    sent = orjson.dumps({**chat, "logprobs": True, "return_token_ids": True, "return_weight_versions": True})
    calls = []
    for k in range(count):
        answer = {**base, "id": f"chatcmpl-bench-{k}",
                  "prompt_token_ids": [(t + 7919 * k) % 150_000 for t in base["prompt_token_ids"]],
                  "choices": [{**base["choices"][0],
                               "token_ids": [(t + 104_729 * k) % 150_000 for t in base["choices"][0]["token_ids"]]}]}
        raw = orjson.dumps(answer)
        capture = CallCapture(rollout_id=f"r-{k}", call_id=f"c-{k}", protocol=ApiProtocol.OPENAI_CHAT,
                              model="bench-model", request=normalize_request(chat, asked), streamed=False,
                              headers={"user-agent": "openforge-bench/1"})
        parsed, prompt_ids = cut_prompt_ids(raw)
        capture.prompt_ids_json = prompt_ids
        capture.on_response(orjson.loads(parsed))
        capture.weight_version = "0"
        calls.append((capture, EngineExchange(sent, raw, asked)))
    return calls


def _cpu() -> tuple[float, float]:
    times = os.times()
    return times.user, times.system


async def ship(kafka: KafkaSettings, registry: TopicRegistry, folder: Path, records: list[Record], *, bulk: int,
               rate: float, seconds: float) -> tuple[float, float]:
    """This process's CPU (user, system) µs per record shipping one journal, bulk (``bulk`` > 0) or paced."""
    journal = Journal(folder, 1 << 40)
    journal.open()
    shipper = Shipper(lambda: EventProducer(kafka, registry=registry, client_id="openforge-proxy"), journal,
                      registry, ack_timeout_s=10.0,
                      linger_s=ProxySettings.model_fields["journal_linger_ms"].default / 1000)

    def append(n: int) -> None:
        journal.append(*records[n % len(records)])
        shipper.wake()

    try:
        count = bulk
        for n in range(bulk):
            append(n)
        if not await shipper.connect():
            raise RuntimeError("the shipper could not reach Kafka")
        before = _cpu()
        runner = asyncio.create_task(shipper.run())
        if not bulk:
            started = time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds:
                while count < int(elapsed * rate):
                    append(count)
                    count += 1
                await asyncio.sleep(0.001)
        async with asyncio.timeout(120):
            while shipper.shipped < count - 1:
                if shipper.failed or runner.done():
                    raise RuntimeError("the shipper stopped before the journal was shipped")
                await asyncio.sleep(0.005)
        after = _cpu()
        shipper.stop_when_done()
        await runner
    finally:
        await shipper.close()
        journal.close()
    return (after[0] - before[0]) / count * 1e6, (after[1] - before[1]) / count * 1e6


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    broker: LocalBroker | None = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker = private_broker(tmp / "kafka")
        progress(f"starting a private Kafka broker on {broker.bootstrap} ...")
        broker.start()
        bootstrap = broker.bootstrap
    try:
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"benchship{uuid.uuid4().hex[:10]}.",
                              partitions=args.partitions, compression="zstd")
        async with KafkaAdmin(kafka) as admin:
            await admin.create_topics()
        raw = whole_answers(args.prompt_tokens, args.completion_tokens)
        registry = TopicRegistry.from_settings(kafka)
        built = [ship_record(registry, *record, 0) for record in raw]
        journals = {"whole answers": raw, "built events": built}
        results: dict[str, dict[str, list[tuple[float, float]]]] = {
            mode: {name: [] for name in journals} for mode in ("bulk", "paced")}
        # A short first pass warms the broker's JIT; it is not counted.
        await ship(kafka, registry, tmp / "warm", raw, bulk=min(args.records, 2000), rate=0, seconds=0)
        for round_ in range(args.rounds):
            order = list(journals) if round_ % 2 == 0 else list(reversed(journals))
            for mode in ("bulk", "paced"):
                for name in order:
                    figures = await ship(kafka, registry, tmp / uuid.uuid4().hex, journals[name],
                                         bulk=args.records if mode == "bulk" else 0, rate=args.rate,
                                         seconds=args.seconds)
                    results[mode][name].append(figures)
                    progress(f"round {round_ + 1}/{args.rounds} {mode:5} {name:18}: "
                             f"{sum(figures):6.1f} us/record (user {figures[0]:.1f}, system {figures[1]:.1f})")
        return results
    finally:
        if broker is not None:
            broker.stop()


def report(results: dict[str, dict[str, list[tuple[float, float]]]], args: argparse.Namespace) -> str:
    lines = [f"{'shipper CPU, us/record':38} {'user':>8} {'system':>8} {'total':>8}", "-" * 66]
    for mode, by_journal in results.items():
        for name, figures in by_journal.items():
            user = statistics.median(f[0] for f in figures)
            system = statistics.median(f[1] for f in figures)
            total = statistics.median(sum(f) for f in figures)
            lines.append(f"{mode + ', ' + name:38} {user:8.1f} {system:8.1f} {total:8.1f}")
        baseline = statistics.median(sum(f) for f in by_journal["built events"])
        building = statistics.median(sum(f) for f in by_journal["whole answers"]) - baseline
        lines.append(f"{mode + ', building the event':38} {'':8} {'':8} {building:8.1f}")
    lines.append(f"(bulk: {args.records:,} records journalled first; paced: {args.rate:,.0f} records/s for "
                 f"{args.seconds:g} s; {args.prompt_tokens} prompt / {args.completion_tokens} completion tokens per "
                 f"call; medians of {args.rounds} rounds)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.shipper", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="use this Kafka cluster instead of starting a private local broker")
    parser.add_argument("--records", type=int, default=20_000, help="records per bulk run (default 20,000)")
    parser.add_argument("--rate", type=float, default=1_700, help="records/s of a paced run (default 1,700)")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of a paced run (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="prompt ids per call (default 400)")
    parser.add_argument("--completion-tokens", type=int, default=32, help="completion ids per call (default 32)")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of each topic (default 3)")
    args = parser.parse_args(argv)
    if args.records < 1 or args.rate <= 0 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--records, --rate, --seconds and --rounds must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="openforge-bench-shipper-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    print(report(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
