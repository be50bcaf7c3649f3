"""`openforge report harnesses` on a run of Claude Code, Codex and OpenClaw, each through the real proxy.

The harnesses run as ``test_harnesses_with_scripted_engine`` runs them (installed from npm, configured by
base URL and key only, a two-turn shell-tool task), against the scripted engine with its exact template:
a turn comes back token for token where the harness keeps its history as it was sent. The test plays the
launcher and the verifier (lifecycle events and the reward), the real assembler joins the calls, and
the real command prints the report, whose merge rates and drift reasons are those of each harness's
own behaviour.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from netutil import free_port
from proxy_helpers import proxy_in_front_of
from scripted_engine import ScriptedEngine
from test_harnesses_with_scripted_engine import (  # noqa: F401 - harness_bin is a fixture
    COMMAND,
    EXPECTED_OUTPUT,
    HARNESSES,
    Run,
    harness_bin,
    run_harness,
)

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from schemas import RewardV1, RolloutEventV1
from schemas.rollout.v1 import Backend, RolloutPhase
from stream import REWARDS, ROLLOUTS, EventProducer, KafkaSettings, TopicRegistry
from stream.tooling import read_topic
from stream.topics import TRAJECTORIES

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]


def _lifecycle(rollout_id: str, task_id: str, run_id: str, harness: str, phase: RolloutPhase) -> RolloutEventV1:
    return RolloutEventV1(rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=0, group_size=1,
                          harness=harness, phase=phase, backend=Backend.LOCAL,
                          harness_exit_code=0 if phase is RolloutPhase.SUCCEEDED else None)


async def test_the_report_gives_each_harness_its_merge_rate_and_names_openclaws_drift(
        harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,  # noqa: F811 - the fixture
        tmp_path: Path) -> None:
    run_id = f"{kafka_settings.topic_prefix}harnesses"
    engine = ScriptedEngine(command=COMMAND, exact_turns=True)
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path) as proxy, \
            EventProducer(kafka_settings) as producer:
        for harness in HARNESSES:
            rollout_id = f"report-{harness.name}-{uuid.uuid4().hex[:8]}"
            task_id = f"task-{harness.name}"
            await producer.publish(ROLLOUTS, _lifecycle(rollout_id, task_id, run_id, harness.name,
                                                        RolloutPhase.SCHEDULED))
            run = Run(harness_bin, tmp_path / harness.name, proxy.base(rollout_id), proxy.token(rollout_id))
            await run_harness(harness, run)
            assert run.exit_code == 0, run.describe()
            await producer.publish(ROLLOUTS, _lifecycle(rollout_id, task_id, run_id, harness.name,
                                                        RolloutPhase.SUCCEEDED))
            value = 1.0 if EXPECTED_OUTPUT in harness.final_answer(run) else 0.0
            await producer.publish(REWARDS, RewardV1(rollout_id=rollout_id, task_id=task_id, value=value,
                                                     verifier_id=f"verifier:{rollout_id}"))
    settings = AssemblerSettings.model_validate({
        "group_id": f"{kafka_settings.topic_prefix}assembler", "grace_s": 0.2, "commit_interval_s": 0.2,
        "poll_timeout_ms": 100, "session_timeout_ms": 6000})
    async with AssemblerService(settings, kafka_settings) as service:
        for _ in range(300):
            if service.stats.published >= len(HARNESSES):
                break
            await asyncio.sleep(0.1)
    published = [r async for r in read_topic(kafka_settings, topics[TRAJECTORIES].name)]
    assert len(published) == len(HARNESSES)

    env = {**os.environ, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix}
    table = subprocess.run([sys.executable, "-m", "openforge", "report", "harnesses", "--run", run_id], env=env,
                           capture_output=True, text=True, timeout=120, check=True)
    print(table.stdout)
    done = subprocess.run([sys.executable, "-m", "openforge", "report", "harnesses", "--run", run_id, "--json"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    rows = {row["harness"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {h.name for h in HARNESSES}
    assert all(row["mean_reward"] == 1.0 and row["rollouts"] == 1 for row in rows.values())
    # Claude Code and Codex send their history back as it was: the second turn extends the first.
    for name in ("claude-code", "codex"):
        assert (rows[name]["merge_rate"], rows[name]["merged"], rows[name]["breaks"]) == (1.0, 1, 0), rows[name]
        assert rows[name]["drift_reasons"] == {}
    # OpenClaw puts its trailing context message after the newest turn every time.
    assert (rows["openclaw"]["merge_rate"], rows["openclaw"]["breaks"]) == (0.0, 1), rows["openclaw"]
    assert rows["openclaw"]["drift_reasons"] == {"message_moved": 1}
    assert "openclaw" in table.stdout and "message_moved 1" in table.stdout
