"""The flight recorder's pages: runs, rollouts, one rollout, its token view, learner steps, the harness report.

Every page is one or a few indexed SQLite queries over the summaries; a rollout's messages and a
sample's tokens are read back from Kafka by position (:class:`~stream.records.RecordReader`).
From the runs page, a point on the reward curve opens its rollouts, a rollout opens its calls and
samples, and a sample opens its tokens: three clicks.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

from openforge.report import Scope, harness_report
from openforge.ui.charts import Series, histogram, line_chart
from openforge.ui.html import esc, fmt_float, fmt_int, fmt_time, link, page, query, table
from openforge.ui.index import Index
from openforge.ui.settings import UISettings
from openforge.ui.tokens import COLOURINGS, call_spans, page_links, render_sample
from schemas import ModelCallV1, TrajectoryV1
from schemas.call.linear import UnresolvedPrefixError, WholeCalls
from schemas.drift import DriftReason
from schemas.failures import FailureReason
from schemas.rollout.v1 import RolloutPhase

__all__ = ["UIState", "router"]

_PAGE_ROWS = 50
_CURVE_POINTS = 60
_NO_RUN = "-"
"""The run filter value for rollouts that carry no run id."""


@dataclass
class UIState:
    """Everything a page handler uses."""

    settings: UISettings
    index: Index
    reader: Any
    """A :class:`~stream.records.RecordReader` (anything with its ``read``)."""
    text_of: Callable[[int], str] | None = None
    follower: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


def load_tokenizer(path: Path | None) -> Callable[[int], str] | None:
    """Token id to text from a ``tokenizer.json`` (or a folder holding one); None without one."""
    if path is None:
        return None
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    tokenizer = Tokenizer.from_file(str(file))
    cache: dict[int, str] = {}

    def text_of(token: int) -> str:
        if token not in cache:
            cache[token] = tokenizer.decode([token], skip_special_tokens=False)
        return cache[token]

    return text_of


def _state(request: Request) -> UIState:
    state: UIState = request.app.state.ui
    return state


def _float(value: str | None) -> float | None:
    try:
        return None if value is None or value == "" else float(value)
    except ValueError:
        return None


router = APIRouter()


@router.get("/health")
async def health() -> PlainTextResponse:
    """Liveness (served without the credential; shows nothing)."""
    return PlainTextResponse("ok")


# -- runs ---------------------------------------------------------------------------------------------


def _run_clause(run: str, alias: str = "") -> tuple[str, list[Any]]:
    p = f"{alias}." if alias else ""
    return (f"{p}run_id IS NULL", []) if run == _NO_RUN else (f"{p}run_id = ?", [run])


@router.get("/")
async def runs_page(request: Request, run: str | None = None) -> Response:
    """The runs, and for the chosen one (the newest by default) its curves and counts."""
    ui = _state(request)
    index = ui.index
    runs = index.rows("SELECT coalesce(run_id, ?) AS run, count(*) AS n, count(trajectory_id) AS done, "
                      "avg(CASE WHEN coalesce(infrastructure, 0) = 0 THEN reward END) AS reward, min(first_at) AS t0, "
                      "max(last_at) AS t1 FROM rollouts GROUP BY run_id ORDER BY t1 DESC", (_NO_RUN,))
    body = ["<h1>Runs</h1>"]
    if not runs:
        body.append('<p class="muted">Nothing recorded yet: the index fills as events arrive on the topics.</p>')
        return page("Runs", "".join(body), refresh_s=ui.settings.live_refresh_s)
    chosen = run if run is not None else str(runs[0]["run"])
    body.append(table(["run", "rollouts", "finished", "mean reward", "first event", "last event"], [
        [link(query("/", {"run": r["run"]}), r["run"]) + (" ◀" if r["run"] == chosen else ""), fmt_int(r["n"]),
         fmt_int(r["done"]), fmt_float(r["reward"]), fmt_time(r["t0"]), fmt_time(r["t1"])] for r in runs],
        numeric=(1, 2, 3), attrs='id="runs"'))
    body.append(_run_detail(ui, chosen))
    return page("Runs", "".join(body), refresh_s=ui.settings.live_refresh_s)


def _run_detail(ui: UIState, run: str) -> str:
    index = ui.index
    where, params = _run_clause(run)
    span = index.row(f"SELECT min(first_at) AS t0, max(last_at) AS t1, count(*) AS n, count(trajectory_id) AS done, "
                     f"sum(coalesce(infrastructure, 0)) AS infra, sum(merged) AS merged, sum(breaks) AS breaks, "
                     f"sum(trained_tokens) AS trained, sum(context_tokens) AS context, "
                     f"sum(tool_errors) AS errors, sum(recovered) AS recovered FROM rollouts WHERE {where}", params)
    if span is None or span["t0"] is None:
        return '<p class="muted">no rollouts in this run</p>'
    t0, t1 = float(span["t0"]), float(span["t1"])
    out = [f"<h2>Run {esc(run)}</h2>"]
    steps = index.rows("SELECT model, step, version, at, reward_mean, loss, staleness_mean, drops, trajectories "
                       "FROM steps WHERE at BETWEEN ? AND ? ORDER BY at", (t0 - 60, t1 + 3600))
    applied = index.rows("SELECT model, version, replica, at FROM applied WHERE ok = 1 AND at BETWEEN ? AND ? "
                         "ORDER BY at", (t0 - 60, t1 + 3600))
    merged, breaks = int(span["merged"] or 0), int(span["breaks"] or 0)
    trained, context = int(span["trained"] or 0), int(span["context"] or 0)
    errors = int(span["errors"] or 0)
    cards = [("rollouts", fmt_int(span["n"])), ("finished", fmt_int(span["done"])),
             ("learner steps", fmt_int(len(steps))),
             ("served version", str(max((a["version"] for a in applied), default="-"))),
             ("infrastructure failures", fmt_int(span["infra"])),
             ("merge rate", f"{100 * merged / (merged + breaks):.0f}%" if merged + breaks else "-"),
             ("masked tokens", f"{100 * context / (trained + context):.0f}%" if trained + context else "-"),
             ("tool errors recovered", f"{int(span['recovered'] or 0)}/{errors}" if errors else "-")]
    out.append('<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{esc(v)}</div><div class="k">{esc(k)}</div></div>' for k, v in cards)
        + "</div>")
    out.append('<div class="charts">')
    out.append(_chart("Reward over time (a point opens its rollouts)", _reward_curve(ui, run, t0), "reward-curve"))
    step_points = [(float(s["at"]), float(s["reward_mean"])) for s in steps if s["reward_mean"] is not None]
    loss_points = [(float(s["at"]), float(s["loss"])) for s in steps if s["loss"] is not None]
    step_links = [f"/steps/{s['model']}/{s['step']}" for s in steps if s["reward_mean"] is not None]
    loss_links = [f"/steps/{s['model']}/{s['step']}" for s in steps if s["loss"] is not None]
    out.append(_chart("Learner steps: batch reward and loss (a point opens its step)", line_chart([
        Series("batch reward", step_points, step_links, [f"step {s['step']}" for s in steps
                                                         if s["reward_mean"] is not None]),
        Series("loss", loss_points, loss_links)]), "steps-chart"))
    out.append(_chart("Weight versions: trained and served", line_chart([
        Series("learner", [(float(s["at"]), float(s["version"])) for s in steps if s["version"] is not None]),
        Series("served", [(float(a["at"]), float(a["version"])) for a in applied], dots=True)])))
    stale = [(float(s["at"]), float(s["staleness_mean"])) for s in steps if s["staleness_mean"] is not None]
    out.append(_chart("Staleness of trained data (versions)", line_chart([Series("mean staleness", stale)])))
    out.append("</div>")
    drops: dict[str, int] = {}
    for s in steps:
        for reason, count in orjson.loads(s["drops"] or "{}").items():
            drops[reason] = drops.get(reason, 0) + int(count)
    out.append("<h2>Dropped and masked</h2>")
    out.append(table(["dropped by the learner", "trajectories"],
                     [[esc(k), fmt_int(v)] for k, v in sorted(drops.items(), key=lambda kv: -kv[1])]
                     or [['<span class="muted">none</span>', ""]], numeric=(1,)))
    out.append(f'<p>{fmt_int(context)} of {fmt_int(trained + context)} completion tokens are context (loss mask 0); '
               f"{fmt_int(trained)} are trained.</p>")
    failures = index.rows(f"SELECT failure_reason AS r, infrastructure AS i, count(*) AS n FROM rollouts "
                          f"WHERE {where} AND failure_reason IS NOT NULL GROUP BY r, i ORDER BY n DESC", params)
    out.append("<h2>Failures by reason</h2>")
    out.append(table(["reason", "blame", "rollouts"], [
        [link(query("/rollouts", {"run": run, "failure": f["r"]}), f["r"]),
         "infrastructure" if f["i"] else "policy", fmt_int(f["n"])] for f in failures]
        or [['<span class="muted">none</span>', "", ""]], numeric=(2,), attrs='id="failures"'))
    where_r, params_r = _run_clause(run, "r")
    drift = index.rows(f"SELECT coalesce(b.reason, 'unknown') AS why, count(*) AS n FROM breaks b "
                       f"JOIN rollouts r ON r.rollout_id = b.rollout_id WHERE {where_r} GROUP BY why "
                       "ORDER BY n DESC", params_r)
    out.append("<h2>Merge breaks by drift reason</h2>")
    out.append(table(["reason", "breaks"], [
        [link(query("/rollouts", {"run": run, "drift": d["why"]}), d["why"]), fmt_int(d["n"])] for d in drift]
        or [['<span class="muted">none</span>', ""]], numeric=(1,)))
    return "".join(out)


def _chart(title: str, svg: str, element_id: str = "") -> str:
    ident = f' id="{esc(element_id)}"' if element_id else ""
    return f'<div class="chart"{ident}><h3>{esc(title)}</h3>{svg}</div>'


def _reward_curve(ui: UIState, run: str, t0: float) -> str:
    where, params = _run_clause(run)
    bounds = ui.index.row(f"SELECT min(finalized_at) AS a, max(finalized_at) AS b FROM rollouts WHERE {where} "
                          "AND reward IS NOT NULL AND finalized_at IS NOT NULL AND coalesce(infrastructure, 0) = 0",
                          params)
    if bounds is None or bounds["a"] is None:
        return '<p class="muted">no rewards yet</p>'
    a, b = float(bounds["a"]), float(bounds["b"])
    width = max((b - a) / _CURVE_POINTS, 1e-3)
    buckets = ui.index.rows(
        f"SELECT CAST((finalized_at - ?) / ? AS INTEGER) AS k, avg(reward) AS r, count(*) AS n, "
        f"min(finalized_at) AS lo, max(finalized_at) AS hi FROM rollouts WHERE {where} AND reward IS NOT NULL "
        f"AND finalized_at IS NOT NULL AND coalesce(infrastructure, 0) = 0 GROUP BY k ORDER BY k",
        [a, width, *params])
    points = [((float(x["lo"]) + float(x["hi"])) / 2, float(x["r"])) for x in buckets]
    links = [query("/rollouts", {"run": run, "from": f"{float(x['lo']):.3f}", "to": f"{float(x['hi']) + 0.001:.3f}"})
             for x in buckets]
    tips = [f"mean reward {float(x['r']):.3f} over {x['n']} rollouts" for x in buckets]
    return line_chart([Series("mean reward", points, links, tips)], element_id="reward-svg")


# -- rollouts -----------------------------------------------------------------------------------------

_FILTERS = ("run", "task", "harness", "phase", "failure", "drift", "reward_min", "reward_max", "from", "to",
            "errors", "before")


@router.get("/rollouts")
async def rollouts_page(request: Request) -> Response:
    """Rollouts, newest first, filtered by run, task, harness, reward, phase, failure reason, drift reason."""
    ui = _state(request)
    f = {k: request.query_params.get(k) or None for k in _FILTERS}
    clauses: list[str] = []
    params: list[Any] = []
    if f["run"]:
        clause, extra = _run_clause(f["run"])
        clauses.append(clause)
        params += extra
    for key, column in (("task", "task_id"), ("harness", "harness"), ("phase", "phase"), ("failure", "failure_reason")):
        if f[key]:
            clauses.append(f"{column} = ?")
            params.append(f[key])
    if f["drift"] == "any":
        clauses.append("breaks > 0")
    elif f["drift"]:
        clauses.append("rollout_id IN (SELECT rollout_id FROM breaks WHERE coalesce(reason, 'unknown') = ?)")
        params.append(f["drift"])
    if f["errors"]:
        clauses.append("tool_errors > 0")
    for key, op in (("reward_min", ">="), ("reward_max", "<=")):
        value = _float(f[key])
        if value is not None:
            clauses.append(f"reward {op} ?")
            params.append(value)
    for key, op in (("from", ">="), ("to", "<")):
        value = _float(f[key])
        if value is not None:
            clauses.append(f"finalized_at {op} ?")
            params.append(value)
    before = f["before"]
    if before:
        at, _, rid = before.partition("|")
        clauses.append("(last_at < ? OR (last_at = ? AND rollout_id < ?))")
        params += [_float(at) or 0.0, _float(at) or 0.0, rid]
    where = " AND ".join(clauses) or "1"
    rows = ui.index.rows(
        f"SELECT rollout_id, task_id, harness, phase, failure_reason, infrastructure, reward, calls, samples, breaks, "
        f"drift, tool_errors, recovered, trained_tokens, last_at, finalized_at FROM rollouts WHERE {where} "
        f"ORDER BY last_at DESC, rollout_id DESC LIMIT ?", [*params, _PAGE_ROWS + 1])
    more = len(rows) > _PAGE_ROWS
    rows = rows[:_PAGE_ROWS]
    harnesses = [r["harness"] for r in ui.index.rows("SELECT DISTINCT harness FROM rollouts WHERE harness IS NOT NULL "
                                                     "ORDER BY harness")]
    form = _filter_form(f, harnesses)
    lines = []
    for r in rows:
        outcome = r["failure_reason"] or r["phase"] or ""
        cls = "bad" if r["failure_reason"] else "good" if r["phase"] == "succeeded" else ""
        tags = "".join(f'<span class="tag break">{esc(d)}</span>' for d in (r["drift"] or "").split(",") if d)
        errors = r["tool_errors"]
        lines.append([
            link(f"/rollouts/{r['rollout_id']}", r["rollout_id"], class_="rollout-link"), esc(r["task_id"]),
            esc(r["harness"]), f'<span class="{cls}">{esc(outcome)}</span>', fmt_float(r["reward"]),
            fmt_int(r["calls"]), f"{fmt_int(r['samples'])} {tags}",
            "" if not errors else f"{errors} ({fmt_int(r['recovered'])} recovered)", fmt_int(r["trained_tokens"]),
            fmt_time(r["finalized_at"] or r["last_at"])])
    body = ["<h1>Rollouts</h1>", form,
            table(["rollout", "task", "harness", "outcome", "reward", "calls", "samples / breaks", "tool errors",
                   "trained tokens", "finished"], lines, numeric=(4, 5, 8), attrs='id="rollouts"')]
    if not rows:
        body.append('<p class="muted">no rollout matches</p>')
    if more:
        last = rows[-1]
        body.append('<nav class="pager">' + link(query("/rollouts", {**f, "before": f"{last['last_at']}|"
                                                                       f"{last['rollout_id']}"}), "older") + "</nav>")
    return page("Rollouts", "".join(body))


def _filter_form(f: Mapping[str, str | None], harnesses: Sequence[str]) -> str:
    def select(name: str, options: Sequence[str], label: str) -> str:
        opts = '<option value="">any</option>' + "".join(
            f'<option{" selected" if f.get(name) == o else ""}>{esc(o)}</option>' for o in options)
        return f'<label>{esc(label)}<select name="{name}">{opts}</select></label>'

    def text(name: str, label: str, size: int = 10) -> str:
        return f'<label>{esc(label)}<input name="{name}" value="{esc(f.get(name) or "")}" size="{size}"></label>'

    hidden = "".join(f'<input type="hidden" name="{k}" value="{esc(f[k])}">' for k in ("from", "to") if f.get(k))
    return ('<form class="filters" method="get" action="/rollouts">' + text("run", "run") + text("task", "task")
            + select("harness", harnesses, "harness") + select("phase", [p.value for p in RolloutPhase], "phase")
            + select("failure", [r.value for r in FailureReason], "failure reason")
            + select("drift", ["any", *(d.value for d in DriftReason), "unknown"], "merge break")
            + text("reward_min", "reward ≥", 5) + text("reward_max", "reward ≤", 5)
            + f'<label>tool errors<select name="errors"><option value="">any</option>'
              f'<option value="1"{" selected" if f.get("errors") else ""}>with errors</option></select></label>'
            + hidden + '<button type="submit">filter</button></form>')


# -- one rollout ----------------------------------------------------------------------------------------


@router.get("/rollouts/{rollout_id}")
async def rollout_page(request: Request, rollout_id: str) -> Response:
    """A rollout: lifecycle timeline, reward, the steps that trained it, samples, and each call's messages."""
    ui = _state(request)
    index = ui.index
    r = index.row("SELECT * FROM rollouts WHERE rollout_id = ?", (rollout_id,))
    if r is None:
        return page("Not found", f"<h1>No rollout {esc(rollout_id)}</h1>", status_code=404)
    calls = index.rows("SELECT * FROM calls WHERE rollout_id = ? ORDER BY started_at", (rollout_id,))
    lifecycle = index.rows("SELECT * FROM lifecycle WHERE rollout_id = ? ORDER BY at", (rollout_id,))
    breaks = {b["call_id"]: b for b in index.rows("SELECT * FROM breaks WHERE rollout_id = ?", (rollout_id,))}
    errors = {e["tool_call_id"]: e for e in index.rows("SELECT * FROM tool_errors WHERE rollout_id = ?", (rollout_id,))}
    steps = index.rows("SELECT model, step, advantage, reward, dropped FROM step_rollouts WHERE rollout_id = ? "
                       "ORDER BY step", (rollout_id,))
    events = await ui.reader.read([(c["topic"], c["partition"], c["offset"]) for c in calls]
                                  + ([(r["traj_topic"], r["traj_partition"], r["traj_offset"])]
                                     if r["traj_topic"] is not None else []))
    bodies = _whole_bodies([events.get((c["topic"], c["partition"], c["offset"]))
                            for c in sorted(calls, key=lambda c: (c["partition"], c["offset"]))])
    trajectory = events.get((r["traj_topic"], r["traj_partition"], r["traj_offset"])) if r["traj_topic"] else None
    out = [f"<h1>Rollout {esc(rollout_id)}</h1>"]
    facts = [("task", link(query("/rollouts", {"task": r["task_id"]}), r["task_id"]) if r["task_id"] else ""),
             ("run", esc(r["run_id"])), ("harness", esc(r["harness"])),
             ("group", f"{fmt_int(r['group_index'])} of {fmt_int(r['group_size'])}"),
             ("phase", esc(r["phase"]) + (f" ({esc(r['reason'])})" if r["reason"] else "")),
             ("failure reason", esc(r["failure_reason"]) + (" (infrastructure)" if r["infrastructure"] else "")
              if r["failure_reason"] else '<span class="muted">none</span>'),
             ("reward", f'<span id="reward">{fmt_float(r["reward"], 4)}</span>'
              + (f' <span class="muted">from {esc(r["verifier_id"])}</span>' if r["verifier_id"] else "")),
             ("verifier info", f'<code>{esc(r["reward_info"])}</code>' if r["reward_info"] else ""),
             ("calls", f"{fmt_int(r['calls'])} ({fmt_int(r['failed_calls'])} failed, {fmt_int(r['retries'])} retries)"),
             ("tool use", "" if r["tool_results"] is None else
              f"{fmt_int(r['tool_calls'])} calls, {fmt_int(r['tool_results'])} results, "
              f"{fmt_int(r['tool_errors'])} errors, {fmt_int(r['recovered'])} recovered, "
              f"{fmt_int(r['parse_failures'])} parse failures"),
             ("finalized", f"{fmt_time(r['finalized_at'])} ({esc(r['finalize_reason'])})" if r["finalized_at"] else
              '<span class="muted">not yet</span>')]
    out.append(table(["", ""], [[esc(k), v] for k, v in facts], attrs='id="facts"'))
    if steps:
        out.append("<h2>Learner steps</h2>" + table(["step", "advantage", "reward used", "left out"], [
            [link(f"/steps/{s['model']}/{s['step']}", f"{s['model']} step {s['step']}"), fmt_float(s["advantage"]),
             fmt_float(s["reward"]), esc(s["dropped"])] for s in steps], numeric=(1, 2)))
    out.append("<h2>Timeline</h2>" + _timeline(r, lifecycle, calls))
    out.append("<h2>Samples</h2>")
    if isinstance(trajectory, TrajectoryV1):
        rows = []
        for k, sample in enumerate(trajectory.samples):
            brk = next((b for b in breaks.values() if b["sample_index"] == k), None)
            why = "" if brk is None else (f'<span class="tag break">{esc(brk["reason"] or "unknown")}</span> '
                                          f"after {fmt_int(brk['common_prefix'])} of {fmt_int(brk['context_tokens'])} "
                                          "context tokens")
            rows.append([link(f"/rollouts/{rollout_id}/tokens?sample={k}", f"sample {k}: token view",
                              class_="token-link"), fmt_int(len(sample.prompt_ids)),
                         fmt_int(len(sample.completion_ids)),
                         fmt_int(sample.trained_tokens), fmt_int(len(sample.call_ids)), why])
        out.append(table(["sample", "prompt", "completion", "trained", "calls", "started by a merge break"], rows,
                         numeric=(1, 2, 3, 4), attrs='id="samples"') if rows else
                   '<p class="muted">no samples: no call of this rollout yielded tokens</p>')
    elif r["trajectory_id"]:
        out.append('<p class="muted">the trajectory is no longer on Kafka (past its retention)</p>')
    else:
        out.append('<p class="muted">not assembled yet</p>')
    out.append("<h2>Calls</h2>")
    previous: list[Any] = []
    for c in calls:
        body = bodies.get(c["call_id"])
        out.append(_call_section(ui, c, body if isinstance(body, ModelCallV1) else None, previous,
                                 breaks.get(c["call_id"]), errors))
        if isinstance(body, ModelCallV1):
            previous = list(body.request.messages)
    return page(f"Rollout {rollout_id}", "".join(out))


def _whole_bodies(stored: Sequence[object]) -> dict[str, ModelCallV1]:
    """The rollout's call events by call id, whole (read in produce order; one that does not resolve as stored)."""
    calls = WholeCalls()
    bodies: dict[str, ModelCallV1] = {}
    for event in stored:
        if isinstance(event, ModelCallV1):
            try:
                bodies[event.call_id] = calls.whole(event)
            except UnresolvedPrefixError:
                bodies[event.call_id] = event
    return bodies


def _timeline(r: sqlite3.Row, lifecycle: Sequence[sqlite3.Row], calls: Sequence[sqlite3.Row]) -> str:
    items: list[tuple[float, str]] = []
    for e in lifecycle:
        exits = [f"{who} exit {e[key]}" for who, key in (("harness", "harness_exit"), ("verifier", "verifier_exit"))
                 if e[key] is not None]
        detail = " · ".join(x for x in (e["reason"], *exits, e["message"]) if x)
        items.append((float(e["at"]), f"<b>{esc(e['phase'])}</b> <span class=muted>{esc(detail)}</span>"))
    for c in calls:
        status = "" if c["status"] == "ok" else f' <span class="bad">{esc(c["status"])}</span>'
        items.append((float(c["started_at"]), f'call {link("#call-" + c["call_id"], c["call_id"][:12])}{status} '
                                              f'<span class=muted>{fmt_int(c["prompt_tokens"])} + '
                                              f'{fmt_int(c["completion_tokens"])} tokens, '
                                              f'{fmt_float(c["total_s"], 2)} s'
                                              "</span>"))
    if r["reward_at"] is not None:
        items.append((float(r["reward_at"]), f"<b>reward</b> {fmt_float(r['reward'], 4)}"))
    if r["finalized_at"] is not None:
        items.append((float(r["finalized_at"]), f"<b>trajectory</b> <span class=muted>{esc(r['finalize_reason'])}"
                                                "</span>"))
    items.sort(key=lambda item: item[0])
    start = items[0][0] if items else 0.0
    return '<div class="timeline" id="timeline">' + "".join(
        f"<div><span class=muted>+{t - start:7.2f}s</span> {html}</div>" for t, html in items) + "</div>"


def _call_section(ui: UIState, c: sqlite3.Row, body: ModelCallV1 | None, previous: list[Any],
                  brk: sqlite3.Row | None, errors: Mapping[str, sqlite3.Row]) -> str:
    trace = ""
    if c["trace_id"]:
        trace = (f' · trace {link(ui.settings.trace_url.format(trace_id=c["trace_id"]), c["trace_id"])}'
                 if ui.settings.trace_url else f" · trace <code>{esc(c['trace_id'])}</code>")
    retry = f' · retry {c["attempt"]} of {link("#call-" + c["retry_of"], c["retry_of"][:12])}' if c["retry_of"] else ""
    head = (f'<h3 id="call-{esc(c["call_id"])}">call {esc(c["call_id"])}</h3><p class="muted">'
            f'{fmt_time(c["started_at"])} · {esc(c["protocol"])} · {esc(c["status"])}'
            f'{" (" + esc(c["error"]) + ")" if c["error"] else ""} · {fmt_int(c["prompt_tokens"])} prompt + '
            f'{fmt_int(c["completion_tokens"])} sampled tokens · finish {esc(c["finish_reason"])} · '
            f'version {esc(c["versions"] or "unknown")} · {fmt_float(c["total_s"], 2)} s{retry}{trace}</p>')
    if brk is not None:
        head += (f'<div class="breakmark">merge break: <b>{esc(brk["reason"] or "unknown")}</b>; its prompt matched '
                 f"{fmt_int(brk['common_prefix'])} of the {fmt_int(brk['context_tokens'])} tokens before it, so it "
                 f"starts sample {brk['sample_index']}</div>")
    if body is None:
        return head + '<p class="muted">the call event is no longer on Kafka</p>'
    messages = list(body.request.messages)
    skip = len(previous) if messages[:len(previous)] == previous and previous else 0
    shown = messages[skip:]
    earlier = ""
    if skip:
        earlier = f'<p class="muted">{skip} earlier messages as in the call before</p>'
    elif previous:
        earlier = '<p class="muted">the history differs from the call before: every message is shown</p>'
    reply = _reply(body)
    parts = [head, earlier, *(_message(m, errors) for m in shown)]
    if reply is not None:
        parts.append('<div class="muted">answer:</div>' + _message(reply, errors))
    tools = body.request.tools
    if tools:
        parts.append(f"<details><summary>{len(tools)} tools offered</summary><pre class=block>"
                     f"{esc(orjson.dumps(tools, option=orjson.OPT_INDENT_2).decode())}</pre></details>")
    return "".join(parts)


def _reply(call: ModelCallV1) -> Mapping[str, Any] | None:
    from consumers.assembler.drift import reply_message

    return reply_message(call)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "[" + str(p.get("type")) + "]")) if isinstance(p, Mapping) else str(p)
                         for p in content)
    return orjson.dumps(content).decode()


def _message(message: Any, errors: Mapping[str, sqlite3.Row]) -> str:
    if not isinstance(message, Mapping):
        return f'<div class="msg"><pre>{esc(message)}</pre></div>'
    role = str(message.get("role") or "?")
    tool_call_id = str(message.get("tool_call_id") or "")
    error = errors.get(tool_call_id) if tool_call_id else None
    label = role + (f" · {tool_call_id}" if tool_call_id else "")
    if error is not None:
        label += (f" · error ({error['rule']}), " + ("recovered" if error["recovered"] else "not recovered"))
    parts = [f'<div class="msg{" tool-error" if error is not None else ""}"><div class="role">{esc(label)}</div>']
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        parts.append(f"<details><summary>reasoning</summary><pre>{esc(_text(reasoning))}</pre></details>")
    text = _text(message.get("content"))
    if text:
        parts.append(f"<pre>{esc(text)}</pre>")
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            parts.append(f'<div>tool call <b>{esc(function.get("name"))}</b> <span class=muted>{esc(call.get("id"))}'
                         f'</span><pre>{esc(function.get("arguments"))}</pre></div>')
    parts.append("</div>")
    return "".join(parts)


# -- token view -------------------------------------------------------------------------------------------


@router.get("/rollouts/{rollout_id}/tokens")
async def tokens_page(request: Request, rollout_id: str, sample: int = 0, colour: str = "mask",
                      start: int = 0) -> Response:
    """One sample's tokens, coloured by mask, origin, behaviour logprob or weight version; breaks marked."""
    ui = _state(request)
    r = ui.index.row("SELECT reward, traj_topic, traj_partition, traj_offset FROM rollouts WHERE rollout_id = ?",
                     (rollout_id,))
    if r is None or r["traj_topic"] is None:
        return page("Not found", f"<h1>No trajectory for rollout {esc(rollout_id)}</h1>", status_code=404)
    position = (r["traj_topic"], r["traj_partition"], r["traj_offset"])
    trajectory = (await ui.reader.read([position])).get(position)
    if not isinstance(trajectory, TrajectoryV1):
        return page("Gone", "<h1>The trajectory is no longer on Kafka</h1>", status_code=410)
    if not 0 <= sample < len(trajectory.samples):
        return page("Not found", f"<h1>Rollout {esc(rollout_id)} has no sample {sample}</h1>", status_code=404)
    colouring = colour if colour in COLOURINGS else "mask"
    s = trajectory.samples[sample]
    calls = {c["call_id"]: c for c in ui.index.rows(
        f"SELECT call_id, prompt_tokens, completion_tokens FROM calls WHERE call_id IN "
        f"({','.join('?' * len(s.call_ids))})", list(s.call_ids))}
    spans = call_spans(len(s.prompt_ids), [(cid, int(calls[cid]["prompt_tokens"]) if cid in calls else 0,
                                            int(calls[cid]["completion_tokens"]) if cid in calls else 0)
                                           for cid in s.call_ids])
    brk = next((b for b in trajectory.merge_breaks if b.sample_index == sample), None)
    path = f"/rollouts/{rollout_id}/tokens"
    switch = " · ".join(
        f"<b>{c}</b>" if c == colouring else link(query(path, {"sample": sample, "colour": c}), c) for c in COLOURINGS)
    samples_nav = " · ".join(
        f"<b>sample {k}</b>" if k == sample else link(query(path, {"sample": k, "colour": colouring}), f"sample {k}")
        for k in range(len(trajectory.samples)))
    out = [f'<h1>Tokens of {link(f"/rollouts/{rollout_id}", rollout_id)}, sample {sample}</h1>',
           f'<p>reward <b id="reward">{fmt_float(trajectory.reward, 4)}</b> · '
           f'<span id="token-count" data-completion="{len(s.completion_ids)}" data-prompt="{len(s.prompt_ids)}">'
           f"{fmt_int(len(s.prompt_ids))} prompt + {fmt_int(len(s.completion_ids))} completion tokens</span> · "
           f'<span id="trained-count" data-trained="{s.trained_tokens}">{fmt_int(s.trained_tokens)} trained</span> · '
           f"{len(s.call_ids)} calls</p>",
           f"<p>{samples_nav}</p><p>colour by: {switch}</p>"]
    if brk is not None:
        out.append(f'<div class="breakmark" id="break">merge break before call '
                   f'{link(f"/rollouts/{rollout_id}#call-{brk.call_id}", brk.call_id)}: drift reason '
                   f'<b id="drift-reason">{esc(brk.reason.value if brk.reason else "unknown")}</b>; its prompt kept '
                   f"{fmt_int(brk.common_prefix_tokens)} of the {fmt_int(brk.context_tokens)} tokens before it "
                   f"(outlined in the prompt below: where it left them)</div>")
    out.append(page_links(path, {"sample": str(sample), "colour": colouring}, start, len(s.completion_ids)))
    out.append(render_sample(s, colouring=colouring, spans=spans, text_of=ui.text_of, start=max(start, 0),
                             diverged_from=brk.common_prefix_tokens if brk is not None else None,
                             call_link=lambda cid: f"/rollouts/{rollout_id}#call-{cid}"))
    return page(f"Tokens of {rollout_id}", "".join(out))


# -- calls and traces (links in from dashboards) -----------------------------------------------------------


@router.get("/calls/{call_id}")
async def call_redirect(request: Request, call_id: str) -> Response:
    """The rollout page at this call."""
    row = _state(request).index.row("SELECT rollout_id FROM calls WHERE call_id = ?", (call_id,))
    if row is None:
        return page("Not found", f"<h1>No call {esc(call_id)}</h1>", status_code=404)
    return RedirectResponse(f"/rollouts/{row['rollout_id']}#call-{call_id}", status_code=307)


@router.get("/traces/{trace_id}")
async def trace_redirect(request: Request, trace_id: str) -> Response:
    """The rollout page at the call this trace started from."""
    row = _state(request).index.row("SELECT rollout_id, call_id FROM calls WHERE trace_id = ?", (trace_id.lower(),))
    if row is None:
        return page("Not found", f"<h1>No call with trace {esc(trace_id)}</h1>", status_code=404)
    return RedirectResponse(f"/rollouts/{row['rollout_id']}#call-{row['call_id']}", status_code=307)


# -- learner steps ----------------------------------------------------------------------------------------


@router.get("/steps")
async def steps_page(request: Request, before: float | None = None) -> Response:
    """Learner steps, newest first."""
    ui = _state(request)
    rows = ui.index.rows("SELECT model, step, version, at, duration_s, trajectories, dropped, reward_mean, loss, "
                         "staleness_mean, metrics FROM steps WHERE at < ? ORDER BY at DESC LIMIT ?",
                         (before if before is not None else math.inf, _PAGE_ROWS + 1))
    more = len(rows) > _PAGE_ROWS
    rows = rows[:_PAGE_ROWS]
    lines = []
    for s in rows:
        metrics = orjson.loads(s["metrics"] or "{}")
        lines.append([link(f"/steps/{s['model']}/{s['step']}", f"{s['model']} step {s['step']}"), fmt_int(s["version"]),
                      fmt_time(s["at"]), fmt_int(s["trajectories"]), fmt_int(s["dropped"]), fmt_float(s["reward_mean"]),
                      fmt_float(s["loss"], 4), fmt_float(metrics.get("rollout_corr/kl"), 5),
                      fmt_float(s["staleness_mean"], 2), fmt_float(s["duration_s"], 2)])
    body = ["<h1>Learner steps</h1>", table(
        ["step", "version", "at", "trajectories", "dropped", "reward", "loss", "KL(behaviour‖learner)", "staleness",
         "seconds"], lines, numeric=(1, 3, 4, 5, 6, 7, 8, 9), attrs='id="steps"')]
    if not rows:
        body.append('<p class="muted">no learner step recorded yet</p>')
    if more:
        body.append('<nav class="pager">' + link(query("/steps", {"before": rows[-1]["at"]}), "older") + "</nav>")
    return page("Learner steps", "".join(body))


_MISMATCH_KEYS = (
    ("rollout_corr/kl", "KL(behaviour ‖ learner), per token"),
    ("rollout_corr/k3_kl", "K3 estimate of the KL"),
    ("rollout_corr/log_ppl_diff", "log-perplexity difference (learner minus behaviour)"),
    ("rollout_corr/log_ppl_abs_diff", "absolute log-perplexity difference"),
    ("rollout_corr/ppl_ratio", "perplexity ratio"),
    ("rollout_corr/chi2_token", "χ² per token"),
    ("is_weight_mean", "importance weight mean"),
    ("is_weight_min", "importance weight min"),
    ("is_weight_max", "importance weight max"),
    ("is_ess", "effective sample size (share of tokens)"),
)


@router.get("/steps/{model}/{step}")
async def step_page(request: Request, model: str, step: int) -> Response:
    """One learner step: the trajectories it trained on by group, advantages, importance weights, mismatch."""
    ui = _state(request)
    s = ui.index.row("SELECT * FROM steps WHERE model = ? AND step = ?", (model, step))
    if s is None:
        return page("Not found", f"<h1>No step {step} of {esc(model)}</h1>", status_code=404)
    metrics: dict[str, float] = orjson.loads(s["metrics"] or "{}")
    weights: list[float] = orjson.loads(s["weights"] or "[]")
    members = ui.index.rows("SELECT * FROM step_rollouts WHERE model = ? AND step = ? ORDER BY task_id, group_index",
                            (model, step))
    nav = " · ".join(link(f"/steps/{model}/{n}", label) for n, label in ((step - 1, "previous step"),
                                                                         (step + 1, "next step")) if n >= 1)
    out = [f"<h1>{esc(model)} step {step}</h1>", f"<p>{nav}</p>",
           f'<p>version {fmt_int(s["version"])} · {fmt_time(s["at"])} · {fmt_float(s["duration_s"], 2)} s · '
           f'{fmt_int(s["trajectories"])} trajectories trained, {fmt_int(s["dropped"])} left out</p>']
    main = [(k, metrics[k]) for k in ("loss", "entropy", "grad_norm", "reward_mean", "staleness_mean", "staleness_max",
                                      "updates", "entropy_coeff") if k in metrics]
    out.append('<div class="charts"><div class="chart"><h3>Metrics</h3>'
               + table(["metric", "value"], [[esc(k), fmt_float(v, 5)] for k, v in main], numeric=(1,)) + "</div>")
    mismatch = [(label, metrics[k]) for k, label in _MISMATCH_KEYS if k in metrics]
    out.append('<div class="chart" id="mismatch"><h3>Behaviour against learner logprobs, as the step measured them</h3>'
               + (table(["measure", "value"], [[esc(k), fmt_float(v, 5)] for k, v in mismatch], numeric=(1,))
                  if mismatch else '<p class="muted">no rollout correction measured</p>') + "</div>")
    out.append('<div class="chart" id="weights"><h3>Importance weights (quantile sample; dashed: 1)</h3>'
               + histogram(weights, marker=1.0) + "</div></div>")
    groups: dict[str, list[sqlite3.Row]] = {}
    for m in members:
        groups.setdefault(m["task_id"] or "", []).append(m)
    out.append("<h2>Groups</h2>")
    rows: list[list[str]] = []
    for task, group in groups.items():
        trained = [g for g in group if g["dropped"] is None]
        rewards = [float(g["reward"]) for g in trained if g["reward"] is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        rows.extend([link(query("/rollouts", {"task": task}), task), link(f"/rollouts/{g['rollout_id']}",
                                                                          g["rollout_id"]),
                     fmt_int(g["group_index"]), fmt_float(g["reward"]), fmt_float(mean),
                     fmt_float(g["advantage"], 4), fmt_int(g["trained_tokens"]),
                     # Versions behind the weights the step trained: the step produced ``version``.
                     "" if g["oldest_version"] is None or s["version"] is None
                     else fmt_int(int(s["version"]) - 1 - int(g["oldest_version"])),
                     f'<span class="warn">{esc(g["dropped"])}</span>' if g["dropped"] else "trained"] for g in group)
    out.append(table(["task (group)", "rollout", "index", "reward", "group mean", "advantage", "trained tokens",
                      "staleness", "used"], rows, numeric=(2, 3, 4, 5, 6, 7), attrs='id="step-members"'))
    return page(f"{model} step {step}", "".join(out))


# -- the harness report ------------------------------------------------------------------------------------


@router.get("/report/harnesses")
async def report_page(request: Request, run: str | None = None, since: float | None = None,
                      until: float | None = None, format: str = "html") -> Response:
    """How trainable each harness is: merge rate and drift reasons, failures, reward, error recovery."""
    ui = _state(request)
    rows = harness_report(ui.index, Scope(run or None, since, until))
    if format == "json":
        return JSONResponse([asdict(r) for r in rows])
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"
    lines = [[link(query("/rollouts", {"harness": r.harness, "run": run}), r.harness), fmt_int(r.rollouts),
              f"{r.calls_per_rollout:.1f}", f'<span class="merge-rate">{pct(r.merge_rate)}</span> '
              f"({r.merged}/{r.merged + r.breaks})",
              "".join(link(query("/rollouts", {"harness": r.harness, "drift": k, "run": run}), f"{k} {v}",
                           class_="tag break") for k, v in r.drift_reasons.items()) or "-",
              f"{r.parse_failures} / {r.tool_calls}", fmt_int(r.retries), pct(r.infrastructure_share),
              fmt_float(r.mean_reward), f"{r.tool_errors} / {r.tool_results}",
              f"{pct(r.recovery_rate)} ({r.recovered})"] for r in rows]
    form = ('<form class="filters" method="get"><label>run<input name="run" value="' + esc(run or "") + '"></label>'
            '<button type="submit">show</button> ' + link(query("/report/harnesses", {"run": run, "format": "json"}),
                                                          "JSON") + "</form>")
    body = ["<h1>Harness report</h1>", form, table(
        ["harness", "rollouts", "calls per rollout", "merge rate", "drift reasons", "parse failures / tool calls",
         "retries", "infrastructure failures", "mean reward", "tool errors / results", "errors recovered"], lines,
        numeric=(1, 2, 6, 8), attrs='id="harness-report"'),
        '<p class="muted">Merge rate: calls whose prompt extended the rollout\'s earlier context token for token, over '
        "all that could have (each break starts a new sample). Error recovery: tool errors after which a later call "
        "of the same tool succeeded.</p>"]
    if not rows:
        body.append('<p class="muted">no finished rollouts in scope</p>')
    return page("Harness report", "".join(body))
