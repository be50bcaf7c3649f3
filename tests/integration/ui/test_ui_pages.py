"""The flight recorder against the real broker: events in, the assembler's trajectories, every page out.

Rollouts of a tool-using agent are published as a run would publish them (calls, lifecycle, rewards),
the real assembler joins them into trajectories, a learner-step record and a checkpoint notice
follow, and the UI, served by uvicorn, follows the topics into its index and reads events back
from Kafka for the rollout and token pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from flight_events import NOT_RECOVERED, RECOVERED, failed_rollout, tool_rollout
from inloop_server import InLoopServer
from linear_calls import linked
from netutil import free_port

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from openforge.ui.app import build_app
from openforge.ui.settings import UISettings
from schemas import CheckpointAppliedV1, LearnerStepV1, ModelCallV1, StepDrop, StepTrajectory, encode
from stream import CALLS, CHECKPOINTS, REWARDS, ROLLOUTS, STEPS, EventProducer, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

CREDENTIAL = "ui-test-credential-0123456789"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@contextlib.asynccontextmanager
async def serving(kafka: KafkaSettings, index: Path) -> AsyncIterator[tuple[str, object]]:
    port = free_port()
    app = build_app(UISettings(index_path=index, port=port, live_refresh_s=0), CREDENTIAL, kafka)
    server = InLoopServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        yield url, app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def publish_run(kafka: KafkaSettings, topics: TopicRegistry) -> dict[str, object]:
    """Four rollouts of run-1 and a learner step; returns the recorded rollouts by id."""
    rollouts = {
        "r-recovered": tool_rollout("r-recovered", RECOVERED, task_id="task-a", group_index=0, group_size=2,
                                    reward=1.0, start_s=0),
        "r-stuck": tool_rollout("r-stuck", NOT_RECOVERED, task_id="task-a", group_index=1, group_size=2,
                                reward=0.0, start_s=10),
        "r-moving": tool_rollout("r-moving", RECOVERED, task_id="task-b", harness="mover", reward=0.5,
                                 moving_context=True, start_s=20),
        "r-evicted": failed_rollout("r-evicted", task_id="task-c", start_s=30),
    }
    # As the proxy stores them: each call after the first by reference to the one before it.
    calls = rollouts["r-recovered"].calls  # type: ignore[attr-defined]
    calls[1:] = [linked(call, before, messages=len(before.request.messages), tools=True)
                 for before, call in itertools.pairwise(calls)]
    topic_of = {"model_call": CALLS, "rollout": ROLLOUTS, "reward": REWARDS}
    async with EventProducer(kafka) as producer:
        for recorded in rollouts.values():
            for event in recorded.events():  # type: ignore[attr-defined]
                if isinstance(event, ModelCallV1) and event.call_id == "r-stuck-c0":
                    # As the proxy sends it inside a trace: the record carries the W3C context.
                    value, headers = encode(event)
                    headers.append(("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01".encode()))
                    await producer.send_raw(topics[CALLS].name, value, key=event.rollout_id.encode(), headers=headers)
                    continue
                await producer.send(topic_of[type(event).SCHEMA], event)
        await producer.send(STEPS, LearnerStepV1(
            model="tiny", step=1, version=1, duration_s=0.8,
            trajectories=[StepTrajectory(trajectory_id="t-rec", rollout_id="r-recovered", task_id="task-a",
                                         group_index=0, reward=1.0, advantage=0.7071, trained_tokens=30,
                                         oldest_version=1),
                          StepTrajectory(trajectory_id="t-stuck", rollout_id="r-stuck", task_id="task-a",
                                         group_index=1, reward=0.0, advantage=-0.7071, trained_tokens=20,
                                         oldest_version=1)],
            dropped=[StepDrop(trajectory_id="t-ev", rollout_id="r-evicted", task_id="task-c",
                              reason="infrastructure_failure")],
            metrics={"loss": 0.12, "reward_mean": 0.5, "rollout_corr/kl": 0.0031, "is_weight_max": 1.4},
            importance_weights=[0.8, 0.95, 1.0, 1.05, 1.4]))
        await producer.send(CHECKPOINTS, CheckpointAppliedV1(model="tiny", version=1, replica="http://engine-0",
                                                             applied_at=rollouts["r-evicted"].lifecycle[-1].created_at,
                                                             duration_s=0.4, ok=True))
        await producer.flush()
    return rollouts


async def wait_for(check: object, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "the index did not fill in time"
        await asyncio.sleep(0.2)


async def test_every_page_from_a_run_on_the_real_broker(kafka_settings: KafkaSettings, topics: TopicRegistry,
                                                        tmp_path: Path) -> None:
    await publish_run(kafka_settings, topics)
    settings = AssemblerSettings.model_validate({
        "group_id": f"{kafka_settings.topic_prefix}assembler", "grace_s": 0.2, "commit_interval_s": 0.2,
        "poll_timeout_ms": 100, "session_timeout_ms": 6000})
    async with AssemblerService(settings, kafka_settings), serving(kafka_settings, tmp_path / "index.sqlite") as (url,
                                                                                                                 app):
        index = app.state.ui.index  # type: ignore[attr-defined]
        await wait_for(lambda: index.value("SELECT count(trajectory_id) FROM rollouts") == 4
                       and index.value("SELECT count(*) FROM steps") == 1)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {CREDENTIAL}"}) as client:
            # Without the credential nothing is served.
            assert (await client.get("/", headers={"authorization": ""})).status_code == 401
            assert (await client.get("/rollouts/r-stuck", headers={"authorization": "Bearer wrong-credential-xxxx"}
                                     )).status_code == 401

            runs = (await client.get("/")).text
            assert "run-1" in runs and 'id="reward-svg"' in runs
            curve_links = re.findall(r'<a href="(/rollouts\?run=run-1&amp;from=[^"]+)" class="point">', runs)
            assert curve_links, "the reward curve's points must open their rollouts"
            assert "evicted" in runs  # failures by reason
            assert "message_moved" in runs  # breaks by drift reason

            listed = (await client.get(curve_links[0].replace("&amp;", "&"))).text
            assert "rollout-link" in listed
            moved = (await client.get("/rollouts", params={"drift": "message_moved"})).text
            assert re.findall(r'class="rollout-link">([^<]+)<', moved) == ["r-moving"]
            assert re.findall(r'class="rollout-link">([^<]+)<', (await client.get(
                "/rollouts", params={"harness": "agent", "reward_max": "0.5"})).text) == ["r-stuck"]

            stuck = (await client.get("/rollouts/r-stuck")).text
            assert "bash: pytest: command not found" in stuck  # the tool result, read back from Kafka
            assert "error (error_text), not recovered" in stuck
            assert 'id="reward">0.0000<' in stuck
            assert "step 1" in stuck  # the learner step that trained it
            recovered = (await client.get("/rollouts/r-recovered")).text
            assert "error (exit_code), recovered" in recovered  # joined from calls stored by reference
            assert recovered.count("earlier messages as in the call before") == len(RECOVERED) - 1  # shown whole

            # Links in from a trace id.
            trace = await client.get(f"/traces/{TRACE_ID}", follow_redirects=False)
            assert trace.status_code == 307 and trace.headers["location"] == "/rollouts/r-stuck#call-r-stuck-c0"

            tokens = (await client.get("/rollouts/r-moving/tokens", params={"sample": 1})).text
            count = re.search(r'id="token-count" data-completion="(\d+)"', tokens)
            completion = tokens.split('id="completion"', 1)[1]
            assert count is not None and completion.count('class="tok m') == int(count.group(1))
            assert completion.count('class="tok m1"') == int(re.search(r'data-trained="(\d+)"', tokens).group(1))
            assert 'id="drift-reason">message_moved<' in tokens

            step = (await client.get("/steps/tiny/1")).text
            assert "r-recovered" in step and "0.7071" in step and "infrastructure_failure" in step
            assert "KL(behaviour" in step and 'id="weights"' in step

            report = (await client.get("/report/harnesses", params={"format": "json"})).json()
            by_harness = {row["harness"]: row for row in report}
            assert by_harness["agent"]["merge_rate"] == 1.0 and by_harness["mover"]["merge_rate"] == 0.0
            assert by_harness["mover"]["drift_reasons"] == {"message_moved": 2}
            assert (by_harness["agent"]["tool_errors"], by_harness["agent"]["recovered"]) == (2, 1)
