"""Learner throughput: tokens/s fed from Kafka versus the same steps fed from an in-memory list.

Both runs train the tiny model from the same initial weights on the same synthetic trajectories
(tiny model vocabulary) with the same settings, in one process; the Kafka run reads them from a
private broker's trajectories topic. Tokens/s counts every token the forward passes processed
(prompt included) over the wall time from start to the last step. Goal: Kafka >= 80% of memory.

    python -m bench.learner [--groups 24] [--group-size 4] [--bootstrap HOST:PORT]

With ``--step-time`` it instead times the real worker's step on this machine at a few batch sizes
and fits ``seconds = a + b x tokens`` (every token of the step's rows, prompts included), printed as
JSON; ``bench.loop`` simulates its learner's steps with that model.

    python -m bench.learner --step-time [--rows 16] [--prompt-tokens 128] [--completion-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class StepTimeFit:
    """``seconds = a + b x tokens`` for one learner step, and the timings it was fitted to."""

    a: float
    """Seconds of a step whatever its size (never negative)."""
    b: float
    """Seconds per token of the step's rows (prompt and completion)."""
    points: list[tuple[int, float]]
    """(tokens, seconds) of every timed step; the line is fitted to the fastest at each size."""


def fit_step_time(model: Path, rows: int, prompt_tokens: int, completion_tokens: int,
                  repeats: int = 2) -> StepTimeFit:
    """Time the ``hf`` worker's step on ``model`` at half, one and two times ``rows`` rows; fit a line.

    One untimed step first (allocations, the first call's set-up). Each size is timed ``repeats``
    times and the line goes through the fastest of each: on shared cores a slow repeat measures the
    neighbours, not the step, and the simulated step (a sleep) is not slowed by them. The rows are
    random ids of the model's vocabulary, each ``prompt_tokens + completion_tokens`` long with every completion token
    trained, as the loop benchmark's rows are.
    """
    from learner.protocol import Row, TrainBatch
    from learner.settings import LearnerSettings
    from learner.workers.hf import HFPolicyWorker

    worker = HFPolicyWorker(LearnerSettings(model_dir=model), model)
    vocab = int(getattr(worker.model.config, "vocab_size", 4096))
    rng = random.Random(0)

    def batch(n: int) -> TrainBatch:
        return TrainBatch([Row(input_ids=[rng.randrange(vocab) for _ in range(prompt_tokens + completion_tokens)],
                               prompt_len=prompt_tokens, loss_mask=[1] * completion_tokens,
                               behavior_logprobs=[-8.0] * completion_tokens, advantage=rng.random() - 0.5)
                           for _ in range(n)])

    worker.train_step(batch(rows))
    points: list[tuple[int, float]] = []
    for n in [max(1, rows // 2), rows, rows * 2] * repeats:
        step = batch(n)
        started = time.perf_counter()
        worker.train_step(step)
        points.append((step.total_tokens, time.perf_counter() - started))
    fastest: dict[int, float] = {}
    for tokens, seconds in points:
        fastest[tokens] = min(seconds, fastest.get(tokens, seconds))
    xs, ys = [float(x) for x in fastest], list(fastest.values())
    slope, intercept = statistics.linear_regression(xs, ys)
    if intercept < 0:  # noise on a busy machine; a step never takes less than nothing
        slope, intercept = sum(ys) / sum(xs), 0.0
    return StepTimeFit(a=intercept, b=slope, points=points)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--bootstrap", default=None)
    parser.add_argument("--step-time", action="store_true",
                        help="fit seconds = a + b x tokens of the real worker's step instead; print it as JSON")
    parser.add_argument("--rows", type=int, default=16, help="--step-time: rows of the middle batch size")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="--step-time: prompt tokens per row")
    parser.add_argument("--completion-tokens", type=int, default=32, help="--step-time: completion tokens per row")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    model = make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")
    if args.step_time:
        fit = fit_step_time(model, args.rows, args.prompt_tokens, args.completion_tokens)
        print(json.dumps(asdict(fit)))
        return 0
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
