"""Two proxy replicas, one of them cut off from Kafka for a while: every rollout's calls and reward
meet in one replica, so no reward overtakes its calls and no trajectory is published short.

Real parts: the launcher (local backend) pins each rollout to one replica, agents call through the
real proxies in front of real vLLM, the verifier reports through `openforge reward`, and the real
assembler joins what reaches the real broker. Replica B reaches Kafka through a gate that stays
shut until every rollout has ended, so B holds its rollouts' calls and rewards in its journal
meanwhile (a backlogged replica), and ships them in the order it took them.

The counter-case shows what pinning prevents: a rollout whose calls went through B and whose
reward went through A (replicas behind a plain Service) is published with its calls missing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from netutil import free_port
from proxy_helpers import RunningProxy, serve, shutdown
from rollout_events import collect, lifecycle
from rollout_tasks import CHECK_ANSWER, ECHO_AGENT, KEY, task_dict

from consumers.assembler.service import AssemblerService
from consumers.assembler.settings import AssemblerSettings
from consumers.rollouts.launcher import Launcher, LauncherSettings, proxy_for, rollout_id_for
from proxy.settings import ProxySettings
from schemas import RolloutEventV1, TaskV1, TrajectoryV1
from schemas.credentials import Role
from schemas.rollout.v1 import Backend, RolloutPhase
from stream import ROLLOUTS, TASKS, TRAJECTORIES, EventProducer, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

CALLS_PER_ROLLOUT = 2  # the echo agent's two turns


class KafkaGate:
    """A TCP relay to the broker on its own port that refuses connections until opened.

    Only the bootstrap goes through it: once in, a client talks to the broker's advertised
    address. A client whose bootstrap is refused has no Kafka at all, as behind a partition.
    """

    def __init__(self, broker: str) -> None:
        host, port = broker.rsplit(":", 1)
        self._target = (host, int(port))
        self.port = free_port()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


@contextlib.asynccontextmanager
async def running(settings: ProxySettings, registry: TopicRegistry) -> AsyncIterator[RunningProxy]:
    server, task = await serve(settings)
    try:
        yield RunningProxy(f"http://127.0.0.1:{settings.port}", settings, registry)
    finally:
        await shutdown(server, task)


def assembler_settings(kafka: KafkaSettings) -> AssemblerSettings:
    """The assembler's defaults (its grace for late calls included), in this test's consumer group."""
    return AssemblerSettings.model_validate({"group_id": f"{kafka.topic_prefix}assembler"})


async def test_calls_and_reward_of_every_rollout_meet_in_one_replica_so_none_is_truncated(
        proxy_settings_factory: Callable[..., ProxySettings], topics: TopicRegistry, tmp_path: Path) -> None:
    kafka: KafkaSettings = proxy_settings_factory().kafka
    gate = KafkaGate(kafka.bootstrap_servers)
    cut_off = kafka.model_copy(update={"bootstrap_servers": gate.address})
    a_settings = proxy_settings_factory(spool_dir=tmp_path / "spool-a")
    b_settings = proxy_settings_factory(spool_dir=tmp_path / "spool-b", kafka=cut_off)
    async with running(a_settings, topics) as a, running(b_settings, topics) as b, \
            AssemblerService(assembler_settings(kafka), kafka):
        urls = [a.url, b.url]
        tasks = [TaskV1.model_validate({
            **task_dict(f"pinned-{n}", group_size=4, timeout_s=100, verifier=CHECK_ANSWER),
            "harness": {"name": "echo-agent", "launch": {"kind": "local", "command": [*ECHO_AGENT, "Say hi."]}}})
            for n in range(3)]
        rollouts = {rollout_id_for(t.task_id, i) for t in tasks for i in range(4)}
        on_b = {r for r in rollouts if proxy_for(r, urls) == b.url}
        assert on_b and on_b != rollouts, "the rollouts should spread over both replicas"
        async with EventProducer(kafka, registry=topics) as producer:
            for task in tasks:
                await producer.publish(TASKS, task)

        # The counter-case: calls through B, the reward through A, as behind a plain Service.
        split = "r-split-0"
        await split_rollout(a, b, split, kafka, topics)

        settings = LauncherSettings(credential_key=KEY.decode(), kafka=kafka, proxy_url=",".join(urls),
                                    state_dir=tmp_path / "state", workspace_root=tmp_path / "ws",
                                    group_id=f"{kafka.topic_prefix}launcher", max_in_flight=4, pace=False)
        async with Launcher(settings):
            by_rollout = await lifecycle(kafka, topics, len(rollouts) + 1, timeout_s=150)  # + the split one
        assert {r for r in by_rollout if r in rollouts} == rollouts
        for rollout_id in rollouts:
            assert by_rollout[rollout_id][-1].phase is RolloutPhase.SUCCEEDED, by_rollout[rollout_id][-1].message

        # Nothing of B's rollouts has reached Kafka yet; A's are assembled already.
        done = await collect(kafka, topics, TRAJECTORIES, lambda e: len(e) >= len(rollouts) - len(on_b) + 1,
                             timeout_s=60)
        assert {t.rollout_id for t in done} == (rollouts - on_b) | {split}
        short = next(t for t in done if t.rollout_id == split)
        assert short.reward == 1.0 and short.merge_stats.calls == 0, "the split rollout lost its calls"

        await gate.open()
        try:
            trajectories = await collect(kafka, topics, TRAJECTORIES, lambda e: len(e) >= len(rollouts) + 1,
                                         timeout_s=90)
        finally:
            await gate.close()
    mine = [t for t in trajectories if t.rollout_id in rollouts]
    assert all(isinstance(t, TrajectoryV1) for t in mine)
    assert sorted(t.rollout_id for t in mine) == sorted(rollouts), "one trajectory per rollout"
    for trajectory in mine:
        assert trajectory.reward == 1.0, trajectory.rollout_id
        assert trajectory.merge_stats.calls == CALLS_PER_ROLLOUT, (trajectory.rollout_id,
                                                                   trajectory.rollout_id in on_b)


async def split_rollout(a: RunningProxy, b: RunningProxy, rollout_id: str, kafka: KafkaSettings,
                        topics: TopicRegistry) -> None:
    """Two calls of one rollout through B, its end, and its reward through A."""
    task_id = "split"
    async with httpx.AsyncClient(timeout=60) as client:
        for turn in range(CALLS_PER_ROLLOUT):
            answer = await client.post(
                f"{b.base(rollout_id)}/v1/chat/completions",
                headers={"authorization": f"Bearer {b.token(rollout_id, task_id=task_id)}"},
                json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"turn {turn}"}]})
            assert answer.status_code == 200, answer.text
        async with EventProducer(kafka, registry=topics) as producer:
            for phase in (RolloutPhase.SCHEDULED, RolloutPhase.SUCCEEDED):
                await producer.publish(ROLLOUTS, RolloutEventV1(
                    rollout_id=rollout_id, task_id=task_id, group_index=0, group_size=1, phase=phase,
                    backend=Backend.LOCAL))
        reward = await client.post(
            f"{a.base(rollout_id)}/reward", json={"value": 1.0},
            headers={"authorization": f"Bearer {a.token(rollout_id, Role.VERIFIER, task_id=task_id)}"})
        assert reward.status_code == 202, reward.text
