"""Checkpoint publish latency: from the checkpoint event produced to vLLM answering with the new version.

Run from the repository root with ``python -m bench.publisher``.

What runs, all on 127.0.0.1: a private single-node Kafka broker (or ``--bootstrap``), one real vLLM
(CPU build) replica of the tiny model (or ``--replica URL``, which must serve that model and have
the dev-mode RL endpoints), and the publisher in this process. Two checkpoint folders are made from
the served weights (the embedding scaled by 1 and by 3), so consecutive publishes alternate
between two visibly different sets of weights. With ``--size 0.5b`` (or another of
``bench.random_qwen2``) the model is instead a random Qwen2 of that size made locally in bfloat16,
served in bfloat16, and the two folders are two seeds of it, each with the learner's digest
manifest.

Measured in one run:

1. baseline, straight at the replica: the raw ``reload_weights`` call alone, and the whole direct
   sequence (pause keep, reload, set version, resume), ``--count`` times each;
2. through the publisher, ``--count`` times: produce a CheckpointV1 (timed from just before the
   produce call), then poll ``/weight_info`` every 5 ms until it reports the new version (``version
   seen``), then send a one-token greedy chat completion; its answer ends the measurement
   (``answered``). The first-token logprob of every answer must equal the one the direct load of
   the same folder gave, so each measured answer really comes from the new weights.

3. what a publish costs serving (``--inflight N``): N more publishes while a long greedy answer
   streams; each one's longest wait between two tokens of that answer (the pause, the reload, and
   the recompute of the answer's context that the prefix-cache reset forces), against the median
   wait between its tokens away from publishes.

Reports median and p90 of each, and exits non-zero on any failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.broker import private_broker
from consumers.checkpoint_files import write_scaled_copy
from consumers.publisher import CheckpointPublisher, PublisherSettings
from schemas import CheckpointV1
from stream.admin import KafkaAdmin
from stream.broker import LocalBroker, cache_root, free_port
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def first_logprob(client: httpx.AsyncClient, url: str, model: str) -> float:
    response = await client.post(url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Which weights are these?"}],
        "max_tokens": 1, "temperature": 0, "logprobs": True})
    response.raise_for_status()
    return float(response.json()["choices"][0]["logprobs"]["content"][0]["logprob"])


async def direct_publish(client: httpx.AsyncClient, url: str, folder: Path, label: str) -> float:
    """The whole sequence straight at the engine (no cache reset); returns the raw reload call's seconds."""
    (await client.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"})).raise_for_status()
    started = time.perf_counter()
    (await client.post(url + "/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder)}})).raise_for_status()
    reload_s = time.perf_counter() - started
    (await client.post(url + "/update_weight_version", json={"new_version": label})).raise_for_status()
    (await client.post(url + "/resume")).raise_for_status()
    return reload_s


async def stream_tokens(url: str, model: str, arrivals: list[float]) -> None:
    """Long greedy answers, one after the other, each token's arrival appended (until cancelled)."""
    async with httpx.AsyncClient(timeout=600) as client:
        while True:
            body = {"model": model, "prompt": "The weights", "max_tokens": 900, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        arrivals.append(time.perf_counter())  # noqa: PERF401 (the time it arrived)


def model_folders(size: str, tiny: Path, python: Path) -> list[Path]:
    """Two random Qwen2 models of ``size`` (seeds 0 and 1) in bfloat16 with their digest manifests, made once."""
    from consumers.weight_digests import MANIFEST, write_manifest

    folders = []
    for seed in (0, 1):
        folder = cache_root() / "models" / f"random-qwen2-{size}-seed{seed}-bf16"
        if not (folder / MANIFEST).is_file():
            progress(f"making a random Qwen2 of {size} (seed {seed}) ...")
            script = ("import sys; from pathlib import Path; from bench.random_qwen2 import make_model; "
                      f"make_model(Path(sys.argv[1]), {size!r}, tokenizer_from=Path(sys.argv[2]), seed={seed})")
            subprocess.run([sys.executable, "-c", script, str(folder), str(tiny)], check=True)
            write_manifest(folder)
        folders.append(folder)
    return folders


async def measure(args: argparse.Namespace, url: str, model: Path, bootstrap: str, tmp: Path,
                  folders: list[Path] | None = None) -> dict[str, Any]:
    folders = folders or [write_scaled_copy(model, tmp / "ckpt-a", 1.0), write_scaled_copy(model, tmp / "ckpt-b", 3.0)]
    name = str(model)
    results: dict[str, list[float]] = {"raw reload_weights": [], "direct pause+reload+version+resume": [],
                                       "publish -> version seen": [], "publish -> answered": []}
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        expected: list[float] = []
        for folder in folders:  # the answer each folder gives, and a warm-up of both
            await direct_publish(client, url, folder, f"warm-{folder.name}")
            expected.append(await first_logprob(client, url, name))
        if expected[0] == expected[1]:
            failures.append("the two checkpoints give the same answer; the check would be blind")
        for i in range(args.count):
            started = time.perf_counter()
            results["raw reload_weights"].append(await direct_publish(client, url, folders[i % 2], f"direct-{i}"))
            results["direct pause+reload+version+resume"].append(time.perf_counter() - started)

        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"benchpub{uuid.uuid4().hex[:10]}.",
                              partitions=1, linger_ms=0)
        async with KafkaAdmin(kafka) as admin:
            await admin.create_topics()
        settings = PublisherSettings(replicas=[url], model=name, kafka=kafka, check_interval_s=60,
                                     group_id=f"benchpub-{uuid.uuid4().hex[:6]}", reference_weights=model)
        async with CheckpointPublisher(settings) as publisher, EventProducer(kafka) as producer:
            for i in range(args.count):
                version = i + 1
                folder = folders[i % 2]
                started = time.perf_counter()
                await producer.publish(CHECKPOINTS, CheckpointV1(model=name, version=version, uri=str(folder), step=i))
                deadline = started + 60
                while True:
                    info = (await client.get(url + "/weight_info")).json()
                    if info.get("weight_version") == str(version):
                        break
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"version {version} not seen within 60 s: {info}")
                    await asyncio.sleep(0.005)
                seen = time.perf_counter()
                answer = await first_logprob(client, url, name)
                answered = time.perf_counter()
                results["publish -> version seen"].append(seen - started)
                results["publish -> answered"].append(answered - started)
                if answer != expected[i % 2]:
                    failures.append(f"publish {version}: answer logprob {answer} is not {folder.name}'s "
                                    f"{expected[i % 2]}")
            gaps: list[float] = []
            typical = float("nan")
            if args.inflight:
                arrivals: list[float] = []
                streaming = asyncio.create_task(stream_tokens(url, name, arrivals))
                await asyncio.sleep(5)
                windows = []
                try:
                    for i in range(args.inflight):
                        version = args.count + i + 1
                        started = time.perf_counter()
                        await producer.publish(CHECKPOINTS, CheckpointV1(model=name, version=version,
                                                                         uri=str(folders[i % 2]), step=version))
                        deadline = started + 120
                        count = -1
                        while time.perf_counter() < deadline:
                            if count < 0 and (await client.get(url + "/weight_info")).json().get(
                                    "weight_version") == str(version):
                                count = len(arrivals)
                            if count >= 0 and len(arrivals) >= count + 3:  # the answer goes on after it
                                break
                            await asyncio.sleep(0.005)
                        else:
                            raise RuntimeError(f"version {version} not seen, or the answer stalled, within 120 s")
                        ended = time.perf_counter()
                        windows.append((started, ended))
                        gaps.append(max(b - a for a, b in itertools.pairwise(arrivals) if b >= started and a <= ended))
                        await asyncio.sleep(3)
                finally:
                    streaming.cancel()
                outside = [b - a for a, b in itertools.pairwise(arrivals)
                           if not any(b >= s and a <= e for s, e in windows)]
                typical = statistics.median(outside)
            state = publisher.replicas[url]
            if state.failures:
                failures.append(f"the publisher reported {state.failures} failed attempts")
    if gaps:
        results["longest token wait across a publish, in flight"] = gaps
    summary: dict[str, Any] = {
        "count": args.count, "failures": failures,
        "ms": {k: {"median": statistics.median(v) * 1e3, "p90": pct(v, 0.9) * 1e3} for k, v in results.items()}}
    if gaps:
        summary["typical token wait ms"] = typical * 1e3
    return summary


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from openforge.engine import LocalEngine, install_vllm, make_tiny_model

    engine: LocalEngine | None = None
    broker: LocalBroker | None = None
    folders: list[Path] | None = None
    try:
        if args.replica:
            url, model = args.replica.rstrip("/"), Path(args.model)
        else:
            python = install_vllm()
            model = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
            dtype = "float32"
            if args.size != "tiny":
                folders = await asyncio.to_thread(model_folders, args.size, model, python)
                model, dtype = folders[0], "bfloat16"
            engine = LocalEngine(model, free_port(), python, tmp / "vllm.log", dtype=dtype)
            progress(f"starting a vLLM replica (CPU build, {args.size} model, {dtype}) ...")
            await asyncio.to_thread(engine.start)
            url = engine.url
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            broker = private_broker(tmp / "kafka")
            progress("starting a private Kafka broker ...")
            await asyncio.to_thread(broker.start)
            bootstrap = broker.bootstrap
        progress(f"measuring {args.count} publishes against {url}")
        return await measure(args, url, model, bootstrap, tmp, folders)
    finally:
        if engine is not None:
            engine.stop()
        if broker is not None:
            broker.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20, help="publishes (and baseline reloads) to time")
    parser.add_argument("--bootstrap", help="use this Kafka cluster instead of a private broker")
    parser.add_argument("--replica", help="use this running vLLM replica instead of starting one")
    parser.add_argument("--model", help="with --replica: the served model's folder (its name on the server)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--size", default="tiny", help="tiny, or a random Qwen2 size of bench.random_qwen2 (0.5b ...)")
    parser.add_argument("--inflight", type=int, default=0, help="publishes to time while an answer streams")
    args = parser.parse_args(argv)
    if args.replica and not args.model:
        parser.error("--replica needs --model")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # coordinator chatter while the group forms
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="openforge-bench-publisher-") as tmp:
        try:
            summary = asyncio.run(run(args, Path(tmp)))
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            progress(f"ERROR: {exc}")
            return 1
    print(f"checkpoint publish, {args.size} model on vLLM CPU, {summary['count']} publishes "
          f"(wall {time.perf_counter() - started:.0f}s)")
    print(f"{'':40} {'median ms':>10} {'p90 ms':>10}")
    for key, row in summary["ms"].items():
        print(f"{key:50} {row['median']:10.1f} {row['p90']:10.1f}")
    if "typical token wait ms" in summary:
        print(f"{'typical token wait, away from publishes':50} {summary['typical token wait ms']:10.1f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    for failure in summary["failures"]:
        progress(f"ERROR: {failure}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
