"""Flight recorder page times on a run of 100k model calls.

Run from the repository root with ``python -m bench.ui`` (``--bootstrap HOST:PORT`` uses that cluster under a
fresh topic prefix and deletes the topics afterwards; without it a private broker starts).

What it does, on one machine:

1. Records a run of tool-using rollouts (``--calls`` model calls, five per rollout: four shell-tool turns,
   one in three failing and retried, then a final answer), four harnesses of which one moves a context
   message every turn (a merge break per call), rewards rising over the run, groups of eight and a learner
   step every eight groups. Trajectories are built by the assembler's own code (``RolloutTable``) and
   everything is produced to the topics as a run would.
2. Starts the UI in this process (``build_app``, uvicorn on a free port) on an empty index and times how long
   its consumer takes to follow every record into the index, asking for the runs page now and then while it
   does (page times under ingestion).
3. Times every page ``--repeat`` times once the index is complete: runs, rollouts (unfiltered, by harness, by
   drift reason, by reward, by a reward-curve point), a rollout (its calls and trajectory read back from
   Kafka), its token view, the learner steps, a step and the harness report. Rollouts and steps are drawn
   at random each time.

Prints p50, p95 and max per page, the ingestion rate and the index's size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from flight_events import Turn, tool_rollout

from bench.broker import private_broker
from consumers.assembler.state import RolloutTable
from openforge.ui.app import build_app
from openforge.ui.settings import UISettings
from schemas import LearnerStepV1, StepTrajectory, TrajectoryV1
from stream import CALLS, REWARDS, ROLLOUTS, STEPS, TRAJECTORIES, EventProducer, KafkaAdmin, KafkaSettings
from stream.broker import free_port

CREDENTIAL = "bench-ui-credential-0123456789"
HARNESSES = ("claude-code", "codex", "openclaw", "agent")
GROUP = 8
TOPIC_OF = {"model_call": CALLS, "rollout": ROLLOUTS, "reward": REWARDS}


def _turns(rng: random.Random) -> list[Turn]:
    turns: list[Turn] = []
    while len(turns) < 4:
        if rng.random() < 1 / 3 and len(turns) < 3:
            turns += [Turn("pytest -x", "FAILED test_x.py::test_one\nExit code: 1"),
                      Turn("pytest -x", "12 passed\nExit code: 0")]
        else:
            turns.append(Turn(f"grep -rn needle src/ | head -{len(turns) + 3}", "src/a.py:3: needle\nExit code: 0"))
    return [*turns[:4], Turn(text="Done: the tests pass.")]


async def record_run(kafka: KafkaSettings, calls: int, seed: int = 0) -> tuple[int, int, int]:
    """Produce the run; return (rollouts, trajectories, steps)."""
    rng = random.Random(seed)
    rollouts = calls // 5
    table = RolloutTable()
    tp = TopicPartition("calls", 0)
    offset = 0
    published: list[TrajectoryV1] = []
    steps = 0
    async with EventProducer(kafka) as producer:
        for i in range(rollouts):
            harness = HARNESSES[i % len(HARNESSES)]
            group, index = divmod(i, GROUP)
            reward = min(1.0, max(0.0, rng.gauss(0.2 + 0.6 * i / rollouts, 0.2)))
            recorded = tool_rollout(f"bench-r{i:06d}", _turns(rng), task_id=f"bench-task-{group:05d}", run_id="bench",
                                    harness=harness, group_index=index, group_size=GROUP, reward=round(reward, 3),
                                    start_s=i * 0.5, moving_context=harness == "openclaw",
                                    version=str(1 + i // (GROUP * 8)))
            for event in recorded.events():
                table.add(event, tp, offset, 0.0)
                offset += 1
                await producer.send(TOPIC_OF[type(event).SCHEMA], event)
            for done in table.due(1e9 + i):
                await producer.send(TRAJECTORIES, done.trajectory)
                published.append(done.trajectory)
            if len(published) >= GROUP * 8:
                steps += 1
                await producer.send(STEPS, LearnerStepV1(
                    model="tiny", step=steps, version=steps, duration_s=2.0 + rng.random(),
                    created_at=recorded.lifecycle[-1].created_at,
                    trajectories=[StepTrajectory(trajectory_id=t.trajectory_id, rollout_id=t.rollout_id,
                                                 task_id=t.task_id, group_index=t.group_index, reward=t.reward or 0.0,
                                                 advantage=rng.gauss(0, 1), trained_tokens=80, oldest_version=steps)
                                  for t in published],
                    metrics={"loss": rng.gauss(0.1, 0.02), "reward_mean": sum(t.reward or 0 for t in published) / 64,
                             "rollout_corr/kl": abs(rng.gauss(0.002, 0.001)), "staleness_mean": rng.random()},
                    importance_weights=sorted(rng.lognormvariate(0, 0.1) for _ in range(64))))
                published.clear()
            if i % 2000 == 1999:
                print(f"  produced {i + 1} rollouts ({(i + 1) * 5} calls)", file=sys.stderr)
        await producer.flush()
    return rollouts, rollouts, steps


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": 1000 * statistics.median(ordered), "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
            "max_ms": 1000 * ordered[-1], "n": len(ordered)}


async def _timed(client: httpx.AsyncClient, path: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = await client.get(path)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
    return elapsed, response


async def measure(kafka: KafkaSettings, index_path: Path, rollouts: int, steps: int, repeat: int) -> dict[str, Any]:
    port = free_port()
    app = build_app(UISettings(index_path=index_path, port=port, live_refresh_s=0), CREDENTIAL, kafka)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    index = app.state.ui.index
    results: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                     headers={"authorization": f"Bearer {CREDENTIAL}"}) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            started = time.perf_counter()
            during: list[float] = []
            while (index.value("SELECT count(trajectory_id) FROM rollouts") or 0) < rollouts \
                    or (index.value("SELECT count(*) FROM steps") or 0) < steps:
                await asyncio.sleep(2.0)
                elapsed, _ = await _timed(client, "/")
                during.append(elapsed)
                print(f"  indexed {index.ingested} records after {time.perf_counter() - started:.0f}s", file=sys.stderr)
            ingest_s = time.perf_counter() - started
            results["ingest"] = {"records": index.ingested, "seconds": ingest_s,
                                 "records_per_s": index.ingested / ingest_s}
            results["runs page while ingesting"] = _stats(during)
            runs = (await client.get("/")).text
            points = [p.replace("&amp;", "&")
                      for p in re.findall(r'<a href="(/rollouts\?run=[^"]+)" class="point"', runs)]
            ids = [r["rollout_id"] for r in index.rows("SELECT rollout_id FROM rollouts ORDER BY random() LIMIT ?",
                                                        (repeat,))]
            pages: dict[str, list[str]] = {
                "runs": ["/"] * repeat,
                "rollouts": ["/rollouts"] * repeat,
                "rollouts by harness": ["/rollouts?harness=codex"] * repeat,
                "rollouts by drift reason": ["/rollouts?drift=message_moved"] * repeat,
                "rollouts by reward": ["/rollouts?reward_min=0.9"] * repeat,
                "rollouts of a curve point": [points[i % len(points)] for i in range(repeat)],
                "rollout (calls read from Kafka)": [f"/rollouts/{r}" for r in ids],
                "token view (trajectory read from Kafka)": [f"/rollouts/{r}/tokens?sample=0" for r in ids],
                "learner steps": ["/steps"] * repeat,
                "learner step": [f"/steps/tiny/{random.randint(1, steps)}" for _ in range(repeat)],
                "harness report": ["/report/harnesses"] * repeat,
            }
            for name, paths in pages.items():
                await _timed(client, paths[0])  # warm: first read of its pages of the file
                results[name] = _stats([(await _timed(client, p))[0] for p in paths])
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
    results["index_bytes"] = sum(p.stat().st_size for p in index_path.parent.glob(index_path.name + "*"))
    return results


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="openforge-bench-ui-") as tmp:
        broker = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = private_broker(Path(tmp) / "kafka")
            broker.start()
            bootstrap = broker.bootstrap
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-ui-{uuid.uuid4().hex[:8]}.")
        try:
            async with KafkaAdmin(kafka) as admin:
                await admin.create_topics()
            started = time.perf_counter()
            rollouts, _, steps = await record_run(kafka, args.calls)
            produced_s = time.perf_counter() - started
            results = await measure(kafka, Path(tmp) / "index.sqlite", rollouts, steps, args.repeat)
            results["run"] = {"calls": rollouts * 5, "rollouts": rollouts, "steps": steps, "produced_s": produced_s}
            return results
        finally:
            if broker is not None:
                broker.stop()
            else:
                admin_client = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
                await admin_client.start()
                try:
                    names = [n for n in await admin_client.list_topics() if n.startswith(kafka.topic_prefix)]
                    await admin_client.delete_topics(names)
                finally:
                    await admin_client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="model calls in the run (five per rollout)")
    parser.add_argument("--repeat", type=int, default=20, help="requests per page")
    parser.add_argument("--bootstrap", default=None, help="use this Kafka cluster (topics deleted afterwards)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    run = results["run"]
    print(f"run: {run['calls']:,} calls, {run['rollouts']:,} rollouts, {run['steps']} learner steps "
          f"(produced in {run['produced_s']:.0f}s)")
    ingest = results["ingest"]
    print(f"ingestion: {ingest['records']:,} records in {ingest['seconds']:.0f}s "
          f"({ingest['records_per_s']:.0f}/s); index {results['index_bytes'] / 1e6:.0f} MB")
    print(f"{'page':42s} {'p50 ms':>8s} {'p95 ms':>8s} {'max ms':>8s}")
    for name, stats in results.items():
        if isinstance(stats, dict) and "p50_ms" in stats:
            print(f"{name:42s} {stats['p50_ms']:8.1f} {stats['p95_ms']:8.1f} {stats['max_ms']:8.1f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
