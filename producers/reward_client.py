"""Pod-side reward reporting: what ``openforge reward`` does inside a rollout.

The verifier runs next to the harness and reports its score to the proxy's reward intake with
the verifier credential the launcher put into its environment (and only its environment).
Proxies restart and networks blink, so connection errors and 5xx answers are retried with
exponential backoff; a 4xx answer (bad token, bad value) cannot succeed on retry and fails at once.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.rollouts.backend import ENV_PROXY_URL, ENV_REWARD_URL, ENV_ROLLOUT_ID, ENV_VERIFIER_TOKEN
from schemas.reward.v1 import REWARD_LIMIT

__all__ = ["RewardClientSettings", "RewardConfigError", "RewardError", "post_reward"]

logger = logging.getLogger(__name__)


class RewardError(Exception):
    """The reward could not be delivered; the message says why."""


class RewardConfigError(RewardError):
    """The environment lacks what a verifier needs (not started by the launcher?)."""


class RewardClientSettings(BaseSettings):
    """Where to post and with which credential, read from the rollout's environment."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    reward_url: str | None = Field(default=None, validation_alias=AliasChoices(ENV_REWARD_URL))
    """Full reward URL; built from ``proxy_url`` and ``rollout_id`` when absent."""

    proxy_url: str | None = Field(default=None, validation_alias=AliasChoices(ENV_PROXY_URL))
    """The proxy's root URL."""

    rollout_id: str | None = Field(default=None, validation_alias=AliasChoices(ENV_ROLLOUT_ID))
    """The rollout being scored."""

    verifier_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices(ENV_VERIFIER_TOKEN))
    """The verifier credential."""

    attempts: int = Field(default=6, ge=1, validation_alias=AliasChoices("OPENFORGE_REWARD_ATTEMPTS"))
    """Tries before giving up on connection errors and 5xx answers."""

    backoff_s: float = Field(default=0.5, ge=0,
                             validation_alias=AliasChoices("OPENFORGE_REWARD_BACKOFF_S"))
    """Pause before the first retry; doubles after each (capped at 30 s, or the server's Retry-After)."""

    timeout_s: float = Field(default=30.0, gt=0,
                             validation_alias=AliasChoices("OPENFORGE_REWARD_TIMEOUT_S"))
    """Limit of one HTTP request."""

    def target(self) -> tuple[str, str]:
        """The reward URL and token.

        Raises:
            RewardConfigError: naming every missing variable.
        """
        missing = []
        url = self.reward_url
        if url is None:
            if self.proxy_url is None:
                missing.append(ENV_PROXY_URL)
            if self.rollout_id is None:
                missing.append(ENV_ROLLOUT_ID)
            if self.proxy_url is not None and self.rollout_id is not None:
                url = f"{self.proxy_url.rstrip('/')}/rollouts/{quote(self.rollout_id, safe='')}/reward"
        if self.verifier_token is None or not self.verifier_token.get_secret_value():
            missing.append(ENV_VERIFIER_TOKEN)
        if missing or url is None:
            raise RewardConfigError(
                f"cannot report a reward: {', '.join(missing)} not set (the launcher sets "
                f"{ENV_REWARD_URL} and {ENV_VERIFIER_TOKEN} for the verifier only)")
        assert self.verifier_token is not None
        return url, self.verifier_token.get_secret_value()


def post_reward(value: float, info: dict[str, Any] | None = None, *, settings: RewardClientSettings | None = None,
                transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """Post one reward; return the proxy's answer (``event_id``, ``stored``).

    Args:
        value: The reward; finite and within ±:data:`schemas.reward.v1.REWARD_LIMIT`.
        info: Free JSON details for dashboards.
        settings: Target and retry policy; read from the environment when None.
        transport: HTTP transport override (tests only).

    Raises:
        RewardConfigError: the environment lacks the URL or token.
        RewardError: the proxy refused (4xx) or stayed unreachable through every attempt.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"the reward must be a number, not {value!r}: the proxy refuses anything else")
    try:
        number = float(value)  # subclasses of int and float (numpy's float64) go out as plain JSON numbers
    except OverflowError:  # an int past a double's range
        number = math.inf
    if not math.isfinite(number) or abs(number) > REWARD_LIMIT:
        raise RewardError(f"the reward must be a finite number within ±{REWARD_LIMIT:g}, not {value}")
    value = number
    config = settings or RewardClientSettings()
    url, token = config.target()
    body = {"value": value, "info": info or {}}
    delay = config.backoff_s
    last = ""
    with httpx.Client(transport=transport, timeout=config.timeout_s) as client:
        for attempt in range(1, config.attempts + 1):
            retry_after: float | None = None
            try:
                answer = client.post(url, json=body, headers={"authorization": f"Bearer {token}"})
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if answer.status_code < 300:
                    result: dict[str, Any] = answer.json()
                    return result
                detail = _error_text(answer)
                if answer.status_code < 500 and answer.status_code != 429:
                    raise RewardError(f"the proxy refused the reward ({answer.status_code}): {detail}")
                last = f"HTTP {answer.status_code}: {detail}"
                retry_after = _retry_after(answer)
            if attempt < config.attempts:
                pause = min(retry_after if retry_after is not None else delay, 30.0)
                logger.warning("reward attempt %d of %d failed (%s); retrying in %.1fs", attempt, config.attempts,
                               last, pause)
                time.sleep(pause)
                delay *= 2
    raise RewardError(f"the reward was not delivered after {config.attempts} attempts; last error: {last}")


def _error_text(answer: httpx.Response) -> str:
    try:
        data = answer.json()
    except ValueError:
        return answer.text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(data)[:300]


def _retry_after(answer: httpx.Response) -> float | None:
    try:
        return float(answer.headers["retry-after"])
    except (KeyError, ValueError):
        return None
