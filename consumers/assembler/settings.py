"""Settings of the assembler process (``OPENFORGE_ASSEMBLER_*``); Kafka itself is ``OPENFORGE_KAFKA_*``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.assembler.state import FinalizePolicy

__all__ = ["AssemblerSettings"]


class AssemblerSettings(BaseSettings):
    """How the assembler joins, finalizes and commits."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_ASSEMBLER_", frozen=True, extra="ignore")

    group_id: str = Field(default="openforge-assembler", min_length=1)
    """Consumer group over the calls, rollouts and rewards topics; instances share its partitions."""

    instance_id: str = Field(default="0", min_length=1)
    """Stable name of this instance (a StatefulSet ordinal, say). The transactional id is
    ``<group_id>-<instance_id>``: a restarted instance with the same name fences its dead
    predecessor and aborts the transaction it left open."""

    grace_s: float = Field(default=2.0, ge=0)
    """Seconds a rollout whose terminal event (and reward) arrived stays open after its last
    event, so a call event that the proxy spooled and produced late still joins it."""

    reward_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds after a ``succeeded`` rollout's last event to wait for its reward before
    finalizing it without one (``reward_timeout``)."""

    lifecycle_timeout_s: float = Field(default=3600.0, gt=0)
    """Seconds of silence after which a rollout without a terminal lifecycle event is
    finalized anyway (``lifecycle_timeout``). Keep it above the longest task deadline."""

    closed_retention_s: float = Field(default=60.0, ge=0)
    """Seconds a finalized rollout keeps holding the committed offset, so that a restart
    re-reads it whole and recognises it as published, and later events for it are late."""

    max_open_rollouts: int = Field(default=100_000, ge=1)
    """Open rollouts held in memory; beyond this the oldest are finalized as ``evicted``."""

    remembered_finalized: int = Field(default=200_000, ge=0)
    """Ids of finalized rollouts remembered after ``closed_retention_s``, to recognise very late
    events (about 100 bytes each)."""

    commit_interval_s: float = Field(default=1.0, gt=0)
    """How often the low watermark is committed when no trajectory is published. Shorter means
    less re-reading after a crash, at one small transaction per interval."""

    poll_timeout_ms: int = Field(default=200, gt=0)
    """Longest wait for records; also the tick at which timeouts are checked."""

    max_poll_records: int = Field(default=500, ge=1)
    """Records handled per poll, and so at most per transaction."""

    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    """Group membership lease; a crashed instance's partitions move after this long."""

    replay_clock_skew_s: float = Field(default=300.0, ge=0)
    """Allowance for producer clocks when reading back published trajectories after a restart
    (record timestamps come from the proxies' and launchers' clocks)."""

    rebuild_timeout_s: float = Field(default=60.0, gt=0)
    """Longest time the read-back of published trajectories may take on an assignment."""

    drain_timeout_s: float = Field(default=20.0, gt=0)
    """How long stop() lets the batch in hand finish before cancelling it."""

    @property
    def transactional_id(self) -> str:
        """The producer's transactional id, stable across restarts of this instance."""
        return f"{self.group_id}-{self.instance_id}"

    def policy(self) -> FinalizePolicy:
        """The finalize rules these settings describe."""
        return FinalizePolicy(
            grace_s=self.grace_s,
            reward_timeout_s=self.reward_timeout_s,
            lifecycle_timeout_s=self.lifecycle_timeout_s,
            closed_retention_s=self.closed_retention_s,
            max_open_rollouts=self.max_open_rollouts,
            remembered_finalized=self.remembered_finalized,
        )
