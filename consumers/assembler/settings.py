"""Settings of the assembler process (``OPENFORGE_ASSEMBLER_*``); Kafka itself is ``OPENFORGE_KAFKA_*``."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.assembler.state import FinalizePolicy
from consumers.assembler.tools import DEFAULT_ERROR_PATTERNS, DEFAULT_EXIT_CODE_PATTERN, ToolErrorRules

__all__ = ["AssemblerSettings"]


class AssemblerSettings(BaseSettings):
    """How the assembler joins, finalizes and commits."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_ASSEMBLER_", frozen=True, extra="ignore")

    group_id: str = Field(default="openforge-assembler", min_length=1)
    """Consumer group over the calls, rollouts and rewards topics; instances share its partitions.
    The topic prefix goes in front, as it does for topics, so experiments never share a group."""

    instance_id: str = Field(default="0", min_length=1)
    """Stable name of this instance (a StatefulSet ordinal, say). The transactional id is
    ``<prefix><group_id>-<instance_id>``: a restarted instance with the same name fences its dead
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

    tool_error_exit_code_pattern: str = DEFAULT_EXIT_CODE_PATTERN
    """Regular expression of a reported exit code in a tool result; its first group is the code, and a
    non-zero one marks the result as an error. Decides alone where it matches (a command that exits 0
    may print "error:" lines). Used for tool results without a protocol error flag (Responses, chat)."""

    tool_error_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_ERROR_PATTERNS))
    """Regular expressions (a JSON list in the environment) that mark a tool result without an exit code
    as an error: Claude Code's ``<tool_use_error>``, ``error:`` or ``fatal:`` at a line's start, a
    Python traceback, ``command not found``."""

    @model_validator(mode="after")
    def _patterns_compile(self) -> AssemblerSettings:
        self.tool_error_rules()  # a bad pattern fails at start-up, not on the first rollout
        return self

    def tool_error_rules(self) -> ToolErrorRules:
        """The tool-error rules these settings describe (see :mod:`consumers.assembler.tools`)."""
        return ToolErrorRules.of(self.tool_error_exit_code_pattern, self.tool_error_patterns)

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
