"""Many rollouts through the real launcher and pod watcher on the simulated cluster, with faults.

Shared by the scale-and-fault test (a few hundred rollouts) and ``bench/cluster.py`` (2,000). The
launcher and the watcher are the shipped classes with their settings; the launcher finds the API
server through ``OPENFORGE_KUBE_*`` as in a deployment. Mid-run the launcher is restarted once, the
watcher twice, the API server once, and one node goes NotReady. A launcher that dies (its API
calls fail while the API server restarts) is started again, as its Deployment would; the report
counts those restarts apart from the planned one.

Watcher lag is measured from the transition's own time, written by kwok into the pod's status
(the harness's ``startedAt`` for ``running``; the last ``finishedAt`` for a terminal phase), to the
Kafka record's timestamp. The scenario reads those times from a watch of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from kubeapi import apply_rbac, make_task
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch as k8s_watch
from simcluster import SimCluster

from consumers.rollouts.launcher import Launcher, LauncherSettings, rollout_id_for
from producers.pod_watcher import PodWatcher, PodWatcherSettings
from schemas import RolloutEventV1, decode
from schemas.failures import classify
from schemas.rollout.pod import ANNOTATION_ROLLOUT_ID, HARNESS_CONTAINER
from schemas.rollout.v1 import RolloutPhase
from stream import ROLLOUTS, TASKS, EventProducer, KafkaSettings, TopicRegistry
from stream.admin import KafkaAdmin

logger = logging.getLogger(__name__)

KEY = b"k" * 32


@dataclass
class Received:
    event: RolloutEventV1
    kafka_ms: int


@dataclass
class ScenarioResult:
    """What the run saw; the test asserts on it, the benchmark prints it."""

    rollouts: set[str]
    events: list[Received]
    launch_times: list[float]
    """Kafka time (s) of the launcher's ``scheduled`` events, one per rollout (first seen)."""
    transitions: dict[tuple[str, str], float]
    """(rollout id, phase) -> when the pod reached it (kwok's status times), where known."""
    launcher_restarts: int
    launcher_crashes: list[str]
    watcher_restarts: int
    apiserver_restarts: int
    failed_node: str
    requests: Counter[tuple[str, str, str]]
    wall_s: float
    pods_left: int
    secrets_left: int
    notes: dict[str, Any] = field(default_factory=dict)

    def by_rollout(self) -> dict[str, list[RolloutEventV1]]:
        out: dict[str, list[RolloutEventV1]] = {r: [] for r in self.rollouts}
        for received in self.events:
            out.setdefault(received.event.rollout_id, []).append(received.event)
        return out

    def terminal(self) -> dict[str, RolloutEventV1]:
        return {r: e for r, events in self.by_rollout().items() for e in events if e.phase.is_terminal}

    def lags_ms(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"running": [], "terminal": []}
        seen: set[str] = set()
        for received in self.events:
            e = received.event
            if e.event_id in seen or e.phase is RolloutPhase.SCHEDULED:
                continue
            seen.add(e.event_id)
            at = self.transitions.get((e.rollout_id, "running" if e.phase is RolloutPhase.RUNNING else "terminal"))
            if at is not None:
                out["running" if e.phase is RolloutPhase.RUNNING else "terminal"].append(received.kafka_ms - at * 1000)
        return out

    def summary(self) -> dict[str, Any]:
        lags = self.lags_ms()
        launches = sorted(self.launch_times)
        span = launches[-1] - launches[0] if len(launches) > 1 else 0.0

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

        pods = {k: v for k, v in self.requests.items() if k[1] == "pods"}
        later = [r for r in self.events if r.event.phase is not RolloutPhase.SCHEDULED]
        outcomes = Counter(f"{e.phase.value}:{e.reason.value if e.reason else '-'}" for e in self.terminal().values())
        return {
            "rollouts": len(self.rollouts),
            "wall_s": round(self.wall_s, 1),
            "launch_pods_per_s": round(len(launches) / span, 1) if span else None,
            "watcher_lag_ms": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v)} for k, v in lags.items()},
            "apiserver_requests": sum(self.requests.values()),
            "apiserver_requests_by_verb": {verb: sum(n for (v, _, _), n in self.requests.items() if v == verb)
                                           for verb in sorted({k[0] for k in self.requests})},
            "pod_requests_by_verb": {verb: sum(n for (v, _, _), n in pods.items() if v == verb)
                                     for verb in sorted({k[0] for k in pods})},
            "outcomes": dict(sorted(outcomes.items())),
            "launcher_crash_restarts": len(self.launcher_crashes),
            # Records of running and terminal phases published again with the same event_id (consumers drop them).
            "repeated_records": len(later) - len({r.event.event_id for r in later}),
            "pods_and_secrets_left": [self.pods_left, self.secrets_left],
            **self.notes,
        }


def _time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _transitions(pod: dict[str, Any]) -> Iterator[tuple[str, float]]:
    status = pod.get("status") or {}
    finished: list[float] = []
    for key in ("initContainerStatuses", "containerStatuses"):
        for c in status.get(key) or []:
            state = c.get("state") or {}
            if c.get("name") == HARNESS_CONTAINER:
                started = _time((state.get("running") or {}).get("startedAt")
                                or (state.get("terminated") or {}).get("startedAt"))
                if started is not None:
                    yield "running", started
            done = _time((state.get("terminated") or {}).get("finishedAt"))
            if done is not None:
                finished.append(done)
    if status.get("phase") in ("Succeeded", "Failed") and finished:
        yield "terminal", max(finished)


class _Events:
    """Every rollout event on the topic, with its Kafka timestamp."""

    def __init__(self, kafka: KafkaSettings, registry: TopicRegistry) -> None:
        self._topic = registry[ROLLOUTS].name
        self._partitions = registry[ROLLOUTS].partitions
        self._consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers,
                                          auto_offset_reset="earliest", enable_auto_commit=False)
        self.received: list[Received] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.assign([TopicPartition(self._topic, p) for p in range(self._partitions)])
        self._task = asyncio.create_task(self._run())

    async def positions(self) -> str:
        """Where the reader is against the end of each partition (for a run that stalls)."""
        ends = await self._consumer.end_offsets(list(self._consumer.assignment()))
        return ", ".join([f"p{tp.partition} {await self._consumer.position(tp)}/{end}" for tp, end in ends.items()])

    async def _run(self) -> None:
        while True:
            for batch in (await self._consumer.getmany(timeout_ms=200)).values():
                for record in batch:
                    event = decode(record.headers, record.value)
                    assert isinstance(event, RolloutEventV1)
                    self.received.append(Received(event, record.timestamp))

    def check(self) -> None:
        """Raise what stopped the reading, if anything did."""
        if self._task is not None and self._task.done():
            self._task.result()
            raise AssertionError("the event reader stopped")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()


async def _watch_transitions(admin: k8s.ApiClient, namespace: str, into: dict[tuple[str, str], float],
                             stop: asyncio.Event) -> None:
    """Record when each pod reached running and its end, from the statuses kwok writes."""
    core = k8s.CoreV1Api(admin)
    while not stop.is_set():
        try:
            async with k8s_watch.Watch() as watch:
                async for item in watch.stream(core.list_namespaced_pod, namespace, timeout_seconds=30,
                                               _preload_content=False):
                    pod = item["raw_object"]
                    rollout_id = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_ROLLOUT_ID)
                    if rollout_id:
                        for phase, at in _transitions(pod):
                            into.setdefault((rollout_id, phase), at)
                    if stop.is_set():
                        return
        except asyncio.CancelledError:
            raise
        except Exception:  # the API server restarts mid-run; watch again  # noqa: BLE001
            await asyncio.sleep(0.5)


async def prepare_namespace(cluster: SimCluster, admin: k8s.ApiClient) -> str:
    """A namespace with the shipped RBAC; its default service account comes from the controller manager."""
    name = f"s-{uuid.uuid4().hex[:10]}"
    core = k8s.CoreV1Api(admin)
    await core.create_namespace({"metadata": {"name": name}})
    await apply_rbac(admin, name)
    for _ in range(200):
        accounts = await core.list_namespaced_service_account(name)
        if any(a.metadata.name == "default" for a in accounts.items):
            return name
        await asyncio.sleep(0.1)
    raise AssertionError("the controller manager made no default service account")


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def run_scenario(cluster: SimCluster, kafka: KafkaSettings, *, rollouts: int, group_size: int = 4,
                       max_in_flight: int = 100, finished_ttl_s: float = 5.0, timeout_s: float = 900.0,
                       progress: Callable[[str], None] | None = None) -> ScenarioResult:
    """Launch ``rollouts`` rollouts (``rollouts // group_size`` tasks) and wait for every one to end."""
    say = progress or (lambda text: logger.info("%s", text))
    registry = TopicRegistry.from_settings(kafka)
    async with KafkaAdmin(kafka, registry) as admin_kafka:
        await admin_kafka.create_topics()
    async with cluster.api.client() as admin:
        namespace = await prepare_namespace(cluster, admin)
    tasks = [make_task(f"task-{i:05d}", group_size=group_size, timeout_s=600.0) for i in range(rollouts // group_size)]
    expected = {rollout_id_for(t.task_id, i) for t in tasks for i in range(group_size)}
    api = cluster.api
    env = {"OPENFORGE_KUBE_SERVER": api.url, "OPENFORGE_KUBE_TOKEN": api.launcher_token,
           "OPENFORGE_KUBE_CA_FILE": str(api.ca_file), "OPENFORGE_KUBE_NAMESPACE": namespace}
    launcher_settings = LauncherSettings(
        backend="kubernetes", credential_key=KEY.decode(), kafka=kafka, group_id=f"{kafka.topic_prefix}launcher",
        proxy_url="http://proxy.openforge:8000", max_in_flight=max_in_flight, pace=False)
    watcher_settings = PodWatcherSettings(namespace=namespace, finished_ttl_s=finished_ttl_s,
                                          image_pull_timeout_s=10.0, sweep_interval_s=1.0,
                                          retry_backoff_s=0.2, retry_backoff_max_s=2.0)
    events = _Events(kafka, registry)
    await events.start()
    transitions: dict[tuple[str, str], float] = {}
    stop_watching = asyncio.Event()
    crashes: list[str] = []
    counts = {"launcher": 0, "watcher": 0, "apiserver": 0}
    failed_node = cluster.node_names[len(cluster.node_names) // 2]
    started = time.monotonic()
    async with api.client() as admin, api.client(api.watcher_token) as watcher_client, \
            EventProducer(kafka, registry=registry) as producer:
        watch_task = asyncio.create_task(_watch_transitions(admin, namespace, transitions, stop_watching))
        for task in tasks:
            await producer.publish(TASKS, task)

        with _env(env):
            launcher = Launcher(launcher_settings)
        await launcher.start()
        watcher = PodWatcher(watcher_client, producer, watcher_settings)
        await watcher.start()

        def ended() -> int:
            return len({r.event.rollout_id for r in events.received if r.event.phase.is_terminal})

        async def keep_launcher() -> None:
            """Start the launcher again when it died (or failed to start), as its Deployment would."""
            nonlocal launcher
            task = launcher._task
            if task is not None and not task.done():
                return
            if task is not None:
                error = task.exception()
                crashes.append(f"{type(error).__name__}: {error}")
            with contextlib.suppress(Exception):
                await launcher.stop()
            with _env(env):
                launcher = Launcher(launcher_settings)
            try:
                await launcher.start()
            except Exception as exc:  # its dependencies are still down: try again shortly  # noqa: BLE001
                crashes.append(f"start: {type(exc).__name__}: {exc}")
                await asyncio.sleep(2)

        async def restart_launcher() -> None:
            nonlocal launcher
            await launcher.stop()
            with _env(env):
                launcher = Launcher(launcher_settings)
            await launcher.start()
            counts["launcher"] += 1

        async def restart_watcher() -> None:
            nonlocal watcher
            await watcher.stop()
            watcher = PodWatcher(watcher_client, producer, watcher_settings)
            await watcher.start()
            counts["watcher"] += 1

        async def restart_apiserver() -> None:
            await asyncio.to_thread(cluster.restart_apiserver)
            counts["apiserver"] += 1

        async def fail_node() -> None:
            # The node with the most rollouts still running, so that some are surely lost with it.
            nonlocal failed_node
            pods = (await k8s.CoreV1Api(admin).list_namespaced_pod(namespace)).items
            busy = Counter(p.spec.node_name for p in pods if p.spec.node_name and p.status.phase in ("Pending", "Running"))
            if busy:
                failed_node = busy.most_common(1)[0][0]
            await asyncio.to_thread(cluster.fail_node, failed_node)

        plan: list[tuple[float, str, Callable[[], Awaitable[None]]]] = [
            (0.10, "node NotReady", fail_node),
            (0.20, "watcher restart", restart_watcher),
            (0.35, "launcher restart", restart_launcher),
            (0.50, "API server restart", restart_apiserver),
            (0.65, "watcher restart", restart_watcher),
        ]
        deadline = time.monotonic() + timeout_s
        last = (-1, time.monotonic())
        try:
            while ended() < len(expected):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{ended()} of {len(expected)} rollouts ended in {timeout_s:.0f} s; "
                                         f"{_state(launcher, watcher)}")
                if ended() != last[0]:
                    last = (ended(), time.monotonic())
                elif time.monotonic() - last[1] > 20:
                    say(f"no rollout ended for 20 s: {_state(launcher, watcher)}; read {len(events.received)} "
                        f"events ({await events.positions()})")
                    last = (ended(), time.monotonic())
                if plan and ended() >= plan[0][0] * len(expected):
                    _, what, action = plan.pop(0)
                    say(f"{ended()}/{len(expected)} ended: {what}")
                    await action()
                await keep_launcher()
                events.check()
                if watcher._tasks and any(t.done() and t.exception() for t in watcher._tasks):
                    raise AssertionError("the pod watcher died")
                await asyncio.sleep(0.2)
            say(f"all {len(expected)} ended after {time.monotonic() - started:.0f} s; waiting for the TTL clean-up")
            wall_s = time.monotonic() - started
            core = k8s.CoreV1Api(admin)
            pods_left = secrets_left = -1
            for _ in range(int((finished_ttl_s + 60) / 0.5)):
                pods_left = len((await core.list_namespaced_pod(namespace)).items)
                secrets_left = len((await core.list_namespaced_secret(namespace)).items)
                if pods_left == 0 and secrets_left == 0:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.5)  # late repeats, if any, would arrive now
        finally:
            stop_watching.set()
            watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch_task
            with contextlib.suppress(Exception):
                await launcher.stop()
            await watcher.stop()
            await events.stop()
    launched_by = {r.event.rollout_id: r.kafka_ms / 1000 for r in reversed(events.received)
                   if r.event.phase is RolloutPhase.SCHEDULED}
    return ScenarioResult(
        rollouts=expected, events=events.received, launch_times=list(launched_by.values()),
        transitions=transitions, launcher_restarts=counts["launcher"], launcher_crashes=crashes,
        watcher_restarts=counts["watcher"], apiserver_restarts=counts["apiserver"], failed_node=failed_node,
        requests=cluster.request_counts(), wall_s=wall_s, pods_left=pods_left, secrets_left=secrets_left,
        notes={"namespace": namespace, "max_in_flight": max_in_flight, "nodes": len(cluster.node_names)},
    )


def _state(launcher: Launcher, watcher: PodWatcher) -> str:
    """What the launcher and the watcher are doing, for a run that stalls."""
    task = launcher._task
    return (f"launcher launched {launcher.launched}, skipped {launcher.skipped}, task "
            f"{'done' if task is not None and task.done() else 'running' if task else 'none'}, holding "
            f"{launcher._work.task.task_id if launcher._work else None}, backlog {len(launcher._backlog)}, "
            f"assigned {sorted(tp.partition for tp in launcher._consumer.assignment())}, "
            f"paused {len(launcher._consumer.paused())}; watcher {watcher.stats}")


def infra_marking_errors(result: ScenarioResult) -> list[str]:
    """Terminal events whose ``infrastructure_failure`` disagrees with the failure taxonomy."""
    wrong = []
    for rollout_id, event in result.terminal().items():
        failure = classify(event.phase, event.reason)
        expected = failure is not None and failure.is_infrastructure
        if event.infrastructure_failure != expected:
            wrong.append(f"{rollout_id}: {event.phase.value}/{event.reason} marked {event.infrastructure_failure}")
    return wrong


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
