"""The launcher on the real broker with the local backend: cap, idempotence, restart, submit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
from assembled import assemble, counted_in_groups
from rollout_events import collect, lifecycle
from rollout_tasks import KEY, PROBE, log_lines, task_dict
from trajectories import trajectory

from consumers.rollouts.launcher import Launcher, LauncherSettings, rollout_id_for
from schemas import DeadLetterV1, RolloutEventV1, TaskV1
from schemas.failures import FailureReason
from schemas.rollout.v1 import RolloutPhase, RolloutReason
from stream import CHECKPOINTS, DEAD_LETTERS, TASKS, TRAJECTORIES, EventProducer, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka


def settings_for(kafka: KafkaSettings, tmp_path: Path, **updates: object) -> LauncherSettings:
    base = LauncherSettings(credential_key=KEY.decode(), kafka=kafka, state_dir=tmp_path / "state",
                            workspace_root=tmp_path / "ws", group_id=f"{kafka.topic_prefix}launcher",
                            proxy_url="http://127.0.0.1:9", capacity_poll_s=0.2, kill_grace_s=0.5,
                            pace=False)  # no learner here: launch what the cap allows
    return base.model_copy(update=updates)


async def submit(kafka: KafkaSettings, registry: TopicRegistry, tasks: Sequence[TaskV1]) -> None:
    async with EventProducer(kafka, registry=registry) as producer:
        for task in tasks:
            await producer.publish(TASKS, task)


def max_overlap(lines: list[tuple[str, str, float]]) -> int:
    running = peak = 0
    for _, what, _ in sorted(lines, key=lambda line: line[2]):
        running += 1 if what == "start" else -1
        peak = max(peak, running)
    return peak


async def test_launches_every_rollout_once_within_the_cap(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    tasks = [TaskV1.model_validate(task_dict(f"cap-{i}", group_size=3, harness=[*PROBE, str(log), "sleep", "0.7"]))
             for i in range(2)]
    async with EventProducer(kafka_settings, registry=topics) as producer:
        await producer.send_raw(topics[TASKS].name, b"not an event", key=b"junk")
    await submit(kafka_settings, topics, tasks)
    async with Launcher(settings_for(kafka_settings, tmp_path, max_in_flight=2)) as launcher:
        by_rollout = await lifecycle(kafka_settings, topics, 6, timeout_s=90)
        assert launcher.launched == 6 and launcher.skipped == 0
        assert launcher.dead_lettered == 1
        for _ in range(50):  # offsets are committed once a second
            if sum(launcher.committed_offsets.values()) == 3:
                break
            await asyncio.sleep(0.1)
        assert sum(launcher.committed_offsets.values()) == 3  # junk + two tasks, all handled
    expected = {rollout_id_for(t.task_id, i) for t in tasks for i in range(3)}
    assert set(by_rollout) == expected
    starts = Counter(r for r, what, _ in log_lines(log) if what == "start")
    assert starts == dict.fromkeys(expected, 1)
    assert max_overlap(log_lines(log)) <= 2
    for rollout_id, events in by_rollout.items():
        assert [e.phase for e in events] == [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED]
        scheduled = events[0]
        assert (scheduled.group_size, scheduled.harness) == (3, "probe")
        assert rollout_id_for(scheduled.task_id, scheduled.group_index) == rollout_id
    letters = await collect(kafka_settings, topics, DEAD_LETTERS, lambda e: len(e) >= 1, timeout_s=10)
    assert len(letters) == 1 and isinstance(letters[0], DeadLetterV1) and letters[0].key == b"junk"


async def test_launcher_killed_mid_batch_launches_nothing_twice(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    log = tmp_path / "log"
    tasks = [TaskV1.model_validate(task_dict(f"kill-{i}", group_size=3, harness=[*PROBE, str(log), "sleep", "1.5"]))
             for i in range(2)]
    await submit(kafka_settings, topics, tasks)
    env = {**os.environ,
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(),
           "OPENFORGE_LAUNCHER_STATE_DIR": str(tmp_path / "state"),
           "OPENFORGE_LAUNCHER_WORKSPACE_ROOT": str(tmp_path / "ws"),
           "OPENFORGE_LAUNCHER_GROUP_ID": f"{kafka_settings.topic_prefix}launcher",
           "OPENFORGE_LAUNCHER_MAX_IN_FLIGHT": "2",
           "OPENFORGE_LAUNCHER_CAPACITY_POLL_S": "0.2",
           "OPENFORGE_LAUNCHER_PACE": "false"}
    command = [sys.executable, "-m", "openforge", "launcher", "--proxy-url", "http://127.0.0.1:9"]
    with (tmp_path / "first.log").open("wb") as first_log:
        first = await asyncio.create_subprocess_exec(*command, env=env, stderr=first_log)
    try:
        for _ in range(600):  # kill it once the batch is under way: some rollouts started, some not
            if sum(1 for _, what, _ in log_lines(log) if what == "start") >= 3:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the first launcher started fewer than 3 rollouts: " + (tmp_path / "first.log").read_text())
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()
    started_before = {r for r, what, _ in log_lines(log) if what == "start"}
    assert 3 <= len(started_before) < 6

    # While no launcher runs, nothing ends the rollouts the dead one was running: the assembler closes
    # them as lifecycle timeouts, infrastructure failures (those that had ended, without a reward, as
    # reward timeouts), and none enters its group's statistics.
    closed = await assemble(kafka_settings, topics, started_before)
    verdicts = {(t.failure_reason, t.infrastructure_failure) for t in closed.values()
                if t.phase is None or not t.phase.is_terminal}
    assert verdicts == {(FailureReason.LIFECYCLE_TIMEOUT, True)}
    assert all(t.failure_reason is FailureReason.REWARD_TIMEOUT and t.infrastructure_failure
               for t in closed.values() if t.phase is RolloutPhase.SUCCEEDED)
    assert all(not counted for counted in counted_in_groups(closed.values()).values())

    with (tmp_path / "second.log").open("wb") as second_log:
        second = await asyncio.create_subprocess_exec(*command, env=env, stderr=second_log)
    try:
        by_rollout = await lifecycle(kafka_settings, topics, 6, timeout_s=90)
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 60) == 0

    expected = {rollout_id_for(t.task_id, i) for t in tasks for i in range(3)}
    assert set(by_rollout) == expected
    starts = Counter(r for r, what, _ in log_lines(log) if what == "start")
    assert starts == dict.fromkeys(expected, 1), "a rollout was launched twice"
    for rollout_id, events in by_rollout.items():
        terminal = [e for e in events if e.is_terminal]
        assert len(terminal) == 1, (rollout_id, events)
        # A duplicate "scheduled" may be re-sent after the kill, but with the same event id.
        assert len({e.event_id for e in events if e.phase is RolloutPhase.SCHEDULED}) == 1
        if rollout_id in started_before and terminal[0].phase is RolloutPhase.FAILED:
            assert terminal[0].infrastructure_failure  # ended when its launcher died, and said so
            assert terminal[0].reason is RolloutReason.SHUTDOWN


async def test_submit_publishes_all_or_nothing(kafka_settings: KafkaSettings, topics: TopicRegistry,
                                               tmp_path: Path) -> None:
    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([orjson.dumps(task_dict("a")).decode(), "{oops",
                              orjson.dumps(task_dict("b", group_size=-1)).decode(),
                              orjson.dumps(task_dict("c")).decode()]) + "\n")
    run = await asyncio.create_subprocess_exec(sys.executable, "-m", "openforge", "submit", str(bad), env=env,
                                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await run.communicate()
    assert run.returncode == 1
    text = err.decode()
    assert f"{bad}:line 2: not valid JSON" in text and f"{bad}:line 3: group_size" in text
    assert "2 invalid line(s)" in text and "nothing was published" in text

    good = tmp_path / "good.jsonl"
    good.write_text("".join(orjson.dumps(task_dict(f"t{i}", group_size=2)).decode() + "\n" for i in range(5)))
    run = await asyncio.create_subprocess_exec(sys.executable, "-m", "openforge", "submit", str(good), env=env,
                                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await run.communicate()
    assert run.returncode == 0, err.decode()
    assert "published 5 task(s) (10 rollouts)" in out.decode()
    published = await collect(kafka_settings, topics, TASKS, lambda e: len(e) >= 5, timeout_s=20)
    assert sorted(t.task_id for t in published) == [f"t{i}" for i in range(5)]  # and none of the bad file's


def test_reward_command_without_environment_says_what_is_missing() -> None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    run = subprocess.run([sys.executable, "-m", "openforge", "reward", "--value", "1"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "OPENFORGE_VERIFIER_TOKEN" in run.stderr and "not set" in run.stderr
    assert isinstance(RolloutEventV1, type)


async def test_pacing_starts_only_what_the_learner_can_train_in_time(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The learner's progress and the engines' versions, as their notices on the checkpoints topic."""
    from datetime import UTC, datetime

    from schemas import CheckpointAppliedV1, LearnerProgressV1

    async def progress(**kw: int) -> None:
        # A bound of 0, a checkpoint every step, one group per step: one group at a time may be out.
        fields = dict(version=0, step=0, steps_since_checkpoint=0, pending=0, max_staleness=0,
                      checkpoint_every=1, groups_per_step=1, min_group_size=2) | kw
        async with EventProducer(kafka_settings, registry=topics) as producer:
            await producer.publish(CHECKPOINTS, LearnerProgressV1(model="m", **fields))

    async def launched_after(seconds: float) -> int:
        await asyncio.sleep(seconds)
        return launcher.launched

    log = tmp_path / "log"
    tasks = [TaskV1.model_validate(task_dict(f"pace-{i}", group_size=2, harness=[*PROBE, str(log), "sleep", "3"]))
             for i in range(3)]
    # A group of one, where the learner trains groups of two: refused, with what to submit instead.
    single = TaskV1.model_validate(task_dict("pace-single", group_size=1, harness=[*PROBE, str(log), "sleep", "0"]))
    await submit(kafka_settings, topics, [single, *tasks])
    async with Launcher(settings_for(kafka_settings, tmp_path, pace=True, learner_model="m")) as launcher:
        assert await launched_after(3) == 0, "started before the learner said anything"
        await progress()
        for _ in range(300):
            if launcher.launched:
                break
            await asyncio.sleep(0.1)
        # Before they end (each runs 3 s), the learner says it holds two trajectories, untrained:
        # with those the window is full, so nothing more may start, now or once these two ended.
        await progress(pending=2)
        await lifecycle(kafka_settings, topics, 2, timeout_s=60)
        assert await launched_after(2) == 2
        # It trained them and published version 1, which no engine serves yet: still nothing.
        await progress(version=1, step=1)
        with caplog.at_level(logging.WARNING, logger="consumers.rollouts.launcher"):
            assert await launched_after(3) == 2
        # Beyond the bound of 0: the hold says which part to look at.
        assert "engines serve v0 but the learner published v1" in caplog.text
        assert "openforge publisher" in caplog.text
        async with EventProducer(kafka_settings, registry=topics) as producer:
            await producer.publish(CHECKPOINTS, CheckpointAppliedV1(
                model="m", version=1, replica="http://engine", applied_at=datetime.now(UTC), duration_s=1.0, ok=True))
        # The engine serves v1 and the learner holds nothing, but the two rollouts that ended have no
        # trajectory on the topic yet (the assembler publishes after its grace period): they still count.
        assert await launched_after(3) == 2
        starts = sorted((when, rollout) for rollout, what, when in log_lines(log) if what == "start")
        first = next(t for t in tasks if rollout_id_for(t.task_id, 0) in {r for _, r in starts})
        async with EventProducer(kafka_settings, registry=topics) as producer:
            for index in range(2):
                await producer.publish(TRAJECTORIES, trajectory(first.task_id, index, 2))
        by_rollout = await lifecycle(kafka_settings, topics, 4, timeout_s=60)
        assert len(by_rollout) >= 4  # and the next task once their trajectories arrived
        # Both rollouts of a task start together.
        starts = sorted((when, rollout) for rollout, what, when in log_lines(log) if what == "start")
        assert len({r.rsplit("-", 1)[0] for _, r in starts[:2]}) == 1, starts
        assert launcher.dead_lettered == 1 and not any("pace-single" in r for _, r in starts)
    letters = await collect(kafka_settings, topics, DEAD_LETTERS, lambda e: len(e) >= 1, timeout_s=10)
    assert "has group_size 1, but the learner trains groups of at least 2" in letters[0].reason
    assert "submit it with group_size >= 2" in letters[0].reason
