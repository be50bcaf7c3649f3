"""The flight recorder's credential, its refusal to serve openly, and the harness report over its index."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from aiokafka.structs import TopicPartition
from click.testing import CliRunner
from flight_events import NOT_RECOVERED, RECOVERED, failed_rollout, tool_rollout

from consumers.assembler.state import RolloutTable
from openforge.report import Scope, format_table, harness_report
from openforge.ui.app import build_app
from openforge.ui.auth import COOKIE
from openforge.ui.cli import ui_command
from openforge.ui.index import Index, Position
from openforge.ui.settings import UISettings, is_loopback
from stream.settings import KafkaSettings

CREDENTIAL = "a-long-enough-ui-credential"


@pytest.fixture
async def client(tmp_path: Path) -> httpx.AsyncClient:
    app = build_app(UISettings(index_path=tmp_path / "index.sqlite"), CREDENTIAL,
                    KafkaSettings(bootstrap_servers="127.0.0.1:1"), follow=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        yield client


async def test_missing_or_wrong_credential_is_401(client: httpx.AsyncClient) -> None:
    assert (await client.get("/")).status_code == 401
    assert (await client.get("/rollouts")).status_code == 401
    assert (await client.get("/", headers={"authorization": "Bearer not-it"})).status_code == 401
    assert (await client.get("/", params={"token": "not-it"})).status_code == 401
    assert (await client.get("/", headers={"cookie": f"{COOKIE}=forged"})).status_code == 401
    assert (await client.get("/health")).status_code == 200  # probes see nothing else


async def test_the_credential_once_in_the_address_becomes_a_cookie(client: httpx.AsyncClient) -> None:
    first = await client.get("/rollouts", params={"token": CREDENTIAL, "harness": "codex"})
    assert first.status_code == 303 and first.headers["location"] == "/rollouts?harness=codex"
    cookie = first.cookies[COOKIE]
    assert CREDENTIAL not in cookie and "httponly" in first.headers["set-cookie"].lower()
    assert (await client.get("/rollouts", headers={"cookie": f"{COOKIE}={cookie}"})).status_code == 200
    assert (await client.get("/", headers={"authorization": f"Bearer {CREDENTIAL}"})).status_code == 200


def test_a_non_loopback_address_without_a_credential_refuses_to_start(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENFORGE_UI_CREDENTIAL", raising=False)
    monkeypatch.delenv("OPENFORGE_UI_CREDENTIAL_FILE", raising=False)
    result = CliRunner().invoke(ui_command, ["--host", "0.0.0.0", "--index", str(tmp_path / "i.sqlite")])
    assert result.exit_code != 0 and "refusing to serve on 0.0.0.0 without a credential" in result.output
    monkeypatch.setenv("OPENFORGE_UI_CREDENTIAL", "short")
    result = CliRunner().invoke(ui_command, ["--index", str(tmp_path / "i.sqlite")])
    assert result.exit_code != 0 and "at least 16" in result.output
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.7")


def _indexed(*recorded: object) -> Index:
    table = RolloutTable()
    tp = TopicPartition("calls", 0)
    index = Index(":memory:")
    for offset, event in enumerate(e for r in recorded for e in r.events()):  # type: ignore[attr-defined]
        table.add(event, tp, offset, 0.0)
        index.ingest(event, Position("calls", 0, offset))
    for i, done in enumerate(table.due(1000.0)):
        index.ingest(done.trajectory, Position("trajectories", 0, i))
    return index


def test_the_harness_report_from_the_index() -> None:
    index = _indexed(
        tool_rollout("a1", RECOVERED, harness="keeps", reward=1.0),
        tool_rollout("a2", NOT_RECOVERED, harness="keeps", reward=0.0, start_s=30),
        tool_rollout("b1", RECOVERED, harness="moves", moving_context=True, reward=0.5, run_id="run-2"),
        failed_rollout("b2", harness="moves", run_id="run-2"),
    )
    rows = {r.harness: r for r in harness_report(index)}
    keeps, moves = rows["keeps"], rows["moves"]
    assert (keeps.rollouts, keeps.merged, keeps.breaks, keeps.merge_rate) == (2, 3, 0, 1.0)
    assert (keeps.tool_errors, keeps.recovered, keeps.recovery_rate, keeps.mean_reward) == (2, 1, 0.5, 0.5)
    assert (moves.merge_rate, moves.drift_reasons) == (0.0, {"message_moved": 2})
    assert (moves.infrastructure_share, moves.mean_reward) == (0.5, 0.5)  # the evicted one has no reward
    assert [r.harness for r in harness_report(index, Scope(run_id="run-2"))] == ["moves"]
    text = format_table(list(rows.values()))
    assert "message_moved 2" in text and "100% (3/3)" in text

