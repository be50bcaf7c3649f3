"""Small HTML helpers for the server-rendered pages: escaping, layout, tables, formatting.

No template engine and no script: every page is plain HTML built here, so the UI installs with the
Python package alone and works with scripting off.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.responses import HTMLResponse

__all__ = ["esc", "fmt_float", "fmt_int", "fmt_time", "link", "page", "query", "table"]

_STYLE = """
:root { --fg:#1d232a; --muted:#68707a; --line:#dfe3e8; --bg:#fff; --accent:#2b6cb0; --good:#2f855a; --bad:#c53030;
        --warn:#b7791f; --trained:#c6f6d5; --context:#edf2f7; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, Segoe UI, Roboto, sans-serif; color: var(--fg); margin: 0;
       background: var(--bg); }
header { background: #1a202c; color: #fff; padding: 8px 20px; display: flex; gap: 22px; align-items: baseline; }
header a { color: #cbd5e0; text-decoration: none; } header a:hover { color: #fff; }
header .brand { font-weight: 600; color: #fff; }
main { padding: 16px 20px 40px; max-width: 1400px; }
h1 { font-size: 20px; margin: 4px 0 12px; } h2 { font-size: 16px; margin: 22px 0 8px; }
a { color: var(--accent); }
table { border-collapse: collapse; margin: 6px 0 12px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px 4px 0; text-align: left; vertical-align: top; }
th { color: var(--muted); font-weight: 500; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.muted { color: var(--muted); } .good { color: var(--good); } .bad { color: var(--bad); } .warn { color: var(--warn); }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 8px 0 16px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 130px; }
.card .v { font-size: 20px; font-weight: 600; } .card .k { color: var(--muted); font-size: 12px; }
.charts { display: flex; gap: 18px; flex-wrap: wrap; }
.chart { border: 1px solid var(--line); border-radius: 6px; padding: 6px 10px; }
.chart h3 { font-size: 13px; margin: 2px 0 4px; font-weight: 600; }
form.filters { display: flex; gap: 10px; flex-wrap: wrap; align-items: end; margin-bottom: 10px; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
form.filters input, form.filters select { font: inherit; padding: 3px 5px; min-width: 110px; }
.tag { display: inline-block; padding: 0 6px; border-radius: 9px; background: #edf2f7; font-size: 12px;
       margin-right: 3px; }
.tag.break { background: #fefcbf; } .tag.error { background: #fed7d7; } .tag.ok { background: #c6f6d5; }
.timeline { border-left: 2px solid var(--line); margin: 6px 0 10px 6px; padding-left: 12px; }
.timeline div { margin: 2px 0; }
.msg { border: 1px solid var(--line); border-radius: 5px; margin: 4px 0; padding: 4px 8px; }
.msg .role { font-size: 12px; color: var(--muted); font-weight: 600; }
.msg pre, pre.block { white-space: pre-wrap; word-break: break-word; margin: 2px 0;
       font: 12px/1.4 ui-monospace, monospace;
       max-height: 360px; overflow: auto; }
.msg.tool-error { border-color: #feb2b2; background: #fff5f5; }
details > summary { cursor: pointer; color: var(--accent); }
.tokens { font: 12px/1.9 ui-monospace, monospace; word-break: break-all; }
.tok { padding: 1px 1px; border-radius: 2px; margin-right: 1px; white-space: pre-wrap; }
.tok.m1 { background: var(--trained); } .tok.m0 { background: var(--context); color: #4a5568; }
.tok.diverged { outline: 1px solid var(--bad); }
.tok.o-sampled { background: #c6f6d5; } .tok.o-context { background: #edf2f7; } .tok.o-template { background: #e9d8fd; }
.tok.o-tool { background: #feebc8; } .tok.o-user { background: #bee3f8; } .tok.o-system { background: #e2e8f0; }
.callmark { display: inline-block; font: 11px system-ui, sans-serif; background: #2d3748; color: #fff;
            border-radius: 3px; padding: 0 5px; margin: 0 4px; }
.breakmark { border: 1px solid #ecc94b; background: #fffff0; border-radius: 5px; padding: 6px 10px; margin: 8px 0; }
.legend span { margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; border-radius: 2px; vertical-align: -2px;
            margin-right: 4px; }
nav.pager { margin: 8px 0; } nav.pager a { margin-right: 12px; }
svg text { font: 11px system-ui, sans-serif; fill: #4a5568; }
"""


def esc(value: Any) -> str:
    """``value`` as text, escaped for HTML (None as an empty string)."""
    return "" if value is None else html.escape(str(value), quote=True)


def link(href: str, text: Any, **attrs: str) -> str:
    """An ``<a>`` element; ``text`` is escaped, ``href`` too."""
    extra = "".join(f' {esc(k.rstrip("_").replace("_", "-"))}="{esc(v)}"' for k, v in attrs.items())
    return f'<a href="{esc(href)}"{extra}>{esc(text)}</a>'


def query(path: str, params: Mapping[str, Any]) -> str:
    """``path`` with the non-empty ``params`` as its query string."""
    kept = {k: v for k, v in params.items() if v is not None and v != ""}
    return f"{path}?{urlencode(kept)}" if kept else path


def fmt_time(epoch: float | None) -> str:
    """An instant as ``YYYY-MM-DD HH:MM:SS`` UTC."""
    if epoch is None:
        return ""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_float(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` decimals; empty for None or a non-finite value."""
    if value is None or not math.isfinite(value):
        return ""
    return f"{value:.{digits}f}"


def fmt_int(value: int | float | None) -> str:
    """A count with thousands separators; empty for None."""
    return "" if value is None else f"{int(value):,}"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: Sequence[int] = (),
          attrs: str = "") -> str:
    """A table; cells are HTML already (escape them with :func:`esc`); ``numeric`` columns align right."""
    nums = set(numeric)
    head = "".join(f'<th{" class=num" if i in nums else ""}>{esc(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in nums else ""}>{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table {attrs}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, body: str, *, refresh_s: int = 0, status_code: int = 200) -> HTMLResponse:
    """A whole page with the navigation bar."""
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s > 0 else ""
    nav = "".join(link(href, text) for href, text in (
        ("/", "Runs"), ("/rollouts", "Rollouts"), ("/steps", "Learner steps"), ("/report/harnesses", "Harness report")))
    document = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(title)} · OpenForge</title><style>{_STYLE}</style></head><body>"
                f'<header><span class="brand">OpenForge flight recorder</span>{nav}</header>'
                f"<main>{body}</main></body></html>")
    return HTMLResponse(document, status_code=status_code)
