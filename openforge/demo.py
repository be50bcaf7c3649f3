"""`openforge demo`: the whole learning loop on one machine, watched while it learns.

What runs, each as its own process as on a cluster: a single-node Kafka broker (KRaft), vLLM's
CPU build serving a tiny randomly initialised model made locally, the proxy, the trajectory
assembler, the learner, the checkpoint publisher and the launcher with the local process backend.
The demo submits the built-in toy task suite (:mod:`openforge.toy`), whose small two-turn harness
and verifier run as local rollouts through the real proxy. It prints the reward, learner steps,
served weight version and backlog while it runs and ends with a reward-curve PNG and a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click

from openforge.demo_procs import Child, ChildExitedError
from openforge.demo_report import Curve, RewardPoint, Summary, summarize, write_plot
from openforge.engine import LocalEngine, install_vllm, make_tiny_model
from openforge.toy import toy_tasks
from openforge.toy.scoring import MAX_REWARD as TOY_MAX_REWARD
from proxy.settings import POLICY_SAMPLING
from schemas import CheckpointAppliedV1, CheckpointV1, TrajectoryV1
from stream import (
    CHECKPOINTS,
    TASKS,
    TRAJECTORIES,
    BrokerSettings,
    EventConsumer,
    EventProducer,
    KafkaAdmin,
    KafkaSettings,
    LocalBroker,
    Received,
)
from stream.broker import cache_root, free_port

__all__ = ["DemoOptions", "run_demo"]

MODEL_NAME = "openforge-tiny"


@dataclass(frozen=True)
class DemoOptions:
    """What the user can change from the command line."""

    minutes: float = 10.0
    """Wall-clock budget of the learning phase (start-up not counted)."""
    group_size: int = 8
    """Rollouts per task: GRPO compares rewards within a group."""
    max_in_flight: int = 8
    """Rollouts running at once."""
    stop_at: float = 0.75
    """Stop early once the mean reward of the last window reaches this."""
    seed: int = 0
    """Seed of the tiny model's weights and of the learner."""
    lr: float = 1e-2
    """The learner's AdamW learning rate: large, because the model is tiny and the demo short."""
    entropy_coeff: float = 0.02
    """The learner's entropy bonus (the starting one when ``entropy_target`` is set)."""
    entropy_target: float | None = None
    """Entropy (nats per token) the learner steers its bonus to hold the policy above (adaptive
    entropy control); None keeps the bonus at ``entropy_coeff``. With the bonus on stuck groups
    alone (``bonus_scope``) a fixed one does: it acts only where the policy has stopped learning."""
    entropy_coeff_delta: float = 0.005
    """How fast an adaptive bonus moves per learner step."""
    entropy_coeff_max: float = 0.02
    """Upper bound of an adaptive bonus."""
    bonus_scope: Literal["stuck", "all"] = "stuck"
    """Where the bonus acts: ``stuck`` (only on groups whose rollouts all scored the same below the
    toy verifier's best, 1.0) or ``all`` (every token, veRL's actor). On every token the bonus,
    steered toward 1 nat per token, fought a policy loss that had almost nothing left to say near
    the optimum and won: in the loop and in simulation runs that had reached 0.96-1.00 went from
    0.1-0.3 to 7-8 nats per token within a few steps and lost what they had learned
    (docs/demo.md)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (torch's default). 1e-5 tamed bonus-only steps offline but did not stop the
    overshoot in the loop, and with it seed 0 settled twice on a half-right answer (docs/demo.md)."""
    norm_adv_by_std: bool = False
    """Divide advantages by the group's reward std (GRPO) or not (Dr. GRPO, the demo's choice).
    When a group's rewards are nearly alike, GRPO blows their tiny differences up to advantages of
    order one, which outweigh any entropy bonus and drive the collapse; without the division the
    push shrinks with the differences and the bonus can restore exploration."""
    filter_alike_groups: bool = True
    """Leave groups whose rollouts all scored the best reward out of the learner's steps (DAPO's
    dynamic sampling, with ``bonus_scope="all"`` every alike group); a step made only of them is
    not taken, so a solved policy is left as it is. A policy collapsed below the best reward is
    what ``bonus_scope="stuck"`` is for."""
    workdir: Path = Path(".openforge-demo")
    """Where logs, checkpoints, the plot and the summary go (one folder per run inside)."""
    keep_broker: bool = False
    """Leave the broker running afterwards."""
    bootstrap: str | None = None
    """Use this Kafka cluster instead of starting (or reusing) the local broker."""
    control: bool = False
    """Run the same loop with learning switched off: the learner runs every step, checkpoints and
    publishes as usual, with learning rate 0, so the served weights never change. Its reward
    curve shows what the loop does without learning."""

    def __post_init__(self) -> None:
        if self.bonus_scope == "stuck" and not self.filter_alike_groups:
            raise ValueError("the bonus on stuck groups needs alike groups filtered: stuck groups are the "
                             "alike ones below the best reward; use bonus_scope='all' to keep alike groups")


def _wait_http(url: str, timeout_s: float, what: str, check: Child | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check is not None:
            check.check()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own loopback URL
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise click.ClickException(f"{what} did not become ready at {url} within {timeout_s:.0f} s")


def run_demo(options: DemoOptions) -> tuple[Summary, Curve]:
    """Run the loop, show progress, write the plot and summary; stop everything it started.

    Returns:
        The summary and every recorded point, so tests can judge the run.
    """
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}" + ("-control" if options.control else "")
    out = options.workdir.resolve() / run_id
    out.mkdir(parents=True, exist_ok=True)
    (out / "options.json").write_text(json.dumps({"seed": options.seed, "control": options.control,
                                                  "lr": 0.0 if options.control else options.lr}) + "\n",
                                      encoding="utf-8")
    click.echo(f"OpenForge demo {run_id}: logs, checkpoints and the plot go to {out}"
               + ("\n    control run: the learner steps and publishes with learning rate 0" if options.control else ""))

    broker: LocalBroker | None = None
    already = True
    if options.bootstrap is None:
        broker = LocalBroker(BrokerSettings())
        already = broker.status().running
        click.echo(f"==> Kafka {broker.settings.version} on {broker.bootstrap}"
                   + (" (already running)" if already else " (starting; the first run fetches its jars)"))
        broker.start()
    bootstrap = options.bootstrap or (broker.bootstrap if broker is not None else "")
    children: list[Child] = []
    engine: LocalEngine | None = None
    try:
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"{run_id}.",
                              **(_LOCAL_KAFKA if broker is not None else {}))
        click.echo("==> vLLM's CPU build (installed once, about 3 GiB) and a tiny model made locally")
        python = install_vllm()
        model_dir = make_tiny_model(python, cache_root() / "models" / f"tiny-seed{options.seed}", seed=options.seed)
        engine = LocalEngine(model_dir=model_dir, port=free_port(), python=python, log_file=out / "logs" / "vllm.log")
        engine.start()
        click.echo(f"    serving {model_dir.name} at {engine.url}")
        asyncio.run(_create_topics(kafka))
        key = secrets.token_hex(32)
        proxy_port = free_port()
        base = _base_env(kafka, key, local=broker is not None)
        specs = _components(options, out, base, engine.url, proxy_port, model_dir)
        for name, args, env in specs:
            child = Child(name, args, env, out / "logs" / f"{name}.log")
            child.start()
            children.append(child)
            if name == "proxy":
                _wait_http(f"http://127.0.0.1:{proxy_port}/ready", 60, "the proxy", child)
        click.echo("==> started " + ", ".join(c.name for c in children))
        curve, duration = asyncio.run(_learn(options, kafka, run_id, children))
    except ChildExitedError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        click.echo("==> stopping")
        for child in reversed(children):
            child.stop()
        if engine is not None:
            engine.stop()
        if broker is not None and not already and not options.keep_broker:
            broker.stop()
    summary = summarize(curve, duration, best_reward=TOY_MAX_REWARD, control=options.control)
    summary.write_json(out / "summary.json")
    curve.write_jsonl(out / "curve.jsonl")
    click.echo(summary.as_text())
    if curve.rewards:
        plot = out / "reward_curve.png"
        other = latest_run(options.workdir.resolve(), control=not options.control, seed=options.seed)
        kind = "control (learning rate 0)" if options.control else "learning"
        write_plot(curve, plot, f"OpenForge demo, seed {options.seed}: toy secret task, tiny random model, RL only",
                   other=None if other is None else Curve.read_jsonl(other / "curve.jsonl"), label=kind,
                   other_label="learning" if options.control else "control (learning rate 0)")
        click.echo(f"reward curve: {plot}" + ("" if other is None else f" (with the {other.name} run beside it)"))
    return summary, curve


def latest_run(workdir: Path, *, control: bool, seed: int) -> Path | None:
    """The newest finished run folder in ``workdir`` of the given kind and seed, to plot beside this one."""
    found: list[tuple[float, Path]] = []
    for curve_file in workdir.glob("demo-*/curve.jsonl"):
        try:
            config = json.loads((curve_file.parent / "options.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if config.get("control") == control and config.get("seed") == seed:
            found.append((curve_file.stat().st_mtime, curve_file.parent))
    return max(found)[1] if found else None


# The demo's own broker listens in plaintext: Kafka security settings in the shell (for some other
# cluster) must reach neither this process nor the ones it starts.
_LOCAL_KAFKA: dict[str, Any] = {
    name: None for name, field in KafkaSettings.model_fields.items()
    if name.startswith(("ssl_", "sasl_")) and field.default is None} | {"security_protocol": "PLAINTEXT"}


def _base_env(kafka: KafkaSettings, key: str, *, local: bool) -> dict[str, str]:
    env = {
        "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "OPENFORGE_PROXY_CREDENTIAL_KEY": key,
        # Two cores: one thread per process keeps torch in learner and engine from oversubscribing.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if local:  # an empty variable counts as unset
        env |= {f"OPENFORGE_KAFKA_{name.upper()}": "" if value is None else str(value)
                for name, value in _LOCAL_KAFKA.items()}
    return env


def _components(options: DemoOptions, out: Path, base: dict[str, str], engine_url: str, proxy_port: int,
                model_dir: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """Name, ``openforge`` arguments and extra environment of each process, in start order."""
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    return [
        ("proxy", ["proxy", "--port", str(proxy_port), "--upstream", engine_url],
         {**base, "OPENFORGE_PROXY_SPOOL_DIR": str(out / "spool"), "OPENFORGE_PROXY_SERVED_MODEL": str(model_dir),
          "OPENFORGE_PROXY_SAMPLING": json.dumps(POLICY_SAMPLING)}),
        ("assembler", ["assembler"], {**base}),
        ("learner", ["learner"],
         {**base, "OPENFORGE_LEARNER_MODEL_NAME": MODEL_NAME, "OPENFORGE_LEARNER_MODEL_DIR": str(model_dir),
          "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(out / "checkpoints"), "OPENFORGE_LEARNER_SEED": str(options.seed),
          # A tiny model and few samples: a large step size, a checkpoint (and a new served version)
          # after every step, and little waiting for groups, so the curve moves within minutes. The
          # staleness bound is the learner's default. A control run steps with learning rate 0.
          "OPENFORGE_LEARNER_LR": "0" if options.control else str(options.lr),
          "OPENFORGE_LEARNER_ENTROPY_COEFF": str(options.entropy_coeff),
          **({} if options.entropy_target is None else
             {"OPENFORGE_LEARNER_ENTROPY_TARGET": str(options.entropy_target),
              "OPENFORGE_LEARNER_ENTROPY_COEFF_DELTA": str(options.entropy_coeff_delta),
              "OPENFORGE_LEARNER_ENTROPY_COEFF_MAX": str(options.entropy_coeff_max)}),
          "OPENFORGE_LEARNER_NORM_ADV_BY_STD": str(options.norm_adv_by_std).lower(),
          "OPENFORGE_LEARNER_FILTER_ALIKE_GROUPS": str(options.filter_alike_groups).lower(),
          "OPENFORGE_LEARNER_ENTROPY_BONUS_SCOPE": options.bonus_scope,
          "OPENFORGE_LEARNER_MAX_REWARD": str(TOY_MAX_REWARD),
          "OPENFORGE_LEARNER_ADAM_EPS": str(options.adam_eps),
          "OPENFORGE_LEARNER_CHECKPOINT_EVERY": "1",
          "OPENFORGE_LEARNER_GROUPS_PER_STEP": "2", "OPENFORGE_LEARNER_BATCH_WAIT_S": "5"}),
        ("publisher", ["publisher", "--replica", engine_url, "--model", MODEL_NAME],
         {**base, "OPENFORGE_PUBLISHER_REFERENCE_WEIGHTS": str(model_dir)}),
        ("launcher", ["launcher", "--backend", "local", "--max-in-flight", str(options.max_in_flight),
                      "--proxy-url", proxy_url],
         {**base, "OPENFORGE_LAUNCHER_STATE_DIR": str(out / "launcher-state"),
          "OPENFORGE_LAUNCHER_WORKSPACE_ROOT": str(out / "workspaces")}),
    ]


async def _create_topics(kafka: KafkaSettings) -> None:
    async with KafkaAdmin(kafka) as admin:
        await admin.create_topics()


async def _learn(options: DemoOptions, kafka: KafkaSettings, run_id: str,
                 children: list[Child]) -> tuple[Curve, float]:
    """Submit the suite, then watch trajectories and checkpoints until time, target or Ctrl-C."""
    curve = Curve()
    t0 = time.monotonic()
    rounds = 400  # more than ten minutes can use; the launcher takes them at its own pace
    tasks = toy_tasks(run_id=run_id, rounds=rounds, group_size=options.group_size, model=MODEL_NAME)
    async with EventProducer(kafka, transactional_id=f"{run_id}-submit") as producer, producer.transaction():
        for task in tasks:
            await producer.send(TASKS, task)
    click.echo(f"==> submitted {len(tasks)} tasks x {options.group_size} rollouts; learning for up to "
               f"{options.minutes:g} minutes (Ctrl-C stops early and still writes the plot)")

    async def handle(received: Received) -> None:
        now = time.monotonic() - t0
        event = received.event
        if isinstance(event, TrajectoryV1) and event.reward is not None and not event.infrastructure_failure:
            versions = [int(r.version) for s in event.samples for r in s.weight_versions if r.version.isdigit()]
            curve.rewards.append(RewardPoint(now, event.reward, min(versions) if versions else None,
                                             event.task_id))
            curve.merged_turns += event.merge_stats.merged
            curve.merge_breaks += event.merge_stats.breaks
        elif isinstance(event, CheckpointV1):
            curve.checkpoints.append((now, event.version, {"step": float(event.step), **event.metrics}))
        elif isinstance(event, CheckpointAppliedV1) and event.ok:
            curve.applied.append((now, event.version, event.duration_s))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    deadline = t0 + options.minutes * 60
    last_print = 0.0
    async with EventConsumer([TRAJECTORIES, CHECKPOINTS], handle, group_id=f"{run_id}-watch", kafka=kafka):
        while not stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            for child in children:
                child.check()
            if time.monotonic() - last_print >= 10:
                last_print = time.monotonic()
                click.echo(_progress_line(curve, time.monotonic() - t0))
            window = curve.window_mean(64)
            if window is not None and len(curve.rewards) >= 128 and window >= options.stop_at:
                click.echo(f"==> mean reward of the last 64 rollouts reached {window:.2f}; stopping early")
                break
    loop.remove_signal_handler(signal.SIGINT)
    return curve, time.monotonic() - t0


def _progress_line(curve: Curve, elapsed: float) -> str:
    window = curve.window_mean(64)
    first = [p.reward for p in curve.rewards[:64]]
    step = int(curve.checkpoints[-1][2].get("step", 0)) if curve.checkpoints else 0
    served = max((v for _, v, _ in curve.applied), default=0)
    lag = ""
    if curve.checkpoints and "staleness_mean" in curve.checkpoints[-1][2]:
        lag = f" | trained data {curve.checkpoints[-1][2]['staleness_mean']:.1f} versions old"
    if curve.checkpoints and "entropy" in curve.checkpoints[-1][2]:
        metrics = curve.checkpoints[-1][2]
        lag += f" | entropy {metrics['entropy']:.2f}"
        if "stuck_trajectories" in metrics:  # the bonus acts on stuck groups only
            lag += f" (bonus {metrics.get('entropy_coeff', 0.0):.3f} on {metrics['stuck_trajectories']:.0f} stuck)"
        elif "entropy_coeff" in metrics:
            lag += f" (bonus {metrics['entropy_coeff']:.3f})"
    if curve.applied:
        lag += f" | publish {curve.applied[-1][2]:.2f}s"
    reward = "reward    -" if window is None else (
        f"reward {window:.2f} (first {sum(first) / len(first):.2f})")
    return (f"[{elapsed:5.0f}s] rollouts {len(curve.rewards):5d} | {reward} | learner step {step:4d} | "
            f"served v{served}{lag}")
