"""Learner throughput: tokens/s fed from Kafka versus the same steps fed from an in-memory list.

Both runs train the tiny model from the same initial weights on the same synthetic trajectories
(tiny model vocabulary) with the same settings, in one process; the Kafka run reads them from a
private broker's trajectories topic. Tokens/s counts every token the forward passes processed
(prompt included) over the wall time from start to the last step. Goal: Kafka >= 80% of memory.

    python -m bench.learner [--groups 24] [--group-size 4] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.broker import private_broker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from trajectories import groups

from learner.settings import LearnerSettings
from learner.sources import ListTrajectorySource
from learner.trainer import Learner
from openforge.engine import make_tiny_model
from stream.admin import KafkaAdmin
from stream.broker import cache_root
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import TRAJECTORIES

GOAL = 0.8


async def _run(learner: Learner) -> tuple[float, int, int]:
    started = time.perf_counter()
    async with learner:
        await learner.wait()
        elapsed = time.perf_counter() - started
    return elapsed, learner.stats.processed_tokens, learner.stats.steps


async def benchmark(kafka: KafkaSettings, model: Path, n_groups: int, group_size: int, tmp: Path) -> None:
    data = groups(n_groups, group_size, prefix="bench", prompt_len=96, completion_len=64)
    steps = n_groups // 2
    base = dict(model_dir=model, lr=1e-4, groups_per_step=2, checkpoint_every=10_000, batch_wait_s=5.0,
                max_steps=steps, max_staleness=10_000)
    async with KafkaAdmin(kafka) as admin:
        await admin.create_topics()
    async with EventProducer(kafka) as producer:
        for t in data:
            await producer.send(TRAJECTORIES, t, key=t.task_id)
        await producer.flush()
    # Same steps each way; the order alternates so warm-up favours neither.
    mem = await _run(Learner(LearnerSettings(**base, checkpoint_dir=tmp / "m"),  # type: ignore[arg-type]
                             source=ListTrajectorySource(data)))
    kaf = await _run(Learner(LearnerSettings(**base, checkpoint_dir=tmp / "k"), kafka))  # type: ignore[arg-type]
    mem2 = await _run(Learner(LearnerSettings(**base, checkpoint_dir=tmp / "m2"),  # type: ignore[arg-type]
                              source=ListTrajectorySource(data)))
    rows = [("memory", *mem), ("kafka", *kaf), ("memory (again)", *mem2)]
    mem_rate = max(r[2] / r[1] for r in rows if r[0].startswith("memory"))
    print(f"{'source':16} {'steps':>5} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'vs memory':>9}")
    for name, seconds, tokens, n in rows:
        rate = tokens / seconds
        print(f"{name:16} {n:5d} {tokens:8d} {seconds:8.1f} {rate:9.0f} {rate / mem_rate:9.0%}")
    ratio = (kaf[1] / kaf[0]) / mem_rate
    print(f"kafka / memory = {ratio:.0%} (goal >= {GOAL:.0%}): {'met' if ratio >= GOAL else 'NOT met'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    model = make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")
    with tempfile.TemporaryDirectory(prefix="openforge-bench-learner-") as tmp:
        broker = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = private_broker(Path(tmp) / "k")
            broker.start()
            bootstrap = broker.bootstrap
        try:
            kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:8]}.",
                                  partitions=1)
            asyncio.run(benchmark(kafka, model, args.groups, args.group_size, Path(tmp)))
        finally:
            if broker is not None:
                broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
