"""The proxy benchmark's results as one figure: what the table says, where the noise is visible.

``python -m bench.proxy --plot PATH`` draws it after a run; ``python -m bench.proxy_plot
results.json PATH`` draws it again from a run's ``--json``. Four panels:

* **throughput**: requests/s per concurrency for every target, the median as a bar and every
  round as a dot (log scale: LiteLLM sits tens of times below the rest);
* **capture on / capture off**: the round-by-round ratios of the goal's paired cells, their
  median (the verdict) and the 80 % line. The spread of the dots is the machine's noise, which
  a table of medians hides;
* **added latency**: p50 and p99 over direct, whole answers and time to first token, with the
  1 ms goal;
* **CPU per call at equal load**: where each call's CPU goes with capture on and off (the proxy,
  the upstream, the broker, the load generator and the rest of the machine), and how much capture
  may cost to keep 80 %.

Drawn from the summary alone (the ``--json`` file), so an old run can be drawn again and
compared with a new one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.proxy import GOAL_CAPTURE_RATIO

_COLOURS = {
    "direct": "#7f7f7f",
    "openforge": "#1f77b4",
    "openforge-nocap": "#2ca02c",
    "litellm": "#d62728",
}

_CPU_PARTS = (
    ("proxy", "#1f77b4"),
    ("upstream", "#7f7f7f"),
    ("broker", "#ff7f0e"),
    ("load generator", "#bcbd22"),
    ("rest of the machine", "#dddddd"),
)


class PlotError(ValueError):
    """The summary cannot be drawn (not a ``bench.proxy`` summary, or nothing measured in it)."""


def _label(summary: dict[str, Any], key: str) -> str:
    labels: dict[str, str] = summary.get("targets") or {}
    return labels.get(key, key)


def _colour(key: str) -> str:
    return _COLOURS.get(key, "#8c564b")


def cpu_parts(row: dict[str, float]) -> list[float]:
    """A target's CPU µs per call at equal load, split as in ``_CPU_PARTS`` (none negative).

    The machine's figure counts every process and the kernel; what the named processes do not
    account for is the rest. Noise can make the named parts add to more than the machine's
    figure, so the rest is never drawn below zero.
    """
    named = [row["server_cpu_us"], row["upstream_cpu_us"], row["broker_cpu_us"], row["client_cpu_us"]]
    machine = row.get("machine_cpu_us", math.nan)
    rest = machine - sum(named) if isinstance(machine, int | float) and math.isfinite(machine) else 0.0
    return [max(part, 0.0) for part in [*named, rest]]


def _throughput(ax: Any, summary: dict[str, Any]) -> None:
    throughput: dict[str, dict[str, Any]] = summary["throughput"]
    keys = list(throughput)
    concurrencies = sorted({int(c) for per_c in throughput.values() for c in per_c})
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        for j, c in enumerate(concurrencies):
            cell = throughput[key].get(str(c))
            if not cell:
                continue
            x = j + (i - (len(keys) - 1) / 2) * width
            ax.bar(x, cell["rps_median"], width * 0.9, color=_colour(key), alpha=0.85,
                   label=_label(summary, key) if j == 0 else None)
            rounds = cell.get("rps_rounds") or []
            ax.plot([x] * len(rounds), rounds, ".", color="black", markersize=3, alpha=0.6)
    ax.set_xticks(range(len(concurrencies)), [f"{c} connection{'s' if c != 1 else ''}" for c in concurrencies])
    ax.set_yscale("log")
    highest = max((max([cell["rps_median"], *(cell.get("rps_rounds") or [])]) for per_c in throughput.values()
                   for cell in per_c.values()), default=1.0)
    ax.set_ylim(top=highest * 12)  # room for the legend above the bars
    ax.set_ylabel("requests/s (bar: median, dots: rounds)")
    ax.set_title("Throughput, closed loops")
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3, which="both")


def _capture_ratio(ax: Any, summary: dict[str, Any]) -> None:
    goals: dict[str, Any] = summary["goals"]
    capture = goals.get("capture_on_vs_off") or {}
    series = [("capture_on_vs_off", capture, "capture on / off")] if capture.get("rounds") else []
    goal = next((g["goal"] for _, g, _ in series), GOAL_CAPTURE_RATIO)
    if not series:
        ax.text(0.5, 0.5, "capture off not measured", ha="center", va="center", transform=ax.transAxes)
    concurrencies = sorted({int(c) for _, g, _ in series for c in g["rounds"]})
    offset = 0.25 if len(series) > 1 else 0.0
    for k, (_, capture, label) in enumerate(series):
        for j, c in enumerate(concurrencies):
            rounds = capture["rounds"].get(str(c)) or []
            if not rounds:
                continue
            x = j + (k - (len(series) - 1) / 2) * offset
            paired = capture["paired"][str(c)]
            met = paired >= goal
            ax.plot([x] * len(rounds), [100 * r for r in rounds], "o", color="#1f77b4", alpha=0.45,
                    markersize=5, label=f"a round ({label})" if j == 0 else None)
            ax.plot([x - 0.12, x + 0.12], [100 * paired] * 2, color="#2ca02c" if met else "#d62728", linewidth=3,
                    label=f"median, the verdict ({label})" if j == 0 else None)
            ax.annotate(f"{100 * paired:.1f} %", (x + 0.14, 100 * paired), fontsize=8, va="center")
    ax.axhline(100 * goal, color="black", linestyle="--", linewidth=1, label=f"goal {goal:.0%}")
    seen = [100 * r for _, g, _ in series for rounds in g["rounds"].values() for r in rounds]
    # 100 % (capture free) and the goal always in view, with room for the legend under the dots.
    ax.set_ylim(min([*seen, 100 * goal]) - 25, max([*seen, 100.0]) + 5)
    ax.set_xticks(range(len(concurrencies)), [f"{c} conn." for c in concurrencies])
    ax.set_ylabel("capture on / capture off, % of requests/s")
    ax.set_title("Capture's cost, round by round (paired cells)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(axis="y", alpha=0.3)


def _latency(ax: Any, summary: dict[str, Any]) -> None:
    rows = [("whole", summary.get("latency") or {}), ("TTFT", summary.get("ttft") or {})]
    names = [n for n in (summary.get("targets") or {}) if n != "direct"
             and any(n in table and "added_p50_ms" in table[n] for _, table in rows)]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        for j, (_, table) in enumerate(rows):
            row = table.get(name)
            if not row or "added_p50_ms" not in row:
                continue
            x = j + (i - (len(names) - 1) / 2) * width
            # Log scale: an added latency at or under zero (noise) is drawn at the axis's floor.
            p50, p99 = max(row["added_p50_ms"], 0.01), max(row["added_p99_ms"], 0.01)
            ax.bar(x, p50, width * 0.9, color=_colour(name), label=_label(summary, name) if j == 0 else None)
            ax.plot([x, x], [p50, max(p99, p50)], color="black", linewidth=1)
            ax.plot(x, max(p99, p50), "_", color="black", markersize=8)
    goal = (summary.get("goals") or {}).get("added_p50_ms", {}).get("goal")
    if goal:
        ax.axhline(goal, color="black", linestyle="--", linewidth=1, label=f"goal p50 <= {goal:g} ms")
    ax.set_xticks(range(len(rows)), ["whole answer", "time to first token (streamed)"])
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 6)
    ax.set_ylabel("added over direct, ms (bar: p50, whisker: p99)")
    ax.set_title("Added latency, one call at a time")
    if names:
        ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3, which="both")


def _equal_load(ax: Any, summary: dict[str, Any]) -> None:
    equal = summary.get("equal_load")
    targets = (equal or {}).get("targets") or {}
    names = [n for n in ("openforge-nocap", "openforge") if n in targets]
    if not names:
        ax.text(0.5, 0.5, "equal-load cells not run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for i, name in enumerate(names):
        bottom = 0.0
        for (part, colour), value in zip(_CPU_PARTS, cpu_parts(targets[name]), strict=True):
            ax.bar(i, value, 0.6, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5,
                   label=part if i == 0 else None)
            bottom += value
        ax.annotate(f"{targets[name]['machine_cpu_us']:,.0f}", (i, bottom), ha="center", va="bottom", fontsize=8)
    off = targets.get("openforge-nocap")
    goal = (summary.get("goals") or {}).get("capture_on_vs_off", {}).get("goal", GOAL_CAPTURE_RATIO)
    if off and math.isfinite(off.get("machine_cpu_us", math.nan)):
        allowance = off["machine_cpu_us"] / goal
        ax.axhline(allowance, color="black", linestyle="--", linewidth=1,
                   label=f"capture off / {goal:.0%}: the most a call may cost")
    ax.set_xticks(range(len(names)), [_label(summary, n).replace(", ", "\n") for n in names], fontsize=7)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.5)  # room for the legend above the bars
    ax.set_ylabel("CPU µs per call (the whole machine)")
    ax.set_title(f"Where a call's CPU goes, at {equal['offered_rps']:,.0f} req/s each")  # type: ignore[index]
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.grid(axis="y", alpha=0.3)


def write_plot(summary: dict[str, Any], path: Path) -> None:
    """Draw ``summary`` (what ``bench.proxy`` returns, or its ``--json`` file read back) to ``path``.

    The format follows the suffix (``.png``, ``.svg``, ``.pdf``).

    Raises:
        PlotError: the summary is not a proxy benchmark's, or has no throughput cell.
    """
    if not isinstance(summary, dict) or not isinstance(summary.get("throughput"), dict) \
            or not isinstance(summary.get("goals"), dict):
        raise PlotError("not a proxy benchmark summary (no 'throughput' and 'goals'): "
                        "draw what `python -m bench.proxy --json PATH` wrote")
    if not any(summary["throughput"].values()):
        raise PlotError("the summary holds no throughput cell to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # SVG text stays text (searchable, and the page's font), not outlines.
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        _draw(plt, summary, path)


def _draw(plt: Any, summary: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=100)
    try:
        _throughput(axes[0][0], summary)
        _capture_ratio(axes[0][1], summary)
        _latency(axes[1][0], summary)
        _equal_load(axes[1][1], summary)
        config = summary.get("config") or {}
        fig.suptitle(f"OpenForge proxy benchmark: {config.get('prompt_tokens', '?')} prompt / "
                     f"{config.get('completion_tokens', '?')} completion tokens per call, "
                     f"{config.get('rounds', '?')} rounds, {config.get('cpus', '?')} CPUs shared by every process",
                     fontsize=11)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.proxy_plot results.json out.png``."""
    parser = argparse.ArgumentParser(prog="python -m bench.proxy_plot",
                                     description="Draw a proxy benchmark run's --json results.")
    parser.add_argument("results", type=Path, help="what `python -m bench.proxy --json PATH` wrote")
    parser.add_argument("out", type=Path, help="the figure to write (.png, .svg or .pdf)")
    args = parser.parse_args(argv)
    try:
        summary = json.loads(args.results.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        print(f"error: cannot read {args.results}: {exc}", file=sys.stderr)
        return 2
    try:
        write_plot(summary, args.out)
    except PlotError as exc:
        print(f"error: {args.results}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["PlotError", "cpu_parts", "main", "write_plot"]
