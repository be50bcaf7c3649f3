"""The proxy benchmark's figure (``bench/proxy_plot.py``), drawn from a summary the benchmark's own
``summarize`` made, and refused clearly when what it is given is not one."""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
from pathlib import Path

import pytest

from bench.proxy import Cell, Results, Target, parse_args, summarize
from bench.proxy_plot import PlotError, cpu_parts, main, write_plot

NAMES = {"direct": "direct (upstream)", "openforge": "openforge, capture on",
         "openforge-nocap": "openforge, capture off", "litellm": "LiteLLM proxy"}


def _cell(rps: float, *, server_us: float = 200, machine_us: float = math.nan) -> Cell:
    return Cell(rps=rps, requests=int(rps), errors=0, server_cpu_us=server_us, upstream_cpu_us=30, broker_cpu_us=10,
                client_cpu_us=20, machine_cpu_us=machine_us)


def _summary(args: argparse.Namespace) -> dict[str, object]:
    targets = [Target(name, label, i, lambda _r: None) for i, (name, label) in enumerate(NAMES.items())]
    rounds = {"direct": [9000, 9500], "openforge": [3000, 3300], "openforge-nocap": [4000, 4000],
              "litellm": [90, 100]}
    cells = {name: {c: [_cell(r * (1 + c / 64)) for r in rps] for c in args.concurrency}
             for name, rps in rounds.items()}
    latency = {"direct": [0.2] * 20, "openforge": [1.1] * 20, "openforge-nocap": [0.8] * 20, "litellm": [12.0] * 20}
    paced = {"openforge": [_cell(1000, server_us=300, machine_us=420)],
             "openforge-nocap": [_cell(1000, server_us=220, machine_us=300)]}
    return summarize(targets, Results(latency, latency, cells, 1000.0, paced), args)


def test_the_figure_shows_the_verdicts_and_goals(tmp_path: Path) -> None:
    """Every panel is drawn from the summary: the paired medians, both goals and the equal-load bars."""
    args = parse_args(["--concurrency", "1,16"])
    summary = _summary(args)
    out = tmp_path / "proxy.svg"
    write_plot(summary, out)
    text = out.read_text()
    # The paired ratio of each concurrency (3000/4000 and 3300/4000 -> median 78.8 %), as annotated.
    assert text.count("78.8 %") == 2
    assert "goal 80%" in text
    assert "goal p50 &lt;= 1 ms" in text
    assert "the most a call may cost" in text
    for label in NAMES.values():
        assert label in text
    assert "1,000 req/s each" in text


def test_a_png_is_drawn_from_the_json_file_again(tmp_path: Path) -> None:
    """``--json`` then ``python -m bench.proxy_plot``: the file as the benchmark writes it."""
    summary = _summary(parse_args(["--concurrency", "1,16,64"]))
    results = tmp_path / "run.json"
    results.write_text(json.dumps(summary, indent=2) + "\n")
    out = tmp_path / "figs" / "proxy.png"
    assert main([str(results), str(out)]) == 0
    head = out.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (1300, 900)


def test_a_run_without_capture_off_or_equal_load_still_draws(tmp_path: Path) -> None:
    """What a run left out is said in its panel, not a crash."""
    args = parse_args(["--concurrency", "16"])
    summary = _summary(args)
    for table in (summary["throughput"], summary["latency"], summary["ttft"]):
        del table["openforge-nocap"]  # type: ignore[attr-defined]
    summary["goals"]["capture_on_vs_off"] = {"goal": 0.8, "ratios": {}, "rounds": {}, "paired": {},  # type: ignore[index]
                                             "met": None}
    summary["equal_load"] = None
    out = tmp_path / "partial.svg"
    write_plot(summary, out)
    text = out.read_text()
    assert "capture off not measured" in text
    assert "equal-load cells not run" in text


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot read"),
    ('{"rows": []}', "not a proxy benchmark summary"),
    ('{"throughput": {}, "goals": {}}', "no throughput cell"),
])
def test_what_is_not_a_summary_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   content: str, message: str) -> None:
    results = tmp_path / "run.json"
    results.write_text(content)
    out = tmp_path / "out.png"
    assert main([str(results), str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_file_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nowhere.json"), str(tmp_path / "out.png")]) == 2
    assert re.search(r"cannot read .*nowhere\.json", capsys.readouterr().err)


def test_write_plot_refuses_a_list() -> None:
    with pytest.raises(PlotError, match="not a proxy benchmark summary"):
        write_plot([], Path("unused.png"))  # type: ignore[arg-type]


def test_cpu_parts_split_the_machine_and_never_go_negative() -> None:
    row = {"server_cpu_us": 260.0, "upstream_cpu_us": 30.0, "broker_cpu_us": 10.0, "client_cpu_us": 20.0,
           "machine_cpu_us": 400.0}
    assert cpu_parts(row) == [260.0, 30.0, 10.0, 20.0, 80.0]
    assert sum(cpu_parts(row)) == 400.0
    # Noise: the named parts add to more than the machine's figure.
    noisy = {**row, "machine_cpu_us": 250.0}
    assert cpu_parts(noisy) == [260.0, 30.0, 10.0, 20.0, 0.0]
    assert cpu_parts({**row, "machine_cpu_us": math.nan})[-1] == 0.0
