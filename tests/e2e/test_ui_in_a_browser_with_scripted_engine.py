"""The flight recorder in a real headless Chromium, against a real short loop run.

The loop: the real broker, the scripted engine (vocabulary of the tiny model, so the learner can
train on its ids; an exact template, so turns merge where the harness keeps its history), and as
processes of their own the proxy, the launcher with the local backend, the assembler, the learner
(the tiny model on CPU) and ``openforge ui``. The harness is a small OpenAI-SDK agent with a shell
tool (``tests/agents/tool_agent.py``); half the rollouts move a context message once, which breaks
the token prefix at their second call (``message_moved``).

Chromium comes from the npm registry (``scripts/browser/install.sh``: ``@sparticuz/chromium`` ships
the binary, ``playwright-core`` drives it). The browser clicks from the runs page to a point of the
reward curve, to a rollout with a merge break and to the token view of the sample that break
started, and the test checks what it showed against the trajectory on Kafka. With
``OPENFORGE_UPDATE_SCREENSHOTS=1`` its screenshots replace the README's (``docs/img``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from netutil import free_port
from scripted_engine import ScriptedEngine

from openforge.demo_procs import Child
from openforge.engine import make_tiny_model
from schemas import TaskV1, TrajectoryV1
from stream import TASKS, TRAJECTORIES, EventProducer, KafkaSettings, TopicRegistry
from stream.broker import cache_root
from stream.tooling import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "scripts" / "browser" / "install.sh"
DRIVER = Path(__file__).with_name("ui_browser.mjs")
AGENT = [sys.executable, str(REPO / "tests" / "agents" / "tool_agent.py")]
VERIFIER = [sys.executable, str(REPO / "tests" / "agents" / "score_digit.py")]
GROUP = 4
CREDENTIAL = secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def browser_dir() -> Path:
    """The folder ``scripts/browser/install.sh`` installed Node, playwright-core and Chromium into (once, cached)."""
    done = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        pytest.fail(f"{INSTALLER.name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _task(task_id: str, run_id: str, *, move: bool) -> TaskV1:
    instruction = "Roll a four-sided die with the shell, then report the number."
    return TaskV1.model_validate({
        "task_id": task_id, "run_id": run_id, "instruction": instruction, "group_size": GROUP, "timeout_s": 120,
        "harness": {"name": "tool-agent-moving" if move else "tool-agent",
                    "launch": {"kind": "local", "command": [*AGENT, *(["--move-context-once"] if move else []),
                                                            instruction]}},
        "verifier": {"command": VERIFIER, "timeout_s": 60}})


async def _trajectories(kafka: KafkaSettings, topics: TopicRegistry, expect: int, timeout_s: float,
                        children: list[Child]) -> dict[str, TrajectoryV1]:
    deadline = time.monotonic() + timeout_s
    found: dict[str, TrajectoryV1] = {}
    while time.monotonic() < deadline:
        for child in children:
            child.check()
        async for record in read_topic(kafka, topics[TRAJECTORIES].name):
            event = record.decode()
            assert isinstance(event, TrajectoryV1)
            found[event.rollout_id] = event
        if len(found) >= expect:
            return found
        await asyncio.sleep(1.0)
    pytest.fail(f"{len(found)} of {expect} trajectories after {timeout_s:.0f}s; logs:\n"
                + "\n".join(f"--- {c.name}\n{c.tail(15)}" for c in children))


async def _ui_caught_up(url: str, rollouts: int, timeout_s: float, children: list[Child]) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {CREDENTIAL}"}) as client:
        while time.monotonic() < deadline:
            for child in children:
                child.check()
            try:
                report = (await client.get("/report/harnesses", params={"format": "json"})).json()
                steps = (await client.get("/steps")).text
            except httpx.HTTPError:
                report, steps = [], ""
            if sum(row["rollouts"] for row in report) >= rollouts and 'href="/steps/tiny/1"' in steps:
                return
            await asyncio.sleep(1.0)
    pytest.fail("the UI did not show every rollout and a learner step in time; logs:\n"
                + "\n".join(f"--- {c.name}\n{c.tail(15)}" for c in children))


async def test_a_browser_goes_from_the_reward_curve_to_the_tokens_of_a_merge_break(
        browser_dir: Path, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    prefix = kafka_settings.topic_prefix
    run_id = f"{prefix}run"
    model_dir = make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")
    engine = ScriptedEngine(command="echo $((RANDOM % 4))", vocab=4096, exact_turns=True, tool_turns=2)
    key = secrets.token_hex(32)
    base = {"OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
            "OPENFORGE_KAFKA_TOPIC_PREFIX": prefix, "OPENFORGE_PROXY_CREDENTIAL_KEY": key,
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proxy_port, ui_port = free_port(), free_port()
    ui_url = f"http://127.0.0.1:{ui_port}"
    children: list[Child] = []
    async with engine.running(free_port()) as engine_url:
        try:
            specs = [
                ("proxy", ["proxy", "--port", str(proxy_port), "--upstream", engine_url],
                 {"OPENFORGE_PROXY_SPOOL_DIR": str(tmp_path / "spool")}),
                ("assembler", ["assembler"], {"OPENFORGE_ASSEMBLER_GROUP_ID": f"{prefix}assembler",
                                              "OPENFORGE_ASSEMBLER_GRACE_S": "0.5"}),
                ("learner", ["learner"], {
                    "OPENFORGE_LEARNER_MODEL_NAME": "tiny", "OPENFORGE_LEARNER_MODEL_DIR": str(model_dir),
                    "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
                    "OPENFORGE_LEARNER_GROUPS_PER_STEP": "1", "OPENFORGE_LEARNER_BATCH_WAIT_S": "1",
                    "OPENFORGE_LEARNER_CHECKPOINT_EVERY": "1", "OPENFORGE_LEARNER_MAX_STALENESS": "100",
                    "OPENFORGE_LEARNER_LR": "1e-3"}),
                ("launcher", ["launcher", "--backend", "local", "--max-in-flight", "4", "--proxy-url",
                              f"http://127.0.0.1:{proxy_port}"],
                 {"OPENFORGE_LAUNCHER_GROUP_ID": f"{prefix}launcher",
                  "OPENFORGE_LAUNCHER_STATE_DIR": str(tmp_path / "launcher"),
                  "OPENFORGE_LAUNCHER_WORKSPACE_ROOT": str(tmp_path / "workspaces")}),
                ("ui", ["ui", "--port", str(ui_port), "--index", str(tmp_path / "ui" / "index.sqlite")],
                 {"OPENFORGE_UI_CREDENTIAL": CREDENTIAL, "OPENFORGE_UI_LIVE_REFRESH_S": "0"}),
            ]
            for name, args, env in specs:
                child = Child(name, args, {**base, **env}, tmp_path / "logs" / f"{name}.log")
                child.start()
                children.append(child)
            tasks = [_task(f"{prefix}dice-{i}", run_id, move=i % 2 == 1) for i in range(2)]
            async with EventProducer(kafka_settings) as producer:
                for task in tasks:
                    await producer.publish(TASKS, task)
            trajectories = await _trajectories(kafka_settings, topics, 2 * GROUP, 300, children)
            await _ui_caught_up(ui_url, 2 * GROUP, 300, children)

            # Nothing is served without the credential, or with a wrong one.
            async with httpx.AsyncClient(base_url=ui_url) as client:
                assert (await client.get("/")).status_code == 401
                assert (await client.get("/", headers={"authorization": "Bearer not-the-credential"})).status_code == 401
                assert (await client.get("/", params={"token": "not-the-credential"})).status_code == 401

            shots = tmp_path / "shots"
            shots.mkdir()
            # ES modules resolve packages beside the script, not through NODE_PATH: the driver runs from a
            # folder whose node_modules is the installed one.
            driver = tmp_path / "driver"
            driver.mkdir()
            shutil.copyfile(DRIVER, driver / DRIVER.name)
            (driver / "node_modules").symlink_to(browser_dir / "lib" / "node_modules")
            node = browser_dir / "bin" / "node"
            chromium = subprocess.run([str(browser_dir / "bin" / "chromium-path")], capture_output=True, text=True,
                                      check=True).stdout.strip()
            driven = await asyncio.to_thread(subprocess.run, [str(node), str(driver / DRIVER.name), ui_url, CREDENTIAL,
                                                              str(shots), chromium],
                                             capture_output=True, text=True, timeout=300, check=False)
            assert driven.returncode == 0, f"{driven.stdout[-3000:]}\n{driven.stderr[-3000:]}"
            seen = json.loads(driven.stdout.strip().splitlines()[-1])
        finally:
            for child in reversed(children):
                child.stop()
    print(json.dumps(seen, indent=1))

    # Three clicks from the curve to the tokens, and the credential left the address bar.
    assert "token=" not in seen["runsUrl"] and seen["curvePoints"] >= 1
    assert [c.split(" ")[0] for c in seen["clicks"][-3:]] == ["point", "rollout", "sample"]
    trajectory = trajectories[seen["rollout"]]
    assert trajectory.harness == "tool-agent-moving"
    [brk] = trajectory.merge_breaks
    sample = trajectory.samples[brk.sample_index]
    assert seen["sampleLink"] == f"sample {brk.sample_index}: token view"
    # What the token view showed is the trajectory's: its tokens, its mask, its reward, its break.
    assert seen["shownCompletion"] == seen["completionSpans"] == len(sample.completion_ids)
    assert seen["trainedSpans"] == sample.trained_tokens > 0
    assert seen["contextSpans"] == len(sample.completion_ids) - sample.trained_tokens > 0
    assert seen["trainedColour"] != seen["contextColour"]
    assert trajectory.reward is not None
    assert seen["reward"] == seen["rolloutReward"] == f"{trajectory.reward:.4f}"
    assert brk.reason is not None and seen["driftReason"] == brk.reason.value == "message_moved"
    for name in ("ui-runs.png", "ui-rollout.png", "ui-tokens.png"):
        assert (shots / name).stat().st_size > 10_000, name
    if os.environ.get("OPENFORGE_UPDATE_SCREENSHOTS") == "1":
        for name in ("ui-runs.png", "ui-rollout.png", "ui-tokens.png"):
            shutil.copyfile(shots / name, REPO / "docs" / "img" / name)
