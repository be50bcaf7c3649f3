"""Rewards, version 1: published to ``openforge.rewards.v1`` by the proxy's reward intake."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from schemas._base import EventBase
from schemas._common import Identifier, JsonObject
from schemas.rollout_env import REWARD_LIMIT

__all__ = ["REWARD_LIMIT", "RewardV1"]



class RewardV1(EventBase):
    """The verifier's score for one rollout.

    Rewards are accepted only with the verifier's credential, never the agent's; the proxy fills
    ``verifier_id`` from that credential, not from the request body, so the field records who
    vouched for the value.
    """

    SCHEMA: ClassVar[str] = "reward"
    VERSION: ClassVar[int] = 1

    rollout_id: Identifier
    """The scored rollout; the Kafka key, so the reward meets the rollout's calls."""

    task_id: Identifier | None = None
    """Task of the rollout, when known at intake."""

    value: float = Field(allow_inf_nan=False, ge=-REWARD_LIMIT, le=REWARD_LIMIT)
    """The reward. Finite and within ±:data:`REWARD_LIMIT`: NaN or infinity would poison group advantages."""

    info: JsonObject = Field(default_factory=dict)
    """Verifier details (test results, partial scores, logs excerpt) for dashboards."""

    verifier_id: str = Field(min_length=1, max_length=256)
    """Identity of the verifier credential that reported the reward."""

    def partition_key(self) -> str:
        """Return ``rollout_id``."""
        return self.rollout_id
