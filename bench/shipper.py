"""The proxy's shipping worker: CPU per call it ships, against shipping alone.

Run from the repository root with ``python -m bench.shipper``.

The proxy journals each whole answer as its raw engine exchange (the request it sent, the
engine's answer, a little metadata) and its shipping worker (``producers.ship_worker``, the real
process, started as the proxy starts it) turns each record into the call's event and sends it to
Kafka. Two journals are shipped side by side, alternating, to a private local broker:

* **whole answers**: raw exchange records of one benchmark call (``--prompt-tokens`` and
  ``--completion-tokens``, the shape ``bench.proxy`` uses), as the proxy writes them;
* **built events** (the baseline): the same calls already made into their events, so the worker
  only reads and sends them. The difference is what building an event costs.

Each is shipped two ways:

* **bulk**: ``--records`` records are journalled first, then the worker ships them in batches
  of up to 1,024, as after a Kafka outage;
* **paced**: records are journalled at ``--rate`` per second for ``--seconds`` while the worker
  ships them, as under steady load (the proxy's default linger between batches).

The figure is the worker process's CPU time (user and system, from /proc) per record, from its
first report to the report that has the last record shipped. The journals cycle through 97 calls,
each of its own rollout and with its own token ids. Medians over ``--rounds``. On a shared
machine the absolute numbers move from run to run; compare the two journals of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import orjson

from bench.broker import private_broker
from bench.fast_upstream import Canned
from bench.proxy import SYSTEM_PROMPT, progress
from producers.capture import CAPTURE_KEYS, CallCapture, cut_prompt_ids, normalize_request
from producers.journal import Journal
from producers.raw_calls import EngineExchange, Record, pack_raw_exchange, ship_record
from producers.ship_worker import WorkerSpec
from proxy.settings import ProxySettings
from schemas.call.v1 import ApiProtocol
from stream import KafkaAdmin, KafkaSettings, LocalBroker, TopicRegistry

CLK_TCK = os.sysconf("SC_CLK_TCK")
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


def _cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


class Worker:
    """The shipping worker on one journal folder, started the way the proxy starts it."""

    def __init__(self, directory: Path, kafka: KafkaSettings) -> None:
        self.directory = directory
        self.kafka = kafka
        self.shipped = -1
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._progress = asyncio.Event()

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "producers.ship_worker", str(self.directory),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self._process.stdin is not None
        spec = WorkerSpec(self.kafka.worker_json(),
                          linger_s=ProxySettings.model_fields["journal_linger_ms"].default / 1000)
        self._process.stdin.write(orjson.dumps(asdict(spec)) + b"\n")
        self._reader = asyncio.create_task(self._follow())
        await self.until(-1)

    async def _follow(self) -> None:
        assert self._process is not None
        assert self._process.stdout is not None
        while line := await self._process.stdout.readline():
            report = orjson.loads(line)
            if report["failed"]:
                raise RuntimeError("the shipping worker found the journal damaged")
            self.shipped = int(report["shipped"])
            self._progress.set()

    async def until(self, seq: int, timeout_s: float = 120.0) -> None:
        """Wait for a report (the first one), then until ``seq`` is shipped."""
        async with asyncio.timeout(timeout_s):
            await self._progress.wait()
            while self.shipped < seq:
                self._progress.clear()
                await self._progress.wait()

    def cpu(self) -> tuple[float, float]:
        assert self._process is not None
        return _cpu(self._process.pid)

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            await asyncio.wait_for(self._process.wait(), 30)
        if self._reader is not None:
            self._reader.cancel()


async def ship(kafka: KafkaSettings, folder: Path, records: list[Record], *, bulk: int, rate: float,
               seconds: float) -> tuple[float, float]:
    """Worker CPU (user, system) µs per record for one journal, bulk (``bulk`` > 0) or paced."""
    journal = Journal(folder, 1 << 40, shipped_elsewhere=True)
    journal.open()

    def append(n: int) -> None:
        journal.append(*records[n % len(records)])

    worker = Worker(folder, kafka)
    try:
        if bulk:
            for n in range(bulk):
                append(n)
            journal.sync()
        await worker.start()
        before = worker.cpu()
        count = bulk
        if not bulk:
            started = time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds:
                while count < int(elapsed * rate):
                    append(count)
                    count += 1
                await asyncio.sleep(0.001)
        await worker.until(count - 1)
        after = worker.cpu()
    finally:
        await worker.stop()
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
        await ship(kafka, tmp / "warm", raw, bulk=min(args.records, 2000), rate=0, seconds=0)
        for round_ in range(args.rounds):
            order = list(journals) if round_ % 2 == 0 else list(reversed(journals))
            for mode in ("bulk", "paced"):
                for name in order:
                    figures = await ship(kafka, tmp / uuid.uuid4().hex, journals[name],
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
    lines = [f"{'shipping worker CPU, us/record':38} {'user':>8} {'system':>8} {'total':>8}", "-" * 66]
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
