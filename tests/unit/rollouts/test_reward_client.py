import httpx
import pytest
from netutil import free_port

from producers.reward_client import RewardClientSettings, RewardConfigError, RewardError, post_reward


def settings(**updates: object) -> RewardClientSettings:
    base = {"proxy_url": "http://proxy.invalid", "rollout_id": "r-1", "verifier_token": "tok", "backoff_s": 0.01}
    return RewardClientSettings(**{**base, **updates})  # type: ignore[arg-type]


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
    assert RewardClientSettings().target() == ("http://p/rollouts/r-9/reward", "v-token")


@pytest.mark.parametrize("value", [float("nan"), 1e39, -2e9, 10**400])
def test_a_reward_not_finite_or_past_the_limit_is_refused_before_sending(value: float) -> None:
    # 10**400 raised OverflowError from the finite check itself; 1e39 went out, to be refused.
    with pytest.raises(RewardError, match=r"finite number within ±1e\+09"):
        post_reward(value, settings=settings())


@pytest.mark.parametrize("value", [True, "0.5", None])
def test_a_reward_that_is_not_a_number_is_refused_before_sending(value: object) -> None:
    with pytest.raises(RewardError, match="must be a number"):
        post_reward(value, settings=settings())  # type: ignore[arg-type]


def test_5xx_is_retried_until_accepted_with_fake_proxy() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) < 3:
            return httpx.Response(503, json={"error": {"message": "event log is full"}}, headers={"retry-after": "0"})
        return httpx.Response(202, json={"event_id": "e1", "stored": "kafka"})

    result = post_reward(0.5, {"k": 1}, settings=settings(), transport=httpx.MockTransport(answer))
    assert result == {"event_id": "e1", "stored": "kafka"}
    assert len(seen) == 3
    assert seen[0].url == "http://proxy.invalid/rollouts/r-1/reward"
    assert seen[0].headers["authorization"] == "Bearer tok"
    assert seen[-1].read() == b'{"value":0.5,"info":{"k":1}}'


def test_4xx_is_not_retried_with_fake_proxy() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(403, json={"error": {"message": "only the rollout's verifier may post its reward"}})

    with pytest.raises(RewardError, match=r"refused the reward \(403\): only the rollout's verifier"):
        post_reward(1.0, settings=settings(), transport=httpx.MockTransport(answer))
    assert len(seen) == 1


def test_unreachable_proxy_is_retried_then_reported() -> None:
    port = free_port()  # nothing listens there: a real connection refusal
    with pytest.raises(RewardError, match="after 3 attempts; last error: ConnectError"):
        post_reward(1.0, settings=settings(proxy_url=f"http://127.0.0.1:{port}", attempts=3))
