"""The flight recorder's local index: one SQLite file of summaries, filled from the topics.

Why SQLite: one file, no server, indexed range queries that stay fast at millions of rows, and
transactions that keep a record's rows together. Why summaries only: a call event holds its whole
request and every token id; a run of 100k calls would make a multi-gigabyte index. Each row keeps
the record's position (topic, partition, offset) instead, and a page that shows a call's messages
or a trajectory's tokens reads that one record back from Kafka.

Every write is idempotent (keys are call, event and trajectory ids), so a record read twice after a
crash changes nothing; each record is committed in one transaction before the consumer commits
its offset. The index is bounded by ``max_rollouts``: the oldest rollouts and their rows are pruned.
"""

from __future__ import annotations

import math
import sqlite3
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from schemas import (
    CheckpointAppliedV1,
    CheckpointV1,
    DeadLetterV1,
    EventBase,
    LearnerStepV1,
    ModelCallV1,
    RewardV1,
    RolloutEventV1,
    TrajectoryV1,
)

__all__ = ["Index", "Position", "trace_ids"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollouts(
    rollout_id TEXT PRIMARY KEY, task_id TEXT, run_id TEXT, harness TEXT, group_index INTEGER,
    group_size INTEGER, phase TEXT, reason TEXT, message TEXT, first_at REAL, last_at REAL,
    reward REAL, reward_at REAL, reward_info TEXT, verifier_id TEXT,
    calls INTEGER NOT NULL DEFAULT 0, failed_calls INTEGER NOT NULL DEFAULT 0,
    retries INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    trajectory_id TEXT, finalized_at REAL, finalize_reason TEXT, failure_reason TEXT, infrastructure INTEGER,
    samples INTEGER, merged INTEGER, breaks INTEGER, skipped INTEGER, drift TEXT,
    trained_tokens INTEGER, context_tokens INTEGER, oldest_version INTEGER, newest_version INTEGER,
    tool_calls INTEGER, tool_results INTEGER, tool_errors INTEGER, recovered INTEGER, parse_failures INTEGER,
    traj_topic TEXT, traj_partition INTEGER, traj_offset INTEGER);
CREATE INDEX IF NOT EXISTS rollouts_last ON rollouts(last_at);
CREATE INDEX IF NOT EXISTS rollouts_run ON rollouts(run_id, finalized_at);
CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts(task_id, last_at);
CREATE INDEX IF NOT EXISTS rollouts_harness ON rollouts(harness, last_at);
CREATE TABLE IF NOT EXISTS calls(
    call_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, started_at REAL, protocol TEXT, model TEXT,
    status TEXT, attempt INTEGER, retry_of TEXT, streamed INTEGER, prompt_tokens INTEGER,
    completion_tokens INTEGER, finish_reason TEXT, versions TEXT, total_s REAL, ttft_s REAL, error TEXT,
    replica TEXT, trace_id TEXT, topic TEXT, partition INTEGER, offset INTEGER);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls(rollout_id, started_at);
CREATE INDEX IF NOT EXISTS calls_trace ON calls(trace_id);
CREATE TABLE IF NOT EXISTS lifecycle(
    event_id TEXT PRIMARY KEY, rollout_id TEXT NOT NULL, at REAL, phase TEXT, reason TEXT, message TEXT,
    harness_exit INTEGER, verifier_exit INTEGER, infrastructure INTEGER, backend TEXT, pod TEXT);
CREATE INDEX IF NOT EXISTS lifecycle_rollout ON lifecycle(rollout_id, at);
CREATE TABLE IF NOT EXISTS breaks(
    rollout_id TEXT NOT NULL, call_id TEXT NOT NULL, sample_index INTEGER, context_tokens INTEGER,
    common_prefix INTEGER, reason TEXT, PRIMARY KEY(rollout_id, call_id));
CREATE INDEX IF NOT EXISTS breaks_reason ON breaks(reason);
CREATE TABLE IF NOT EXISTS tool_errors(
    rollout_id TEXT NOT NULL, tool_call_id TEXT NOT NULL, tool_name TEXT, call_id TEXT, rule TEXT,
    recovered INTEGER, recovered_by TEXT, PRIMARY KEY(rollout_id, tool_call_id));
CREATE TABLE IF NOT EXISTS steps(
    model TEXT NOT NULL, step INTEGER NOT NULL, version INTEGER, at REAL, duration_s REAL,
    trajectories INTEGER, dropped INTEGER, reward_mean REAL, loss REAL, staleness_mean REAL,
    metrics TEXT, weights TEXT, drops TEXT, topic TEXT, partition INTEGER, offset INTEGER,
    PRIMARY KEY(model, step));
CREATE INDEX IF NOT EXISTS steps_at ON steps(at);
CREATE TABLE IF NOT EXISTS step_rollouts(
    model TEXT NOT NULL, step INTEGER NOT NULL, trajectory_id TEXT NOT NULL, rollout_id TEXT, task_id TEXT,
    group_index INTEGER, reward REAL, advantage REAL, trained_tokens INTEGER, oldest_version INTEGER,
    dropped TEXT, PRIMARY KEY(model, step, trajectory_id));
CREATE INDEX IF NOT EXISTS step_rollouts_rollout ON step_rollouts(rollout_id);
CREATE TABLE IF NOT EXISTS checkpoints(
    model TEXT NOT NULL, version INTEGER NOT NULL, at REAL, step INTEGER, uri TEXT, metrics TEXT,
    PRIMARY KEY(model, version));
CREATE TABLE IF NOT EXISTS applied(
    model TEXT NOT NULL, version INTEGER NOT NULL, replica TEXT NOT NULL, at REAL, ok INTEGER,
    duration_s REAL, error TEXT, PRIMARY KEY(model, version, replica));
CREATE TABLE IF NOT EXISTS dead_letters(
    event_id TEXT PRIMARY KEY, at REAL, topic TEXT, error_type TEXT, reason TEXT);
"""

_PRUNE_EVERY = 5000
"""New rollouts between two checks of the bound."""


@dataclass(frozen=True)
class Position:
    """Where a record is on Kafka."""

    topic: str
    partition: int
    offset: int


def trace_ids(headers: Sequence[tuple[str, bytes | None]]) -> tuple[str | None, str | None]:
    """The W3C trace and span id a record's ``traceparent`` header carries, if any."""
    for name, value in headers:
        if name == "traceparent" and value:
            parts = value.decode("ascii", "replace").split("-")
            if len(parts) >= 3 and len(parts[1]) == 32:
                return parts[1], parts[2]
    return None, None


def _at(event: EventBase) -> float:
    return event.created_at.timestamp()


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


class Index:
    """The SQLite index: :meth:`ingest` events, then query with :meth:`rows` / :meth:`row`."""

    def __init__(self, path: Path | str, *, max_rollouts: int = 1_000_000) -> None:
        """Open (or create) the index at ``path`` (``":memory:"`` for a throwaway one)."""
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_rollouts = max_rollouts
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses at most the last commits, never corrupts
        self._db.executescript(_SCHEMA)
        self._new_rollouts = 0
        self.ingested = 0
        """Records handled by this instance."""

    def close(self) -> None:
        """Close the file."""
        self._db.close()

    # -- identity ----------------------------------------------------------------------------------

    def identity(self) -> str:
        """A random id made when the file was created, which names the index's consumer group.

        So a new file reads the topics from the beginning and a kept one resumes where it was.
        """
        row = self._db.execute("SELECT value FROM meta WHERE key='identity'").fetchone()
        if row is not None:
            return str(row["value"])
        value = uuid.uuid4().hex[:16]
        self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('identity', ?)", (value,))
        return self.identity()

    # -- queries -----------------------------------------------------------------------------------

    def rows(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> list[sqlite3.Row]:
        """Run a query and return every row."""
        return self._db.execute(sql, params).fetchall()

    def row(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> sqlite3.Row | None:
        """Run a query and return its first row, if any."""
        row: sqlite3.Row | None = self._db.execute(sql, params).fetchone()
        return row

    def value(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> Any:
        """Run a query and return the first column of its first row (None without rows)."""
        row = self._db.execute(sql, params).fetchone()
        return None if row is None else row[0]

    # -- ingestion ---------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def ingest(self, event: EventBase, where: Position, headers: Sequence[tuple[str, bytes | None]] = ()) -> None:
        """Add one event (any registered kind; kinds the index does not show are ignored)."""
        with self._transaction() as db:
            if isinstance(event, ModelCallV1):
                self._call(db, event, where, headers)
            elif isinstance(event, RolloutEventV1):
                self._lifecycle(db, event)
            elif isinstance(event, RewardV1):
                self._reward(db, event)
            elif isinstance(event, TrajectoryV1):
                self._trajectory(db, event, where)
            elif isinstance(event, LearnerStepV1):
                self._step(db, event, where)
            elif isinstance(event, CheckpointV1):
                db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?)",
                           (event.model, event.version, _at(event), event.step, event.uri, _json(event.metrics)))
            elif isinstance(event, CheckpointAppliedV1):
                db.execute("INSERT OR REPLACE INTO applied VALUES (?,?,?,?,?,?,?)",
                           (event.model, event.version, event.replica, event.applied_at.timestamp(), int(event.ok),
                            event.duration_s, event.error))
            elif isinstance(event, DeadLetterV1):
                db.execute("INSERT OR IGNORE INTO dead_letters VALUES (?,?,?,?,?)",
                           (event.event_id, _at(event), event.topic, event.error_type.value, event.reason[:500]))
        self.ingested += 1
        if self._new_rollouts >= _PRUNE_EVERY:
            self._new_rollouts = 0
            self.prune()

    def _touch(self, db: sqlite3.Connection, rollout_id: str, at: float) -> None:
        created = db.execute("INSERT OR IGNORE INTO rollouts(rollout_id, first_at, last_at) VALUES (?,?,?)",
                             (rollout_id, at, at)).rowcount
        self._new_rollouts += created
        if not created:
            db.execute("UPDATE rollouts SET first_at=min(first_at, ?), last_at=max(last_at, ?) WHERE rollout_id=?",
                       (at, at, rollout_id))

    def _call(self, db: sqlite3.Connection, call: ModelCallV1, where: Position,
              headers: Sequence[tuple[str, bytes | None]]) -> None:
        choice = call.first_choice
        versions = sorted({r.version for c in call.choices for r in c.weight_versions})
        trace_id, _ = trace_ids(headers)
        started = call.timings.started_at.timestamp()
        added = db.execute(
            "INSERT OR IGNORE INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (call.call_id, call.rollout_id, started, call.protocol.value, call.model, call.status.value,
             call.attempt, call.retry_of, int(call.streamed), call.prompt_length,
             len(choice.completion_token_ids) if choice else 0, choice.finish_reason if choice else None,
             ",".join(versions), call.timings.total_s, call.timings.time_to_first_token_s,
             (call.error_message or "")[:500] or None, call.upstream_replica, trace_id, where.topic, where.partition,
             where.offset)).rowcount
        if not added:
            return
        self._touch(db, call.rollout_id, started + call.timings.total_s)
        db.execute("UPDATE rollouts SET calls=calls+1, failed_calls=failed_calls+?, retries=retries+?, "
                   "prompt_tokens=prompt_tokens+?, completion_tokens=completion_tokens+?, "
                   "task_id=coalesce(task_id, ?) WHERE rollout_id=?",
                   (int(call.status.value != "ok"), int(call.attempt > 0), call.prompt_length,
                    len(choice.completion_token_ids) if choice else 0, call.task_id, call.rollout_id))

    def _lifecycle(self, db: sqlite3.Connection, event: RolloutEventV1) -> None:
        added = db.execute("INSERT OR IGNORE INTO lifecycle VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                           (event.event_id, event.rollout_id, _at(event), event.phase.value,
                            event.reason.value if event.reason else None, (event.message or "")[:1000] or None,
                            event.harness_exit_code, event.verifier_exit_code, int(event.infrastructure_failure),
                            event.backend.value, event.pod_name)).rowcount
        if not added:
            return
        at = _at(event)
        self._touch(db, event.rollout_id, at)
        # The newest lifecycle event sets the phase, unless a terminal one is already there.
        db.execute("UPDATE rollouts SET task_id=?, run_id=coalesce(?, run_id), harness=coalesce(?, harness), "
                   "group_index=?, group_size=coalesce(?, group_size), "
                   "phase=CASE WHEN phase IN ('succeeded','failed','timed_out','cancelled') THEN phase ELSE ? END, "
                   "reason=CASE WHEN phase IN ('succeeded','failed','timed_out','cancelled') THEN reason ELSE ? END, "
                   "message=coalesce(?, message) WHERE rollout_id=?",
                   (event.task_id, event.run_id, event.harness, event.group_index, event.group_size,
                    event.phase.value, event.reason.value if event.reason else None,
                    (event.message or "")[:1000] or None, event.rollout_id))

    def _reward(self, db: sqlite3.Connection, event: RewardV1) -> None:
        at = _at(event)
        self._touch(db, event.rollout_id, at)
        db.execute("UPDATE rollouts SET reward=?, reward_at=?, reward_info=?, verifier_id=?, "
                   "task_id=coalesce(task_id, ?) WHERE rollout_id=? AND reward_at IS NULL",
                   (event.value, at, _json(event.info)[:2000], event.verifier_id, event.task_id, event.rollout_id))

    def _trajectory(self, db: sqlite3.Connection, event: TrajectoryV1, where: Position) -> None:
        at = _at(event)
        self._touch(db, event.rollout_id, at)
        trained = sum(s.trained_tokens for s in event.samples)
        context = sum(len(s.completion_ids) for s in event.samples) - trained
        numbers = [r.version_number for s in event.samples for r in s.weight_versions]
        known = [n for n in numbers if n is not None]
        reasons = sorted({b.reason.value for b in event.merge_breaks if b.reason is not None})
        tools = event.tool_use
        stats = event.merge_stats
        db.execute(
            "UPDATE rollouts SET trajectory_id=?, task_id=?, run_id=coalesce(?, run_id), harness=coalesce(?, harness), "
            "group_index=?, group_size=coalesce(?, group_size), phase=coalesce(?, phase), reason=coalesce(?, reason), "
            "reward=coalesce(reward, ?), finalized_at=?, finalize_reason=?, failure_reason=?, infrastructure=?, "
            "samples=?, merged=?, breaks=?, skipped=?, drift=?, trained_tokens=?, context_tokens=?, "
            "oldest_version=?, newest_version=?, tool_calls=?, tool_results=?, tool_errors=?, recovered=?, "
            "parse_failures=?, traj_topic=?, traj_partition=?, traj_offset=? WHERE rollout_id=?",
            (event.trajectory_id, event.task_id, event.run_id, event.harness, event.group_index, event.group_size,
             event.phase.value if event.phase else None, event.reason.value if event.reason else None, event.reward,
             at, event.finalize_reason.value, event.failure_reason.value if event.failure_reason else None,
             int(event.infrastructure_failure), len(event.samples), stats.merged, stats.breaks, stats.skipped,
             ",".join(reasons) or None, trained, context, min(known, default=None), max(known, default=None),
             tools.tool_calls if tools else None, tools.results if tools else None, tools.errors if tools else None,
             tools.recovered if tools else None, tools.parse_failures if tools else None,
             where.topic, where.partition, where.offset, event.rollout_id))
        db.executemany("INSERT OR REPLACE INTO breaks VALUES (?,?,?,?,?,?)",
                       [(event.rollout_id, b.call_id, b.sample_index, b.context_tokens, b.common_prefix_tokens,
                         b.reason.value if b.reason else None) for b in event.merge_breaks])
        db.executemany("INSERT OR REPLACE INTO tool_errors VALUES (?,?,?,?,?,?,?)",
                       [(event.rollout_id, e.tool_call_id, e.tool_name, e.call_id, e.rule.value, int(e.recovered),
                         e.recovered_by) for e in event.tool_errors])

    def _step(self, db: sqlite3.Connection, event: LearnerStepV1, where: Position) -> None:
        drops: dict[str, int] = {}
        for item in event.dropped:
            drops[item.reason] = drops.get(item.reason, 0) + 1
        metrics = event.metrics
        rewards = [t.reward for t in event.trajectories]
        db.execute("INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (event.model, event.step, event.version, _at(event), event.duration_s, len(event.trajectories),
                    len(event.dropped), sum(rewards) / len(rewards) if rewards else None, metrics.get("loss"),
                    metrics.get("staleness_mean"), _json(metrics), _json(event.importance_weights), _json(drops),
                    where.topic, where.partition, where.offset))
        db.executemany("INSERT OR REPLACE INTO step_rollouts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       [(event.model, event.step, t.trajectory_id, t.rollout_id, t.task_id, t.group_index, t.reward,
                         t.advantage, t.trained_tokens, t.oldest_version, None) for t in event.trajectories]
                       + [(event.model, event.step, d.trajectory_id, d.rollout_id, d.task_id, None, None, None,
                           None, None, d.reason) for d in event.dropped])

    # -- bound ---------------------------------------------------------------------------------------

    def prune(self) -> int:
        """Drop the oldest rollouts (and their rows) beyond ``max_rollouts``; return how many went."""
        count = int(self.value("SELECT count(*) FROM rollouts") or 0)
        excess = count - self.max_rollouts
        if excess <= 0:
            return 0
        with self._transaction() as db:
            db.execute("CREATE TEMP TABLE IF NOT EXISTS gone(rollout_id TEXT PRIMARY KEY)")
            db.execute("DELETE FROM gone")
            db.execute("INSERT INTO gone SELECT rollout_id FROM rollouts ORDER BY last_at LIMIT ?", (excess,))
            for table in ("calls", "lifecycle", "breaks", "tool_errors", "rollouts"):
                db.execute(f"DELETE FROM {table} WHERE rollout_id IN (SELECT rollout_id FROM gone)")
        return excess


def finite(value: float | None) -> float | None:
    """``value`` when it is a finite number, else None (for charts)."""
    return value if value is not None and math.isfinite(value) else None
