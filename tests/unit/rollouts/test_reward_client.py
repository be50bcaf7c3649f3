"""`openforge reward`'s client: environment, bounds, retries, against a small HTTP server standing in
for the proxy's reward intake (the real intake is tested with the proxy: tests/integration/proxy)."""

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from netutil import free_port

from producers.reward_client import RewardClientSettings, RewardConfigError, RewardError, post_reward


class _Intake:
    """An HTTP server answering each POST with the next scripted (status, body, headers)."""

    def __init__(self, answers: list[tuple[int, dict[str, Any], dict[str, str]]]) -> None:
        self.answers = answers
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        intake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                intake.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status, payload, headers = intake.answers[min(len(intake.seen), len(intake.answers)) - 1]
                raw = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in {"content-type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def intake() -> Iterator[_Intake]:
    box = _Intake([])
    thread = threading.Thread(target=box.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield box
    finally:
        box.server.shutdown()
        box.server.server_close()


def settings(**updates: Any) -> RewardClientSettings:
    base: dict[str, Any] = {"proxy_url": "http://proxy.invalid", "rollout_id": "r-1", "verifier_token": "tok",
                            "backoff_s": 0.01}
    return RewardClientSettings(**{**base, **updates})


def test_missing_environment_names_every_missing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENFORGE_REWARD_URL", "OPENFORGE_PROXY_URL", "OPENFORGE_ROLLOUT_ID", "OPENFORGE_VERIFIER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RewardConfigError) as caught:
        post_reward(1.0)
    message = str(caught.value)
    assert "OPENFORGE_PROXY_URL" in message and "OPENFORGE_ROLLOUT_ID" in message
    assert "OPENFORGE_VERIFIER_TOKEN" in message


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_REWARD_URL", "http://p/rollouts/r-9/reward")
    monkeypatch.setenv("OPENFORGE_VERIFIER_TOKEN", "v-token")
    monkeypatch.setenv("OPENFORGE_REWARD_ATTEMPTS", "2")
    read = RewardClientSettings.from_env()
    assert read.target() == ("http://p/rollouts/r-9/reward", "v-token")
    assert read.attempts == 2


@pytest.mark.parametrize(("name", "value", "message"), [
    ("OPENFORGE_REWARD_ATTEMPTS", "many", "OPENFORGE_REWARD_ATTEMPTS must be a number, not 'many'"),
    ("OPENFORGE_REWARD_ATTEMPTS", "0", "OPENFORGE_REWARD_ATTEMPTS must be at least 1"),
    ("OPENFORGE_REWARD_TIMEOUT_S", "-1", "OPENFORGE_REWARD_TIMEOUT_S must be positive"),
])
def test_a_bad_retry_setting_is_named(name: str, value: str, message: str) -> None:
    with pytest.raises(RewardConfigError, match=message):
        RewardClientSettings.from_env({name: value})


@pytest.mark.parametrize("value", [float("nan"), 1e39, -2e9, 10**400])
def test_a_reward_not_finite_or_past_the_limit_is_refused_before_sending(value: float) -> None:
    # 10**400 raised OverflowError from the finite check itself; 1e39 went out, to be refused.
    with pytest.raises(RewardError, match=r"finite number within ±1e\+09"):
        post_reward(value, settings=settings())


@pytest.mark.parametrize("value", [True, "0.5", None])
def test_a_reward_that_is_not_a_number_is_refused_before_sending(value: object) -> None:
    with pytest.raises(RewardError, match="must be a number"):
        post_reward(value, settings=settings())  # type: ignore[arg-type]


def test_5xx_is_retried_until_accepted_with_fake_proxy(intake: _Intake) -> None:
    intake.answers = [(503, {"error": {"message": "event log is full"}}, {"retry-after": "0"})] * 2 + [
        (202, {"event_id": "e1", "stored": "kafka"}, {})]
    result = post_reward(0.5, {"k": 1}, settings=settings(proxy_url=intake.url))
    assert result == {"event_id": "e1", "stored": "kafka"}
    assert len(intake.seen) == 3
    path, headers, body = intake.seen[-1]
    assert path == "/rollouts/r-1/reward"
    assert headers["authorization"] == "Bearer tok"
    assert body == b'{"value":0.5,"info":{"k":1}}'


def test_4xx_is_not_retried_with_fake_proxy(intake: _Intake) -> None:
    intake.answers = [(403, {"error": {"message": "only the rollout's verifier may post its reward"}}, {})]
    with pytest.raises(RewardError, match=r"refused the reward \(403\): only the rollout's verifier"):
        post_reward(1.0, settings=settings(proxy_url=intake.url))
    assert len(intake.seen) == 1


def test_unreachable_proxy_is_retried_then_reported() -> None:
    port = free_port()  # nothing listens there: a real connection refusal
    with pytest.raises(RewardError, match="after 3 attempts; last error: ConnectionRefusedError"):
        post_reward(1.0, settings=settings(proxy_url=f"http://127.0.0.1:{port}", attempts=3))


def test_openforge_reward_imports_little() -> None:
    # The verifier runs `openforge reward` once per rollout: it must not import the event models,
    # the Kafka client, the proxy or the learner on the way (it took about 0.9 s when it did).
    probe = ("import sys, time; t = time.perf_counter(); "
             "from openforge.cli import main; from producers.reward_client import post_reward; "
             "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
             "{'pydantic', 'pydantic_settings', 'aiokafka', 'httpx', 'fastapi', 'torch', 'matplotlib'}); "
             "print(heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
    started = time.perf_counter()
    help_text = subprocess.run([sys.executable, "-m", "openforge", "reward", "--help"], capture_output=True,
                               text=True, check=True, timeout=60)
    assert "--value" in help_text.stdout, (help_text.stdout, time.perf_counter() - started)
