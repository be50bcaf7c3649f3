"""Loop efficiency: asynchronous schedules against the synchronous one, on the real loop's parts.

    python -m bench.loop [--seconds 60] [--kafka HOST:PORT] [--step-model A,B | --measure-step] [--json PATH]
                         [--quick]

What runs, for each schedule in turn, all on this machine: a Kafka broker of its own (or
``--kafka``), the scripted engine (``bench.fast_upstream``: token ids, logprobs and its weight
version in every answer; it honours the publisher's pause, reload, version and resume calls), the
real proxy (``openforge proxy``, its own process), and in this process the real launcher (local
backend, with its pacing), assembler, learner loop and checkpoint publisher. The launcher runs
each rollout as two processes (``bench/loop_rollout.py``): a harness that sleeps its drawn
duration around its model calls, and a verifier that posts a reward. Durations are drawn once
per task from a seeded lognormal, a few of them ten times longer (stragglers), so every schedule
gets the same rollouts in the same order.

The learner is the real loop (grouping, staleness masking, batching, checkpoint and publish
cadence) with a worker that sleeps for the step time of the real ``hf`` worker on the same number
of tokens (``bench.loop_worker``): ``seconds = a + b x tokens``. By default that is the model
measured once on two quiet cores (``STEP_MODEL``, from ``python -m bench.learner --step-time``), so
that a run's simulated learner does not slow with the machine's other load and runs compare;
``--measure-step`` fits it again at start on this machine, ``--step-model`` gives one.

Schedules, all with the same rollout slots (``--slots``, the launcher's ``max_in_flight``):

* **asynchronous**: pacing as a user gets it, the learner's staleness bound at
  ``--max-staleness`` (2) and its checkpoint cadence at its default (a version every 10 steps;
  ``--checkpoint-every``): rollouts keep running while the learner trains.
* **asynchronous, every step**: the same with a version published after every step, where the
  bound is tightest (the launcher may have ``bound + 1`` batches out).
* **synchronous**: the same parts with the bound at 0 and a version every step, where pacing
  allows exactly one batch of rollouts at a time and waits until the engine serves the weights
  trained on it: generate a batch, train, publish, repeat.

Figures are taken over a window from the end of each schedule's first learner step to the end of
its last, ``--seconds`` long: trained tokens per second, the learner's idle fraction (neither
stepping nor writing a checkpoint), the rollout slots' idle fraction (a slot is busy from a
rollout's launch to its end), staleness of the trained trajectories (the age of each one's oldest
trained token, in published versions as the learner counts it, and in learner steps), and what
was dropped or masked, by reason. The window closes at the end of a step, so each schedule is
measured over whole cycles of its own; it waits for at least one step after the first.

Below the table, whole-run counts for each schedule (rollouts launched and ended, trajectories on
the topic, trained and dropped) show where every rollout went. ``--quick`` runs everything on
fewer, shorter rollouts with a given step model (about a minute and a half): it checks that the
benchmark works, and its figures are not to be quoted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.broker import private_broker
from bench.fast_upstream import MODEL
from bench.loop_worker import SimulatedWorker, StepTimeModel, Timeline
from bench.proxy import Process, wait_ready
from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from consumers.publisher import CheckpointPublisher, PublisherSettings
from consumers.rollouts.launcher import Launcher, LauncherSettings
from learner.grouping import Group
from learner.positions import Position
from learner.protocol import TrainBatch
from learner.settings import LearnerSettings
from learner.staleness import StalenessPolicy
from learner.trainer import Learner
from schemas import DecodeError, RolloutEventV1, TaskV1, TrajectoryV1
from schemas.rollout.v1 import RolloutPhase
from stream.admin import KafkaAdmin
from stream.broker import LocalBroker, cache_root, free_port
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.tooling import read_topic
from stream.topics import ROLLOUTS, TASKS, TRAJECTORIES, TopicRegistry

ROLLOUT_SCRIPT = Path(__file__).resolve().parent / "loop_rollout.py"
DURATIONS_ENV = "BENCH_LOOP_DURATIONS"

DEFAULT_CHECKPOINT_EVERY = LearnerSettings.model_fields["checkpoint_every"].default

GOAL_RATIO = 2.0
"""The asynchronous schedule's trained tokens/s over the synchronous one's."""
GOAL_LEARNER_IDLE = 0.05
"""The asynchronous schedule's learner idle fraction must stay below this."""

QUICK: dict[str, Any] = {"seconds": 6.0, "slots": 8, "groups_per_step": 2, "median_s": 0.3,
                         "step_model": "0.2,0.0001"}
"""What ``--quick`` changes: fewer and shorter rollouts, a short window, a shorter step."""

STEP_MODEL = StepTimeModel(0.19, 0.00055, "the hf worker on the tiny model, measured on two quiet cores, 2026-12-07")
"""The default learner step: ``python -m bench.learner --step-time`` at 16, 32 and 64 rows of 160 tokens
(3.0 s for a default step of 5,120 tokens). Measured at the start of runs on cores loaded ten times
over, the fit gave 10 to 20 s a step and swung the ratio between schedules with it."""

logger = logging.getLogger("bench.loop")


def progress(message: str) -> None:
    print(f"[bench.loop] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    """What one run does (the command line)."""

    seconds: float
    slots: int
    group_size: int
    groups_per_step: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    median_s: float
    sigma: float
    straggler_p: float
    straggler_x: float
    max_staleness: int
    checkpoint_every: int
    reload_s: float
    seed: int

    @property
    def batch_rollouts(self) -> int:
        """Rollouts per learner step."""
        return self.group_size * self.groups_per_step

    @property
    def task_timeout_s(self) -> float:
        """Each task's timeout: far beyond any drawn duration, so none is cut."""
        return max(120.0, 4 * self.median_s * self.straggler_x * math.exp(4 * self.sigma))


@dataclass(frozen=True)
class Schedule:
    """One way to run the loop: the learner's staleness bound and checkpoint cadence."""

    key: str
    label: str
    max_staleness: int
    checkpoint_every: int


def schedules(config: Config) -> list[Schedule]:
    """The asynchronous schedule, the same publishing every step, and the synchronous one."""
    return [Schedule("asynchronous", "async", config.max_staleness, config.checkpoint_every),
            Schedule("asynchronous_every_step", "async, K=1", config.max_staleness, 1),
            Schedule("synchronous", "sync", 0, 1)]


def durations(config: Config, task: int) -> list[float]:
    """The drawn durations of task ``task``'s rollouts (seconds), the same in every schedule."""
    rng = random.Random(f"{config.seed}/{task}")
    out = []
    for _ in range(config.group_size):
        seconds = config.median_s * math.exp(rng.gauss(0.0, config.sigma))
        if rng.random() < config.straggler_p:
            seconds *= config.straggler_x
        out.append(round(seconds, 3))
    return out


def make_task(config: Config, run_id: str, k: int) -> TaskV1:
    python = [sys.executable, "-S", str(ROLLOUT_SCRIPT)]
    return TaskV1.model_validate({
        "task_id": f"{run_id}-{k}", "run_id": run_id, "instruction": f"Bench task {k}.",
        "harness": {"name": "bench-loop", "env": {DURATIONS_ENV: ",".join(map(str, durations(config, k)))},
                    "launch": {"kind": "local", "command": [*python, "harness", MODEL, str(config.turns),
                                                            str(config.completion_tokens)]}},
        "verifier": {"command": [*python, "verifier"]},
        "group_size": config.group_size, "timeout_s": config.task_timeout_s,
    })


class MeasuredLearner(Learner):
    """The real learner loop, also noting each trained trajectory's age and when it checkpointed."""

    def __init__(self, settings: LearnerSettings, kafka: KafkaSettings, timeline: Timeline, step_model: StepTimeModel,
                 model_dir: Path) -> None:
        super().__init__(settings, kafka, worker=lambda _s, _d: SimulatedWorker(step_model, model_dir, timeline))
        self.timeline = timeline
        self.ages: list[int] = []
        """Per trained trajectory: the age of its oldest trained token, in published versions."""
        self.steps_behind: list[int] = []
        """Per trained trajectory: learner steps since the version that sampled its oldest trained token."""
        self.checkpoint_times: list[tuple[float, float]] = []
        self._published_at = {0: 0}
        """Version -> the learner step it was published after."""
        self._ages_policy = StalenessPolicy(settings.max_staleness, settings.unversioned_as)

    def build_batch(self, groups: list[Group[Position]]) -> tuple[TrainBatch, list[TrajectoryV1]]:
        batch, members = super().build_batch(groups)
        for trajectory in members:
            kept = [self._ages_policy.fresh(s, self.version).oldest_kept_age for s in trajectory.samples]
            age = max((a for a in kept if a is not None), default=0)
            self.ages.append(age)
            self.steps_behind.append(self.step - self._published_at.get(self.version - age, 0))
        return batch, members

    async def _publish(self) -> None:
        start = time.time()
        await super()._publish()
        self.checkpoint_times.append((start, time.time()))
        self._published_at[self.version] = self.step


class _Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def wait(self) -> None: ...


@dataclass
class Result:
    """One schedule's figures."""

    schedule: str
    max_staleness: int
    checkpoint_every: int
    window_s: float
    steps: int
    """Learner steps ending inside the window (the first step, which opens it, not counted)."""
    trained_tokens: int
    tokens_per_s: float
    learner_idle: float
    slot_idle: float
    staleness_mean: float
    staleness_p99: float
    staleness_max: int
    steps_behind_mean: float
    steps_behind_p99: float
    dropped: dict[str, int]
    masked_tokens: int
    short_groups: dict[str, int]
    rollouts_finished: int
    """Rollouts that ended inside the window."""
    totals: dict[str, int]
    """Whole-run counts, from the start to the stop, for the accounting line (see :func:`accounting`)."""
    rollouts_failed: dict[str, int]
    versions_published: int
    step_seconds_mean: float
    waits: list[float]
    """The learner's waits between consecutive steps in the window, checkpoint writes excluded (seconds)."""
    first_step_after_s: float
    """From the first launch to the end of the first learner step (not in the window)."""
    wall_s: float


def overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


async def rollout_spans(kafka: KafkaSettings, registry: TopicRegistry,
                        ) -> tuple[list[tuple[float, float | None]], dict[str, int]]:
    """Each rollout's (launched, ended) wall times from its lifecycle events, and failures by phase/reason."""
    launched: dict[str, float] = {}
    ended: dict[str, float] = {}
    failed: dict[str, int] = {}
    async for raw in read_topic(kafka, registry[ROLLOUTS].name):
        try:
            event = raw.decode()
        except DecodeError:
            continue
        if not isinstance(event, RolloutEventV1):
            continue
        at = event.created_at.timestamp()
        if event.phase is RolloutPhase.SCHEDULED:
            launched.setdefault(event.rollout_id, at)
        elif event.phase.is_terminal:
            ended.setdefault(event.rollout_id, at)
            if event.phase is not RolloutPhase.SUCCEEDED:
                key = f"{event.phase.value}/{event.reason.value if event.reason else '-'}"
                failed[key] = failed.get(key, 0) + 1
    return [(start, ended.get(rid)) for rid, start in launched.items()], failed


async def run_schedule(schedule: Schedule, config: Config, step_model: StepTimeModel, bootstrap: str,
                       model_dir: Path, tmp: Path) -> Result:
    """Start the parts with the schedule's learner settings, run the window, stop, measure."""
    name = schedule.key
    started = time.time()
    folder = tmp / name
    folder.mkdir()
    tag = uuid.uuid4().hex[:8]
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"benchloop{tag}.")
    registry = TopicRegistry.from_settings(kafka)
    async with KafkaAdmin(kafka, registry) as admin:
        await admin.create_topics()
    key = secrets.token_urlsafe(32)
    engine_port, proxy_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    processes = [Process("engine", [sys.executable, "-m", "bench.fast_upstream", "--port", str(engine_port),
                                    "--weight-versions", "--reload-s", str(config.reload_s),
                                    "--prompt-tokens", str(config.prompt_tokens),
                                    "--completion-tokens", str(config.completion_tokens)],
                         dict(os.environ), folder / "engine.log")]
    timeline = Timeline()
    learner: MeasuredLearner | None = None
    services: list[_Service] = []
    watched: list[asyncio.Task[None]] = []
    try:
        await wait_ready(processes[0], engine_port, "/health", 30)
        proxy_env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
                     "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
                     "OPENFORGE_PROXY_CREDENTIAL_KEY": key, "OPENFORGE_PROXY_SPOOL_DIR": str(folder / "spool"),
                     "OPENFORGE_PROXY_SERVED_MODEL": MODEL}
        processes.append(Process("proxy", [sys.executable, "-m", "openforge", "proxy", "--port", str(proxy_port),
                                           "--upstream", engine_url], proxy_env, folder / "proxy.log"))
        await wait_ready(processes[1], proxy_port, "/ready", 60)

        learner = MeasuredLearner(
            LearnerSettings(model_name=MODEL, model_dir=model_dir, checkpoint_dir=folder / "checkpoints",
                            groups_per_step=config.groups_per_step, checkpoint_every=schedule.checkpoint_every,
                            max_staleness=schedule.max_staleness),
            kafka, timeline, step_model, model_dir)
        launcher = Launcher(LauncherSettings(
            proxy_url=f"http://127.0.0.1:{proxy_port}", credential_key=key, max_in_flight=config.slots,
            group_id=f"benchloop-{tag}-launcher", state_dir=folder / "launcher", workspace_root=folder / "work",
            kafka=kafka))
        services = [
            # The scripted engine loads no weights, so there are none to verify.
            CheckpointPublisher(PublisherSettings(replicas=[engine_url], model=MODEL, kafka=kafka, verify_weights=False,
                                                  group_id=f"benchloop-{tag}-publisher", reference_weights=model_dir)),
            AssemblerService(AssemblerSettings(group_id=f"benchloop-{tag}-assembler"), kafka),
            learner, launcher]
        for service in services:
            await service.start()
            watched.append(asyncio.create_task(service.wait()))

        run_id = f"loop{tag}"
        submitted = 0
        first_launch: float | None = None
        async with EventProducer(kafka, registry=registry) as producer:
            while True:
                for process in processes:
                    process.check_alive()
                for task in watched:
                    if task.done():
                        task.result()  # a failure ends the run with it
                        raise RuntimeError("a part of the loop stopped on its own")
                launched = launcher.launched + launcher.skipped
                if first_launch is None and launched:
                    first_launch = time.time()
                # Keep tasks waiting on the topic, so the launcher never runs dry.
                while submitted * config.group_size - launched < 2 * config.slots + config.batch_rollouts:
                    await producer.publish(TASKS, make_task(config, run_id, submitted))
                    submitted += 1
                steps = timeline.steps
                # The window needs a step after the one that opens it, however long a cycle takes.
                if len(steps) >= 2 and time.time() >= steps[0].end + config.seconds:
                    break
                if time.time() - (steps[0].end if steps else started) > 300:
                    raise RuntimeError(f"{name}: no learner step within 300 s")
                await asyncio.sleep(0.2)
        await learner.stop()  # the running step ends: the window closes at the last step's end
    finally:
        for task in watched:
            task.cancel()
        for service in reversed(services):
            try:
                await service.stop()
            except Exception:
                logger.exception("stopping %s failed", type(service).__name__)
        for process in reversed(processes):
            process.stop()

    assert learner is not None
    steps = timeline.steps
    if len(steps) < 2:
        raise RuntimeError(f"{name}: {len(steps)} learner step(s); the window needs two (raise --seconds)")
    lo, hi = steps[0].end, steps[-1].end
    window = hi - lo
    busy = sum(overlap(s.start, s.end, lo, hi) for s in steps[1:])
    busy += sum(overlap(a, b, lo, hi) for a, b in learner.checkpoint_times)
    spans, failed = await rollout_spans(kafka, registry)
    on_topic = 0
    async for _ in read_topic(kafka, registry[TRAJECTORIES].name):
        on_topic += 1
    totals = {
        "rollouts_launched": len(spans), "rollouts_ended": sum(1 for _, b in spans if b is not None),
        "trajectories_on_topic": on_topic, "trained_trajectories": learner.stats.trained_trajectories,
        "dropped_trajectories": sum(learner.stats.dropped.values()),
        "learner_steps": learner.stats.steps, "worker_steps": len(steps),
        "learner_trained_tokens": learner.stats.trained_tokens,
        "worker_trained_tokens": sum(s.trained_tokens for s in steps),
        "aged_trajectories": len(learner.ages)}
    slot_busy = sum(overlap(a, b if b is not None else hi, lo, hi) for a, b in spans)
    trained = sum(s.trained_tokens for s in steps[1:])
    first = min((a for a, _ in spans), default=first_launch or started)
    waits = [max(0.0, b.start - a.end - sum(overlap(c, d, a.end, b.start) for c, d in learner.checkpoint_times))
             for a, b in itertools.pairwise(steps)]
    failed.pop("cancelled/shutdown", None)  # the rollouts still running when the run stopped
    return Result(
        schedule=name, max_staleness=schedule.max_staleness, checkpoint_every=schedule.checkpoint_every,
        window_s=window, steps=len(steps) - 1, trained_tokens=trained,
        tokens_per_s=trained / window, learner_idle=max(0.0, 1 - busy / window),
        slot_idle=max(0.0, 1 - slot_busy / (config.slots * window)),
        staleness_mean=statistics.fmean(learner.ages) if learner.ages else 0.0,
        staleness_p99=percentile(learner.ages, 0.99), staleness_max=max(learner.ages, default=0),
        steps_behind_mean=statistics.fmean(learner.steps_behind) if learner.steps_behind else 0.0,
        steps_behind_p99=percentile(learner.steps_behind, 0.99),
        dropped=dict(learner.stats.dropped), masked_tokens=learner.stats.stale_tokens,
        short_groups=dict(learner.stats.short_groups),
        rollouts_finished=sum(1 for _, b in spans if b is not None and b <= hi), rollouts_failed=failed,
        totals=totals,
        versions_published=learner.version, step_seconds_mean=statistics.fmean(s.end - s.start for s in steps),
        waits=waits,
        first_step_after_s=steps[0].end - first, wall_s=time.time() - started)


def measure_step_model(config: Config, model_dir: Path) -> StepTimeModel:
    from bench.learner import fit_step_time

    rows = config.batch_rollouts * config.turns
    fit = fit_step_time(model_dir, rows, config.prompt_tokens, config.completion_tokens)
    return StepTimeModel(fit.a, fit.b, f"measured here, hf worker, tiny model, {len(fit.points)} steps of "
                                       f"{rows // 2}-{rows * 2} rows")


def _fraction(value: float) -> str:
    return f"{value * 100:.1f} %"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "none"


def ratio(results: dict[str, Result], key: str) -> float:
    """``key``'s trained tokens/s over the synchronous schedule's."""
    sync = results["synchronous"].tokens_per_s
    return results[key].tokens_per_s / sync if sync else math.inf


def format_table(config: Config, step_model: StepTimeModel, results: dict[str, Result],
                 goals: dict[str, dict[str, Any]]) -> str:
    """The figures of every schedule side by side, what they ran with, and the goals."""
    plan = {s.key: s for s in schedules(config)}
    batch_tokens = config.batch_rollouts * config.turns * (config.prompt_tokens + config.completion_tokens)
    lines = [
        "loop efficiency: asynchronous and synchronous schedules, same parts, same rollouts",
        f"  rollouts: {config.slots} slots; groups of {config.group_size}, {config.groups_per_step} per learner step "
        f"({config.batch_rollouts} rollouts); {config.turns} model calls each, {config.prompt_tokens} prompt + "
        f"{config.completion_tokens} completion tokens a call",
        f"  durations: lognormal, median {config.median_s:g} s, sigma {config.sigma:g}; {config.straggler_p:.0%} "
        f"of rollouts {config.straggler_x:g}x longer (seed {config.seed})",
        f"  learner step: {step_model.a:.3f} s + {step_model.b * 1e3:.4f} ms x tokens ({step_model.source}); "
        f"{batch_tokens} tokens a full step: {step_model.seconds(batch_tokens):.2f} s",
        f"  engine reload {config.reload_s:g} s; window {config.seconds:g} s from the end of each schedule's "
        "first step",
        "",
    ]
    keys = [k for k in plan if k in results]
    width = 17

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:30}" + "".join(f"{v:>{width}}" for v in values))

    row("", [plan[k].label for k in keys])
    row("staleness bound (versions)", [str(plan[k].max_staleness) for k in keys])
    row("steps per version (K)", [str(plan[k].checkpoint_every) for k in keys])
    row("trained tokens/s", [f"{results[k].tokens_per_s:.0f}" for k in keys])
    row("  vs sync", [f"{ratio(results, k):.2f}x" for k in keys])
    row("learner steps in window", [str(results[k].steps) for k in keys])
    row("learner idle", [_fraction(results[k].learner_idle) for k in keys])
    row("rollout-slot idle", [_fraction(results[k].slot_idle) for k in keys])
    row("staleness mean / p99", [f"{results[k].staleness_mean:.2f} / {results[k].staleness_p99:.0f}" for k in keys])
    row("  in steps, mean / p99", [f"{results[k].steps_behind_mean:.1f} / {results[k].steps_behind_p99:.0f}"
                                   for k in keys])
    row("longest learner wait (s)", [f"{max(results[k].waits, default=0.0):.1f}" for k in keys])
    row("rollouts finished", [str(results[k].rollouts_finished) for k in keys])
    row("masked tokens (stale)", [str(results[k].masked_tokens) for k in keys])
    row("dropped trajectories", [str(sum(results[k].dropped.values())) for k in keys])
    for k in keys:
        r = results[k]
        notes = [f"dropped: {_counts(r.dropped)}"]
        if r.short_groups:
            notes.append(f"short groups: {_counts(r.short_groups)}")
        if r.rollouts_failed:
            notes.append(f"rollouts failed: {_counts(r.rollouts_failed)}")
        lines.append(f"  {plan[k].label}: " + "; ".join(notes))
    lines.append("whole run (start to stop), launched >= ended >= on the topic >= trained + dropped:")
    for k in keys:
        t = results[k].totals
        lines.append(f"  {plan[k].label}: rollouts launched {t['rollouts_launched']}, ended {t['rollouts_ended']}; "
                     f"trajectories on the topic {t['trajectories_on_topic']}, trained {t['trained_trajectories']}, "
                     f"dropped {t['dropped_trajectories']}; learner steps {t['learner_steps']}")
    lines.append("")
    lines.extend(f"goal: {goal['text']}: {goal['value']} -> {'met' if goal['met'] else 'NOT met'}"
                 for goal in goals.values())
    return "\n".join(lines)


def judge(results: dict[str, Result], config: Config) -> dict[str, dict[str, Any]]:
    """The goals, judged on the asynchronous schedule (the user's settings, bound at ``--max-staleness``)."""
    a = results["asynchronous"]
    speedup = ratio(results, "asynchronous")
    dropped = sum(a.dropped.values())
    return {
        "ratio": {"text": f"asynchronous >= {GOAL_RATIO:g}x the synchronous trained tokens/s",
                  "value": f"{speedup:.2f}x", "met": speedup >= GOAL_RATIO},
        "learner_idle": {"text": f"asynchronous learner idle < {GOAL_LEARNER_IDLE:.0%}",
                         "value": _fraction(a.learner_idle), "met": a.learner_idle < GOAL_LEARNER_IDLE},
        "dropped": {"text": f"nothing dropped at staleness bound {config.max_staleness}",
                    "value": f"{dropped} dropped", "met": dropped == 0},
    }


async def run(config: Config, step_model: StepTimeModel | None, kafka: str | None, tmp: Path,
              ) -> tuple[StepTimeModel, dict[str, Result]]:
    from openforge.engine import make_tiny_model

    model_dir = make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")
    broker: LocalBroker | None = None
    try:
        starting: list[Awaitable[Any]] = []
        if kafka is None:
            broker = private_broker(tmp / "kafka")
            progress("starting a Kafka broker of its own ...")
            starting.append(asyncio.to_thread(broker.start))
        if step_model is None:
            progress("measuring the hf worker's step time on the tiny model ...")
            starting.append(asyncio.to_thread(measure_step_model, config, model_dir))
        else:  # the learner imports its algorithms (veRL, torch) at its first step; not inside the window
            starting.append(asyncio.to_thread(__import__, "learner.algos"))
        done = await asyncio.gather(*starting)
        if step_model is None:
            step_model = done[-1]
            assert isinstance(step_model, StepTimeModel)
        bootstrap = kafka or (broker.bootstrap if broker else "")
        results: dict[str, Result] = {}
        for schedule in schedules(config):
            progress(f"{schedule.key} schedule (staleness bound {schedule.max_staleness}, a version every "
                     f"{schedule.checkpoint_every} step(s)), {config.seconds:g} s window ...")
            results[schedule.key] = await run_schedule(schedule, config, step_model, bootstrap, model_dir, tmp)
        return step_model, results
    finally:
        if broker is not None:
            broker.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--seconds", type=float, default=60.0, help="window per schedule, from the end of its first step (60)")
    add("--slots", type=int, default=16, help="rollouts running at once: the launcher's max_in_flight (16)")
    add("--group-size", type=int, default=4, help="rollouts per task (4)")
    add("--groups-per-step", type=int, default=4, help="task groups per learner step (4)")
    add("--turns", type=int, default=2, help="model calls per rollout (2)")
    add("--prompt-tokens", type=int, default=128, help="prompt tokens of every call (128)")
    add("--completion-tokens", type=int, default=32, help="completion tokens of every call (32)")
    add("--median-s", type=float, default=1.0, help="median rollout duration in seconds (1)")
    add("--sigma", type=float, default=0.6, help="lognormal sigma of the durations (0.6)")
    add("--straggler-p", type=float, default=0.05, help="share of rollouts that are stragglers (0.05)")
    add("--straggler-x", type=float, default=10.0, help="how many times longer a straggler runs (10)")
    add("--max-staleness", type=int, default=2, help="the asynchronous schedule's staleness bound (2)")
    add("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY,
        help=f"the asynchronous schedule's steps per version (the learner's default, {DEFAULT_CHECKPOINT_EVERY})")
    add("--reload-s", type=float, default=0.1, help="seconds the engine takes to reload weights (0.1)")
    add("--seed", type=int, default=0, help="seed of the drawn durations (0)")
    add("--step-model", default=None, metavar="A,B",
        help=f"learner step seconds = A + B x tokens (default {STEP_MODEL.a:g},{STEP_MODEL.b:g}: STEP_MODEL)")
    add("--measure-step", action="store_true", help="fit the step model on this machine at start instead")
    add("--kafka", default=None, metavar="HOST:PORT", help="use this Kafka cluster instead of starting a broker")
    add("--json", type=Path, default=None, help="also write the figures here")
    add("--quick", action="store_true",
        help="a short check that everything runs (for the test suite), not figures to quote: "
             + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
             + " unless given")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    for name in ("seconds", "slots", "group_size", "groups_per_step", "turns", "prompt_tokens",
                 "completion_tokens", "median_s", "straggler_x", "checkpoint_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.sigma < 0 or args.reload_s < 0 or args.max_staleness < 0 or not 0 <= args.straggler_p <= 1:
        parser.error("--sigma, --reload-s and --max-staleness must not be negative; --straggler-p is a share")
    if args.slots < args.group_size * args.groups_per_step:
        parser.error("--slots must hold one learner batch (group size x groups per step), or the synchronous "
                     "schedule could never fill a step")
    if args.step_model is not None and args.measure_step:
        parser.error("--step-model and --measure-step exclude each other")
    if args.step_model is not None:
        try:
            a, b = (float(x) for x in args.step_model.split(","))
        except ValueError:
            parser.error("--step-model takes A,B (seconds and seconds per token)")
        if a < 0 or b < 0:
            parser.error("--step-model's A and B must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = Config(seconds=args.seconds, slots=args.slots, group_size=args.group_size,
                    groups_per_step=args.groups_per_step, turns=args.turns, prompt_tokens=args.prompt_tokens,
                    completion_tokens=args.completion_tokens, median_s=args.median_s, sigma=args.sigma,
                    straggler_p=args.straggler_p, straggler_x=args.straggler_x, max_staleness=args.max_staleness,
                    checkpoint_every=args.checkpoint_every, reload_s=args.reload_s, seed=args.seed)
    given: StepTimeModel | None = None if args.measure_step else STEP_MODEL
    if args.step_model is not None:
        a, b = (float(x) for x in args.step_model.split(","))
        given = StepTimeModel(a, b, "given with --step-model")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # group coordinator chatter at start and stop
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="openforge-bench-loop-") as tmp:
        step_model, results = asyncio.run(run(config, given, args.kafka, Path(tmp)))
    goals = judge(results, config)
    print(format_table(config, step_model, results, goals))
    print(f"(wall {time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "config": asdict(config), "step_model": asdict(step_model),
            "results": {k: asdict(v) for k, v in results.items()},
            "goals": goals}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
