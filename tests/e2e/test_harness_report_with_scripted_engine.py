"""`openforge report harnesses` on a run of Claude Code, Codex and OpenClaw, each through the real proxy.

The harnesses run as ``test_harnesses_with_scripted_engine`` runs them (installed from npm, configured by
base URL and key only), on a task the scripted engine turns into :data:`TOOL_CALLS` shell-tool calls
before its final answer. The engine offers vLLM's token-in/token-out endpoints, so the proxy serves
every call by continuation, the default a user gets: a call extends the exact ids of the turn whose
messages the harness sent back unchanged, and falls back to a full render, with the reason on its
event, where the harness rewrote them. The test plays the launcher and the verifier (lifecycle events
and the reward), the real assembler joins the calls, and the real command prints the report, whose
merge rates and drift reasons are those of each harness's own behaviour.

The same run in chat mode (continuation switched off) shows what continuation changes: the engine's
template spells a tool call's tags as one id each where the model sampled word pieces (as real
hermes templates do), so no re-rendered turn extends the sampled one, whatever the harness does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netutil import free_port
from proxy_helpers import proxy_in_front_of, read_events
from scripted_engine import WEIGHT_VERSION, ScriptedEngine
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
from schemas import ModelCallV1, RewardV1, RolloutEventV1
from schemas.call.v1 import CallStatus
from schemas.rollout.v1 import Backend, RolloutPhase
from stream import CALLS, REWARDS, ROLLOUTS, EventProducer, KafkaSettings, TopicRegistry
from stream.tooling import read_topic
from stream.topics import TRAJECTORIES

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
TOOL_CALLS = 3
"""Shell-tool calls the script makes before it answers: a rollout of four turns."""


def _lifecycle(rollout_id: str, task_id: str, run_id: str, harness: str, phase: RolloutPhase) -> RolloutEventV1:
    return RolloutEventV1(rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=0, group_size=1,
                          harness=harness, phase=phase, backend=Backend.LOCAL,
                          harness_exit_code=0 if phase is RolloutPhase.SUCCEEDED else None)


@dataclass
class Report:
    """One run of the three harnesses, and what the report and the calls topic say of it."""

    engine: ScriptedEngine
    rollouts: dict[str, str]  # harness name -> rollout id
    calls: list[ModelCallV1]
    rows: dict[str, dict[str, Any]]  # harness name -> the report's row (--json)
    table: str  # the report as printed

    def fallbacks(self, harness: str) -> dict[str, int]:
        """The drift reasons on the harness's call events, counted."""
        counted: dict[str, int] = {}
        for call in self.calls:
            if call.rollout_id == self.rollouts[harness] and call.drift_reason is not None:
                counted[call.drift_reason.value] = counted.get(call.drift_reason.value, 0) + 1
        return counted


async def _run_and_report(bin_dir: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path,
                          *, continuation: bool) -> Report:
    """Run each harness once through the proxy, assemble, and read the report (printed and as JSON)."""
    run_id = f"{kafka_settings.topic_prefix}harnesses"
    engine = ScriptedEngine(command=COMMAND, exact_turns=True, token_endpoints=True, tool_turns=TOOL_CALLS)
    rollouts: dict[str, str] = {}
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path, continuation=continuation) as proxy, \
            EventProducer(kafka_settings) as producer:
        for harness in HARNESSES:
            rollout_id = rollouts[harness.name] = f"report-{harness.name}-{uuid.uuid4().hex[:8]}"
            task_id = f"task-{harness.name}"
            await producer.publish(ROLLOUTS, _lifecycle(rollout_id, task_id, run_id, harness.name,
                                                        RolloutPhase.SCHEDULED))
            run = Run(bin_dir, tmp_path / harness.name, proxy.base(rollout_id), proxy.token(rollout_id))
            await run_harness(harness, run)
            assert run.exit_code == 0, run.describe()
            await producer.publish(ROLLOUTS, _lifecycle(rollout_id, task_id, run_id, harness.name,
                                                        RolloutPhase.SUCCEEDED))
            value = 1.0 if EXPECTED_OUTPUT in harness.final_answer(run) else 0.0
            await producer.publish(REWARDS, RewardV1(rollout_id=rollout_id, task_id=task_id, value=value,
                                                     verifier_id=f"verifier:{rollout_id}"))
    calls = sorted((e for e in await read_events(kafka_settings, topics, CALLS, expect=len(engine.seen))
                    if isinstance(e, ModelCallV1)), key=lambda e: e.timings.started_at)
    assert len(calls) == len(engine.seen)
    for seen, event in zip(engine.seen, calls, strict=True):
        # Each event holds exactly what the engine was given and sampled, its weight-version span included.
        assert event.status is CallStatus.OK and event.streamed == seen.streamed, (seen.index, event.status)
        assert list(event.prompt_token_ids) == seen.prompt_token_ids, seen.index
        choice = event.choices[0]
        assert (list(choice.completion_token_ids), list(choice.logprobs)) == (seen.completion_token_ids,
                                                                               seen.logprobs), seen.index
        assert [(v.version, v.start, v.end) for v in choice.weight_versions] == \
            [(WEIGHT_VERSION, 0, len(seen.completion_token_ids))], seen.index
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
    streamed = sum(call.streamed for call in calls)
    print(f"{'continuation' if continuation else 'chat'} mode, {streamed} of {len(calls)} calls streamed:\n"
          f"{table.stdout}")
    done = subprocess.run([sys.executable, "-m", "openforge", "report", "harnesses", "--run", run_id, "--json"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    rows = {row["harness"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {h.name for h in HARNESSES}
    assert all(row["mean_reward"] == 1.0 and row["rollouts"] == 1 for row in rows.values()), rows
    assert all(row["tool_calls"] >= TOOL_CALLS for row in rows.values()), rows
    return Report(engine, rollouts, calls, rows, table.stdout)


async def test_continuation_merges_every_turn_of_a_harness_that_keeps_its_history_and_names_each_fallback(
        harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,  # noqa: F811 - the fixture
        tmp_path: Path) -> None:
    report = await _run_and_report(harness_bin, kafka_settings, topics, tmp_path, continuation=True)
    rows = report.rows
    # Every call went token in, token out: none fell back to the chat endpoint.
    assert {call.endpoint for call in report.engine.seen} == {"generate"}, report.engine.other_requests
    for name in rows:
        # Every fallback names its reason on its event, and the report's breaks are those fallbacks.
        assert rows[name]["drift_reasons"] == report.fallbacks(name), (name, rows[name])
        assert sum(report.fallbacks(name).values()) == rows[name]["breaks"], (name, rows[name])
    # Claude Code and Codex send their history back as it was: every turn extends the one before.
    for name in ("claude-code", "codex"):
        assert rows[name]["merge_rate"] == 1.0 and rows[name]["breaks"] == 0, rows[name]
        assert rows[name]["merged"] >= TOOL_CALLS, rows[name]
    # OpenClaw puts its trailing context message after the newest turn every time: no turn extends.
    assert rows["openclaw"]["merge_rate"] == 0.0 and rows["openclaw"]["breaks"] >= TOOL_CALLS, rows["openclaw"]
    assert rows["openclaw"]["drift_reasons"] == {"message_moved": rows["openclaw"]["breaks"]}
    assert f"message_moved {rows['openclaw']['breaks']}" in report.table


async def test_chat_mode_breaks_every_turn_where_the_template_respells_the_sampled_tool_call(
        harness_bin: Path, kafka_settings: KafkaSettings, topics: TopicRegistry,  # noqa: F811 - the fixture
        tmp_path: Path) -> None:
    report = await _run_and_report(harness_bin, kafka_settings, topics, tmp_path, continuation=False)
    rows = report.rows
    assert {call.endpoint for call in report.engine.seen} == {"chat"}
    # The same harnesses keep their history, but the template writes each sampled tool call back
    # with other ids: every join breaks, and the assembler says why.
    for name in ("claude-code", "codex"):
        assert rows[name]["merge_rate"] == 0.0 and rows[name]["breaks"] >= TOOL_CALLS, rows[name]
        assert rows[name]["drift_reasons"] == {"rerendered": rows[name]["breaks"]}, rows[name]
    assert rows["openclaw"]["drift_reasons"] == {"message_moved": rows["openclaw"]["breaks"]}, rows["openclaw"]
    assert f"rerendered {rows['codex']['breaks']}" in report.table
