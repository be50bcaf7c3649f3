"""The whole rollout path with real parts: launcher, local backend, an OpenAI-SDK agent, the real proxy
in front of real vLLM (CPU), the verifier reporting through `openforge reward`, and the real broker."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from proxy_helpers import RunningProxy
from rollout_events import collect, lifecycle
from rollout_tasks import CHECK_ANSWER, ECHO_AGENT, KEY, task_dict

from consumers.rollouts.launcher import Launcher, LauncherSettings, rollout_id_for
from schemas import ModelCallV1, RewardV1, TaskV1
from schemas.credentials import Role
from schemas.rollout.v1 import RolloutPhase, RolloutReason
from stream import CALLS, REWARDS, TASKS, EventProducer

pytestmark = pytest.mark.kafka


async def submit(proxy: RunningProxy, tasks: Sequence[TaskV1]) -> None:
    async with EventProducer(proxy.settings.kafka, registry=proxy.registry) as producer:
        for task in tasks:
            await producer.publish(TASKS, task)


async def test_group_of_agents_through_proxy_with_rewards_only_from_verifiers(
        proxy: RunningProxy, tmp_path: Path) -> None:
    good = TaskV1.model_validate({
        **task_dict("hello", group_size=2, timeout_s=100, harness=[*ECHO_AGENT, "Say hello."], verifier=CHECK_ANSWER),
        "harness": {"name": "echo-agent", "launch": {"kind": "local", "command": [*ECHO_AGENT, "Say hello."]}}})
    broken = TaskV1.model_validate({
        **task_dict("broken-verifier", group_size=2, timeout_s=100),
        "harness": {"name": "echo-agent", "launch": {"kind": "local", "command": [*ECHO_AGENT, "Say hi."]}},
        "verifier": {"command": [*CHECK_ANSWER, "crash"]}})
    await submit(proxy, [good, broken])
    kafka = proxy.settings.kafka
    settings = LauncherSettings(credential_key=KEY.decode(), kafka=kafka, proxy_url=proxy.url,
                                state_dir=tmp_path / "state", workspace_root=tmp_path / "ws",
                                group_id=f"{kafka.topic_prefix}launcher", max_in_flight=2,
                                pace=False)  # no learner here: launch what the cap allows
    async with Launcher(settings):
        by_rollout = await lifecycle(kafka, proxy.registry, 4, timeout_s=110)

    good_ids = {rollout_id_for("hello", i) for i in range(2)}
    broken_ids = {rollout_id_for("broken-verifier", i) for i in range(2)}
    assert set(by_rollout) == good_ids | broken_ids
    for rollout_id in good_ids:
        phases = [e.phase for e in by_rollout[rollout_id]]
        assert phases == [RolloutPhase.SCHEDULED, RolloutPhase.RUNNING, RolloutPhase.SUCCEEDED], (
            rollout_id, by_rollout[rollout_id][-1].message)
    for rollout_id in broken_ids:
        last = by_rollout[rollout_id][-1]
        assert (last.phase, last.reason, last.harness_exit_code, last.verifier_exit_code) == (
            RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, 0, 1)
        assert "verifier crashed on purpose" in (last.message or "")

    calls = await collect(kafka, proxy.registry, CALLS, lambda e: len(e) >= 8, timeout_s=30)
    assert all(isinstance(c, ModelCallV1) for c in calls)
    per_rollout: dict[str, list[ModelCallV1]] = {}
    for call in calls:
        per_rollout.setdefault(call.rollout_id, []).append(call)
    assert {r: len(c) for r, c in per_rollout.items()} == dict.fromkeys(good_ids | broken_ids, 2)
    for rollout_id, rollout_calls in per_rollout.items():
        assert {c.task_id for c in rollout_calls} == {"hello" if rollout_id in good_ids else "broken-verifier"}
        assert all(len(c.choices[0].completion_token_ids) > 0 for c in rollout_calls)

    rewards = await collect(kafka, proxy.registry, REWARDS, lambda e: len(e) >= 2, timeout_s=20)
    assert all(isinstance(r, RewardV1) for r in rewards)
    assert sorted(r.rollout_id for r in rewards) == sorted(good_ids)  # none invented for the crashed verifiers
    assert all(r.value == 1.0 and r.info["answer_chars"] > 0 for r in rewards)
    assert {r.verifier_id for r in rewards} == {f"verifier:{r}" for r in good_ids}


async def test_reward_command_refused_with_an_agent_token_is_not_retried(proxy: RunningProxy) -> None:
    rollout_id = rollout_id_for("t", 0)
    env = {**os.environ, "OPENFORGE_PROXY_URL": proxy.url, "OPENFORGE_ROLLOUT_ID": rollout_id,
           "OPENFORGE_VERIFIER_TOKEN": proxy.token(rollout_id, Role.AGENT)}
    run = await asyncio.create_subprocess_exec(sys.executable, "-m", "openforge", "reward", "--value", "1", env=env,
                                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await run.communicate()
    assert run.returncode == 1
    assert "refused the reward (403)" in err.decode() and "retrying" not in err.decode()

    env["OPENFORGE_VERIFIER_TOKEN"] = proxy.token(rollout_id, Role.VERIFIER, task_id="t")
    run = await asyncio.create_subprocess_exec(sys.executable, "-m", "openforge", "reward", "--value", "0.25",
                                               "--info", '{"tests": 3}', env=env,
                                               stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await run.communicate()
    assert run.returncode == 0, err.decode()
    rewards = await collect(proxy.settings.kafka, proxy.registry, REWARDS, lambda e: len(e) >= 1, timeout_s=20)
    assert [(r.rollout_id, r.task_id, r.value, r.info) for r in rewards] == [(rollout_id, "t", 0.25, {"tests": 3})]
