"""The local backend against the real broker: processes, environments, deadlines, lifecycle events."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from assembled import assemble, counted_in_groups
from netutil import free_port
from proxy_helpers import proxy_in_front_of
from rollout_events import collect, lifecycle
from rollout_tasks import CHECK_ANSWER, ECHO_AGENT, KEY, PROBE, log_lines, make_task

from consumers.rollouts.backend import ENV_AGENT_KEYS, ENV_REWARD_URL, ENV_VERIFIER_TOKEN, RolloutSpec
from consumers.rollouts.launcher import build_spec
from consumers.rollouts.local import LocalBackend
from schemas import ModelCallV1, TaskV1
from schemas.call.v1 import CallStatus
from schemas.failures import FailureReason
from schemas.rollout.v1 import Backend, RolloutPhase, RolloutReason
from stream import CALLS, EventProducer, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka


@pytest.fixture
async def producer(kafka_settings: KafkaSettings, topics: TopicRegistry) -> AsyncIterator[EventProducer]:
    async with EventProducer(kafka_settings, registry=topics) as producer:
        yield producer


def new_backend(producer: EventProducer, tmp_path: Path, **kwargs: object) -> LocalBackend:
    environ = {**os.environ, "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode()}  # what a launcher's env holds
    return LocalBackend(producer, tmp_path / "state", workspace_root=tmp_path / "ws", kill_grace_s=0.5,
                        base_environ=environ, **kwargs)  # type: ignore[arg-type]


def spec_of(task: TaskV1, index: int = 0, proxy_url: str = "http://127.0.0.1:9") -> RolloutSpec:
    return build_spec(task, index, proxy_url=proxy_url, key=KEY, token_ttl_s=600, backend=Backend.LOCAL)


async def test_harness_then_verifier_with_separate_environments(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    task = make_task("env", group_size=2, harness=[*PROBE, str(log), "env", str(tmp_path / "harness-env.json")],
                     verifier=[*PROBE, str(log), "env", str(tmp_path / "verifier-env.json")])
    (tmp_path / "ws").mkdir()
    backend = new_backend(producer, tmp_path)
    await backend.start()
    try:
        spec = spec_of(task, 1)
        assert await backend.launch(spec) is True
        assert await backend.launch(spec) is False  # already exists: not launched twice
        await backend.wait_idle()
        assert await backend.active() == set()
        assert await backend.existing() == {spec.rollout_id}
    finally:
        await backend.stop()
    events = (await lifecycle(kafka_settings, topics, 1))[spec.rollout_id]
    assert [e.phase for e in events] == [RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED]
    done = events[-1]
    assert (done.harness_exit_code, done.verifier_exit_code, done.reason) == (0, 0, None)
    assert (done.task_id, done.group_index, done.group_size, done.harness, done.backend) == (
        "env", 1, 2, "probe", Backend.LOCAL)
    harness_env = json.loads((tmp_path / "harness-env.json").read_text())
    verifier_env = json.loads((tmp_path / "verifier-env.json").read_text())
    assert ENV_VERIFIER_TOKEN not in harness_env and ENV_REWARD_URL not in harness_env
    assert "OPENFORGE_PROXY_CREDENTIAL_KEY" not in harness_env  # the signing key stays behind
    assert all(harness_env[k] == spec.harness_env[k] for k in ENV_AGENT_KEYS)
    assert verifier_env[ENV_VERIFIER_TOKEN] == spec.verifier_env[ENV_VERIFIER_TOKEN]
    assert [what for _, what, _ in log_lines(log)] == ["start", "end", "start", "end"]  # verifier after harness
    assert list((tmp_path / "ws").iterdir()) == []  # the temporary workspace is cleaned up


async def test_bad_rollouts_end_with_clear_reasons(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    container = make_task("container").model_dump()
    container["harness"]["launch"] = {"kind": "container", "image": "ghcr.io/x/agent:1", "command": ["agent"]}
    tasks = {
        "unknown-harness": make_task("unknown-harness", harness=["no-such-harness-binary", "--go"]),
        "container": TaskV1.model_validate(container),
        "hangs": make_task("hangs", timeout_s=1.5, harness=[*PROBE, str(log), "hang"],
                           verifier=[*PROBE, str(tmp_path / "verifier-ran")]),
        "verifier-crashes": make_task("verifier-crashes", verifier=[
            sys.executable, "-c", "import sys; print('checking'); sys.stdout.flush(); raise SystemExit('boom: no answer')"]),
        "verifier-killed": make_task("verifier-killed", verifier=[
            sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
        "harness-fails": make_task("harness-fails", harness=[*PROBE, str(log), "exit", "7"],
                                   verifier=[*PROBE, str(tmp_path / "verifier-ran")]),
        "verifier-slow": make_task("verifier-slow", verifier=[*PROBE, str(log), "sleep", "30"]).model_copy(
            update={"verifier": make_task().verifier.model_copy(
                update={"command": [*PROBE, str(log), "sleep", "30"], "timeout_s": 1.0})}),
    }
    backend = new_backend(producer, tmp_path)
    await backend.start()
    try:
        specs = {name: spec_of(task) for name, task in tasks.items()}
        for spec in specs.values():
            assert await backend.launch(spec)
        await asyncio.wait_for(backend.wait_idle(), 60)
    finally:
        await backend.stop()
    by_rollout = await lifecycle(kafka_settings, topics, len(tasks))
    last = {name: by_rollout[spec.rollout_id][-1] for name, spec in specs.items()}

    assert last["unknown-harness"].phase is RolloutPhase.FAILED
    assert "'no-such-harness-binary' could not start" in (last["unknown-harness"].message or "")
    assert last["unknown-harness"].infrastructure_failure

    assert last["container"].phase is RolloutPhase.FAILED
    assert "needs the kubernetes backend" in (last["container"].message or "")
    assert last["container"].infrastructure_failure

    assert (last["hangs"].phase, last["hangs"].reason) == (RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED)
    assert not last["hangs"].infrastructure_failure  # the agent spent the time
    assert not (tmp_path / "verifier-ran").exists()  # no verifier after a timed-out harness
    assert [p.phase for p in by_rollout[specs["hangs"].rollout_id]] == [RolloutPhase.RUNNING, RolloutPhase.TIMED_OUT]

    crashed = last["verifier-crashes"]
    assert (crashed.phase, crashed.reason, crashed.harness_exit_code, crashed.verifier_exit_code) == (
        RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, 0, 1)
    assert "boom: no answer" in (crashed.message or "")
    killed = last["verifier-killed"]
    assert (killed.reason, killed.verifier_exit_code) == (RolloutReason.VERIFIER_FAILED, -signal.SIGKILL)
    assert "killed by signal 9" in (killed.message or "")

    failed = last["harness-fails"]
    assert (failed.phase, failed.reason, failed.harness_exit_code) == (RolloutPhase.FAILED, RolloutReason.EXIT_CODE, 7)
    assert not failed.infrastructure_failure

    slow = last["verifier-slow"]
    assert (slow.phase, slow.reason) == (RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED)
    # A verifier that crashed, was killed or overran is ours to fix, as the pod watcher says of it too.
    assert crashed.infrastructure_failure and killed.infrastructure_failure and slow.infrastructure_failure
    assert "its own timeout of 1s" in (slow.message or "")
    assert all(len([e for e in events if e.is_terminal]) == 1 for events in by_rollout.values())


async def test_stop_cancels_running_rollouts(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    backend = new_backend(producer, tmp_path)
    await backend.start()
    spec = spec_of(make_task("long", harness=[*PROBE, str(log), "sleep", "60"]))
    await backend.launch(spec)
    for _ in range(100):
        if log_lines(log):
            break
        await asyncio.sleep(0.1)
    assert await backend.active() == {spec.rollout_id}
    await backend.stop()
    await backend.stop()  # idempotent
    events = (await lifecycle(kafka_settings, topics, 1))[spec.rollout_id]
    assert (events[-1].phase, events[-1].reason) == (RolloutPhase.CANCELLED, RolloutReason.SHUTDOWN)
    assert events[-1].infrastructure_failure


async def test_restart_knows_what_exists_and_ends_orphans(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    first = new_backend(producer, tmp_path)
    await first.start()
    done = spec_of(make_task("done"))
    await first.launch(done)
    await first.wait_idle()
    await first.stop()
    # A rollout whose launcher died mid-run: its state folder and a live process group remain.
    orphan = spec_of(make_task("orphan"))
    folder = tmp_path / "state" / orphan.rollout_id
    folder.mkdir()
    (folder / "rollout.json").write_bytes(orjson.dumps({
        "rollout_id": orphan.rollout_id, "task_id": "orphan", "run_id": None, "group_index": 0, "group_size": 1,
        "harness": "probe"}))
    leftover = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    stat = await asyncio.to_thread(Path(f"/proc/{leftover.pid}/stat").read_text)
    (folder / "process.json").write_bytes(orjson.dumps(
        {"pgid": leftover.pid, "start_ticks": int(stat.rpartition(")")[2].split()[19])}))

    second = new_backend(producer, tmp_path)
    await second.start()
    try:
        assert await second.existing() == {done.rollout_id, orphan.rollout_id}
        assert await second.launch(done) is False
        assert await second.launch(orphan) is False
        assert await asyncio.wait_for(leftover.wait(), 10) == -signal.SIGKILL  # the unsupervised process was ended
    finally:
        await second.stop()
    by_rollout = await lifecycle(kafka_settings, topics, 2)
    assert [e.phase for e in by_rollout[done.rollout_id]] == [RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED]
    ended = by_rollout[orphan.rollout_id]
    assert len(ended) == 1 and ended[0].phase is RolloutPhase.FAILED and ended[0].infrastructure_failure
    assert ended[0].reason is RolloutReason.SHUTDOWN
    assert "launcher stopped while this rollout ran" in (ended[0].message or "")


async def test_infrastructure_outcomes_are_marked_and_left_out_of_group_statistics(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    members = {  # one group of one task, each member ending its own way
        "verifier-crashes": {"verifier": [sys.executable, "-c", "raise SystemExit('verifier crashed')"]},
        "no-reward": {},  # harness and verifier exit 0, but no verifier reported a reward
        "shutdown": {"harness": [*PROBE, str(log), "sleep", "60"]},
        "exit-code": {"harness": [*PROBE, str(log), "exit", "7"]},
    }
    specs = {name: spec_of(make_task("mixed", group_size=len(members), **kwargs), index)
             for index, (name, kwargs) in enumerate(members.items())}
    backend = new_backend(producer, tmp_path)
    await backend.start()
    try:
        for spec in specs.values():
            assert await backend.launch(spec)
        running = specs["shutdown"].rollout_id
        for _ in range(300):
            if await backend.active() == {running} and any(r == running for r, _, _ in log_lines(log)):
                break
            await asyncio.sleep(0.1)
        assert await backend.active() == {running}
    finally:
        await backend.stop()  # the launcher shuts down while "shutdown" runs
    last = {name: (await lifecycle(kafka_settings, topics, len(members)))[spec.rollout_id][-1]
            for name, spec in specs.items()}
    trajectories = await assemble(kafka_settings, topics, [spec.rollout_id for spec in specs.values()])

    expected = {
        "verifier-crashes": (RolloutReason.VERIFIER_FAILED, FailureReason.VERIFIER_FAILED),
        "no-reward": (None, FailureReason.REWARD_TIMEOUT),
        "shutdown": (RolloutReason.SHUTDOWN, FailureReason.SHUTDOWN),
        "exit-code": (RolloutReason.EXIT_CODE, FailureReason.EXIT_CODE),
    }
    for name, (reason, failure) in expected.items():
        event, trajectory = last[name], trajectories[specs[name].rollout_id]
        assert event.reason is reason, name
        if event.phase is not RolloutPhase.SUCCEEDED:  # the lifecycle event already says whose fault it is
            assert event.infrastructure_failure is failure.is_infrastructure, name
        assert (trajectory.failure_reason, trajectory.infrastructure_failure) == (failure, failure.is_infrastructure), name
    # The group completes with all four, but only the policy's own failure enters its statistics.
    assert counted_in_groups(trajectories.values()) == {"mixed": {specs["exit-code"].rollout_id}}


async def test_a_harness_that_exits_after_the_proxy_answered_5xx_is_an_infrastructure_failure(
        producer: EventProducer, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    no_engine = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the proxy answers every call 502
    async with proxy_in_front_of(no_engine, kafka_settings, topics, tmp_path) as proxy:
        agent = spec_of(make_task("engine-down", group_size=2, harness=[*ECHO_AGENT, "Say hello."],
                                  verifier=CHECK_ANSWER), 0, proxy_url=proxy.url)
        on_its_own = spec_of(make_task("engine-down", group_size=2, harness=[*PROBE, str(tmp_path / "log"), "exit", "3"]),
                             1, proxy_url=proxy.url)
        backend = new_backend(producer, tmp_path)
        await backend.start()
        try:
            assert await backend.launch(agent) and await backend.launch(on_its_own)
            await asyncio.wait_for(backend.wait_idle(), 90)
        finally:
            await backend.stop()
    ended = (await lifecycle(kafka_settings, topics, 2))[agent.rollout_id][-1]
    # The backend sees only a harness that exited 1 (the SDK's error); the calls show why.
    assert (ended.phase, ended.reason, ended.harness_exit_code, ended.infrastructure_failure) == (
        RolloutPhase.FAILED, RolloutReason.EXIT_CODE, 1, False)
    calls = await collect(kafka_settings, topics, CALLS, lambda e: len(e) >= 1, timeout_s=20)
    assert calls and all(isinstance(c, ModelCallV1) and c.rollout_id == agent.rollout_id for c in calls)
    assert {c.status for c in calls} == {CallStatus.UPSTREAM_UNREACHABLE}

    trajectories = await assemble(kafka_settings, topics, [agent.rollout_id, on_its_own.rollout_id])
    failed = trajectories[agent.rollout_id]
    assert (failed.failure_reason, failed.infrastructure_failure) == (FailureReason.UPSTREAM_FAILED, True)
    assert failed.merge_stats.calls == len(calls) and failed.samples == []
    alone = trajectories[on_its_own.rollout_id]
    assert (alone.failure_reason, alone.infrastructure_failure) == (FailureReason.EXIT_CODE, False)
    assert counted_in_groups(trajectories.values()) == {"engine-down": {on_its_own.rollout_id}}
