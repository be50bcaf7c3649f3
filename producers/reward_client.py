"""Pod-side reward reporting: what ``openforge reward`` does inside a rollout.

The verifier runs next to the harness and reports its score to the proxy's reward intake with
the verifier credential the launcher put into its environment (and only its environment).
Proxies restart and networks blink, so connection errors and 5xx answers are retried with
exponential backoff; a 4xx answer (bad token, bad value) cannot succeed on retry and fails at once.

It runs once per rollout, inside the rollout, so it starts fast: the standard library's HTTP client
and the environment read directly, not an HTTP or settings library (``openforge reward`` starts in
about a tenth of a second).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from schemas.backoff import Backoff
from schemas.rollout_env import ENV_PROXY_URL, ENV_REWARD_URL, ENV_ROLLOUT_ID, ENV_VERIFIER_TOKEN, REWARD_LIMIT

__all__ = ["RewardClientSettings", "RewardConfigError", "RewardError", "post_reward"]

logger = logging.getLogger(__name__)

_MAX_PAUSE_S = 30.0


class RewardError(Exception):
    """The reward could not be delivered; the message says why."""


class RewardConfigError(RewardError):
    """The environment lacks what a verifier needs (not started by the launcher?)."""


@dataclass(frozen=True)
class RewardClientSettings:
    """Where to post and with which credential, and how hard to try (see :meth:`from_env`)."""

    reward_url: str | None = None
    """Full reward URL (``OPENFORGE_REWARD_URL``); built from ``proxy_url`` and ``rollout_id`` when absent."""
    proxy_url: str | None = None
    """The proxy's root URL (``OPENFORGE_PROXY_URL``)."""
    rollout_id: str | None = None
    """The rollout being scored (``OPENFORGE_ROLLOUT_ID``)."""
    verifier_token: str | None = None
    """The verifier credential (``OPENFORGE_VERIFIER_TOKEN``)."""
    attempts: int = 6
    """Tries before giving up on connection errors and 5xx answers (``OPENFORGE_REWARD_ATTEMPTS``)."""
    backoff_s: float = 0.5
    """Pause before the first retry; doubles after each, capped at 30 s or the server's Retry-After
    (``OPENFORGE_REWARD_BACKOFF_S``)."""
    timeout_s: float = 30.0
    """Limit of one HTTP request (``OPENFORGE_REWARD_TIMEOUT_S``)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise RewardConfigError(f"OPENFORGE_REWARD_ATTEMPTS must be at least 1, not {self.attempts}")
        if not self.backoff_s >= 0:
            raise RewardConfigError(f"OPENFORGE_REWARD_BACKOFF_S must not be negative, not {self.backoff_s}")
        if not self.timeout_s > 0:
            raise RewardConfigError(f"OPENFORGE_REWARD_TIMEOUT_S must be positive, not {self.timeout_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RewardClientSettings:
        """Read the settings from the environment (``os.environ`` by default).

        Raises:
            RewardConfigError: a number that does not parse, or is out of range, named.
        """
        env = os.environ if env is None else env

        def number(name: str, default: float, kind: type[int] | type[float]) -> Any:
            text = env.get(name)
            if text is None or not text.strip():
                return default
            try:
                return kind(text)
            except ValueError:
                raise RewardConfigError(f"{name} must be a number, not {text!r}") from None

        return cls(reward_url=env.get(ENV_REWARD_URL) or None, proxy_url=env.get(ENV_PROXY_URL) or None,
                   rollout_id=env.get(ENV_ROLLOUT_ID) or None, verifier_token=env.get(ENV_VERIFIER_TOKEN) or None,
                   attempts=number("OPENFORGE_REWARD_ATTEMPTS", cls.attempts, int),
                   backoff_s=number("OPENFORGE_REWARD_BACKOFF_S", cls.backoff_s, float),
                   timeout_s=number("OPENFORGE_REWARD_TIMEOUT_S", cls.timeout_s, float))

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
        if not self.verifier_token:
            missing.append(ENV_VERIFIER_TOKEN)
        if missing or url is None or not self.verifier_token:
            raise RewardConfigError(
                f"cannot report a reward: {', '.join(missing)} not set (the launcher sets "
                f"{ENV_REWARD_URL} and {ENV_VERIFIER_TOKEN} for the verifier only)")
        return url, self.verifier_token


def post_reward(value: float, info: dict[str, Any] | None = None, *,
                settings: RewardClientSettings | None = None) -> dict[str, Any]:
    """Post one reward; return the proxy's answer (``event_id``, ``stored``).

    Args:
        value: The reward; finite and within ±:data:`schemas.rollout_env.REWARD_LIMIT`.
        info: Free JSON details for dashboards.
        settings: Target and retry policy; read from the environment when None.

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
    config = settings or RewardClientSettings.from_env()
    url, token = config.target()
    body = json.dumps({"value": number, "info": info or {}}, separators=(",", ":")).encode()
    backoff = Backoff(config.backoff_s, _MAX_PAUSE_S)
    last = ""
    for attempt in range(1, config.attempts + 1):
        retry_after: float | None = None
        request = urllib.request.Request(url, data=body, method="POST", headers={  # noqa: S310 - the launcher's URL
            "authorization": f"Bearer {token}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=config.timeout_s) as answer:  # noqa: S310
                result: dict[str, Any] = json.loads(answer.read())
                return result
        except urllib.error.HTTPError as refused:
            with refused:
                detail = _error_text(refused.read())
            if refused.code < 500 and refused.code != 429:
                raise RewardError(f"the proxy refused the reward ({refused.code}): {detail}") from None
            last = f"HTTP {refused.code}: {detail}"
            retry_after = _retry_after(refused.headers.get("retry-after"))
        except (OSError, ValueError) as exc:  # unreachable, reset, timed out; an answer that is not JSON
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            last = f"{type(reason).__name__}: {reason}"
        if attempt < config.attempts:
            pause = backoff.next_s()  # counted also when the proxy names its own pause
            if retry_after is not None:
                pause = min(retry_after, _MAX_PAUSE_S)
            logger.warning("reward attempt %d of %d failed (%s); retrying in %.1fs", attempt, config.attempts,
                           last, pause)
            time.sleep(pause)
    raise RewardError(f"the reward was not delivered after {config.attempts} attempts; last error: {last}")


def _error_text(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode("utf-8", "replace")
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(data)[:300]


def _retry_after(header: str | None) -> float | None:
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None
