"""``openforge report harnesses``: how trainable each harness is, from the topics.

Per harness: rollouts, model calls per rollout, merge rate (calls that extended the rollout's
earlier context token for token, over all that could have) and the drift reasons of the rest,
tool-call parse failures, retried calls, the share of infrastructure failures, mean reward, and
error recovery (tool errors after which a later call of the same tool succeeded). The numbers come
from the flight recorder's index (:mod:`openforge.ui.index`): the command reads the topics into a
throwaway one, or uses a kept index file with ``--index``; the web UI shows the same table.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import orjson

from openforge.ui.index import Index, Position

__all__ = ["HarnessRow", "Scope", "harness_report", "load_topics", "report_group"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scope:
    """Which rollouts count: one run, a time range of when they were finalized, or all."""

    run_id: str | None = None
    since: float | None = None
    until: float | None = None

    def where(self, alias: str = "") -> tuple[str, list[Any]]:
        """The SQL condition on the rollouts table (finalized rollouts only) and its parameters."""
        p = f"{alias}." if alias else ""
        clauses: list[str] = [f"{p}trajectory_id IS NOT NULL"]
        params: list[Any] = []
        if self.run_id is not None:
            clauses.append(f"{p}run_id = ?")
            params.append(self.run_id)
        if self.since is not None:
            clauses.append(f"{p}finalized_at >= ?")
            params.append(self.since)
        if self.until is not None:
            clauses.append(f"{p}finalized_at < ?")
            params.append(self.until)
        return " AND ".join(clauses), params


@dataclass
class HarnessRow:
    """The report's line for one harness."""

    harness: str
    rollouts: int
    calls_per_rollout: float
    merged: int
    """Calls appended to the sample before them."""
    breaks: int
    """Calls that started a new sample."""
    merge_rate: float | None
    """``merged / (merged + breaks)``; None without any join."""
    drift_reasons: dict[str, int] = field(default_factory=dict)
    """Breaks by drift reason (``unknown`` where the messages could not tell)."""
    tool_calls: int = 0
    parse_failures: int = 0
    retries: int = 0
    """Calls the proxy linked as retries of a failed one."""
    failed_calls: int = 0
    infrastructure_share: float = 0.0
    """Rollouts that failed for the infrastructure, over all."""
    mean_reward: float | None = None
    """Over rollouts with a reward that are not infrastructure failures."""
    tool_results: int = 0
    tool_errors: int = 0
    recovered: int = 0
    recovery_rate: float | None = None
    """``recovered / tool_errors``; None without tool errors."""


def harness_report(index: Index, scope: Scope = Scope()) -> list[HarnessRow]:
    """The report's rows, one per harness, by name."""
    where, params = scope.where()
    rows = index.rows(
        "SELECT coalesce(harness, '(unknown)') AS h, count(*) AS n, avg(calls) AS cpr, sum(merged) AS m, "
        "sum(breaks) AS b, sum(coalesce(tool_calls, 0)) AS tc, sum(coalesce(parse_failures, 0)) AS pf, "
        "sum(retries) AS r, sum(failed_calls) AS fc, avg(coalesce(infrastructure, 0)) AS inf, "
        "avg(CASE WHEN coalesce(infrastructure, 0) = 0 THEN reward END) AS rew, "
        "sum(coalesce(tool_results, 0)) AS tr, sum(coalesce(tool_errors, 0)) AS te, "
        f"sum(coalesce(recovered, 0)) AS rec FROM rollouts WHERE {where} GROUP BY h ORDER BY h", params)
    where_r, params_r = scope.where("r")
    drift: dict[str, dict[str, int]] = {}
    for row in index.rows(
            "SELECT coalesce(r.harness, '(unknown)') AS h, coalesce(b.reason, 'unknown') AS why, count(*) AS n "
            f"FROM breaks b JOIN rollouts r ON r.rollout_id = b.rollout_id WHERE {where_r} "
            "GROUP BY h, why ORDER BY n DESC", params_r):
        drift.setdefault(row["h"], {})[row["why"]] = int(row["n"])
    out = []
    for row in rows:
        merged, breaks = int(row["m"] or 0), int(row["b"] or 0)
        errors, recovered = int(row["te"]), int(row["rec"])
        out.append(HarnessRow(
            harness=row["h"], rollouts=int(row["n"]), calls_per_rollout=float(row["cpr"] or 0.0), merged=merged,
            breaks=breaks, merge_rate=merged / (merged + breaks) if merged + breaks else None,
            drift_reasons=drift.get(row["h"], {}), tool_calls=int(row["tc"]), parse_failures=int(row["pf"]),
            retries=int(row["r"]), failed_calls=int(row["fc"]), infrastructure_share=float(row["inf"] or 0.0),
            mean_reward=None if row["rew"] is None else float(row["rew"]), tool_results=int(row["tr"]),
            tool_errors=errors, recovered=recovered, recovery_rate=recovered / errors if errors else None))
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def format_table(rows: list[HarnessRow]) -> str:
    """The report as a plain-text table."""
    headers = ["harness", "rollouts", "calls/rollout", "merge rate", "drift reasons", "parse failures",
               "retries", "infra failures", "mean reward", "tool errors", "recovered"]
    lines = [[r.harness, str(r.rollouts), f"{r.calls_per_rollout:.1f}",
              f"{_pct(r.merge_rate)} ({r.merged}/{r.merged + r.breaks})",
              ", ".join(f"{k} {v}" for k, v in r.drift_reasons.items()) or "-",
              f"{r.parse_failures}/{r.tool_calls}", str(r.retries), _pct(r.infrastructure_share),
              "-" if r.mean_reward is None else f"{r.mean_reward:.3f}", f"{r.tool_errors}/{r.tool_results}",
              f"{_pct(r.recovery_rate)} ({r.recovered})"] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines)])


async def load_topics(index: Index, kafka: Any) -> int:
    """Read every record of the topics the report needs into ``index``; return how many.

    Bounded: each topic is read up to its end offsets as they are when the read starts.
    """
    from schemas import DecodeError
    from stream.tooling import read_topic
    from stream.topics import CALLS, REWARDS, ROLLOUTS, TRAJECTORIES, TopicRegistry

    registry = TopicRegistry.from_settings(kafka)
    count = 0
    for spec in (ROLLOUTS, REWARDS, CALLS, TRAJECTORIES):
        topic = registry[spec].name
        async for record in read_topic(kafka, topic):
            try:
                event = record.decode()
            except DecodeError as exc:
                logger.warning("skipping %s[%d]@%d: %s", topic, record.partition, record.offset, exc)
                continue
            index.ingest(event, Position(topic, record.partition, record.offset), record.headers)
            count += 1
    return count


def _epoch(value: datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.astimezone()).timestamp()


@click.group("report")
def report_group() -> None:
    """Reports computed from the topics."""


@report_group.command("harnesses")
@click.option("--run", "run_id", default=None, help="Only rollouts of this run id.")
@click.option("--since", type=click.DateTime(), default=None, help="Only rollouts finalized from then on (local time "
              "unless it says otherwise).")
@click.option("--until", type=click.DateTime(), default=None, help="Only rollouts finalized before then.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per harness) instead of a table.")
@click.option("--index", "index_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read this flight-recorder index (openforge ui keeps one) instead of the topics.")
def harnesses_command(run_id: str | None, since: datetime | None, until: datetime | None, as_json: bool,
                      index_path: Path | None) -> None:
    """Per harness: merge rate and drift reasons, parse failures, retries, failures, reward, error recovery."""
    from stream.settings import KafkaSettings

    if index_path is not None and not index_path.exists():
        raise click.ClickException(f"no index at {index_path}")
    index = Index(index_path if index_path is not None else ":memory:")
    try:
        if index_path is None:
            count = asyncio.run(load_topics(index, KafkaSettings()))
            click.echo(f"read {count} records", err=True)
        rows = harness_report(index, Scope(run_id, _epoch(since), _epoch(until)))
    finally:
        index.close()
    if as_json:
        sys.stdout.write(orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2).decode() + "\n")
    elif not rows:
        click.echo("no finished rollouts in scope")
    else:
        click.echo(format_table(rows))
