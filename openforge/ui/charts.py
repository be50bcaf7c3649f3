"""Inline SVG charts: lines with linked points, step lines, histograms. No script, no library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from openforge.ui.html import esc

__all__ = ["Series", "histogram", "line_chart"]

_PALETTE = ("#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b83280", "#2c7a7b", "#975a16", "#4a5568")


@dataclass
class Series:
    """One line: points ``(x, y)``, optionally each with a link and a tooltip."""

    label: str
    points: list[tuple[float, float]]
    links: list[str] = field(default_factory=list)
    tips: list[str] = field(default_factory=list)
    colour: str | None = None
    dots: bool = True


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.ceil(low / step) * step
    out = []
    value = start
    while value <= high + step * 1e-9:
        out.append(round(value, 10))
        value += step
    return out


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.2g}" if abs(value) < 0.01 \
        else f"{value:.2f}".rstrip("0").rstrip(".")


def line_chart(series: Sequence[Series], *, width: int = 560, height: int = 200, x_time: bool = True,
               y_range: tuple[float, float] | None = None, element_id: str = "") -> str:
    """Lines over a shared x axis (seconds since the first point when ``x_time``); linked points are clickable."""
    points = [p for s in series for p in s.points]
    if not points:
        return '<p class="muted">no data yet</p>'
    left, right, top, bottom = 46, 10, 8, 22
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range is not None else (min(ys), max(ys))
    if y1 <= y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    ident = f' id="{esc(element_id)}"' if element_id else ""
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"{ident}>']
    for tick in _ticks(y0, y1):
        y = py(tick)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#edf2f7"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{esc(_fmt(tick))}</text>')
    for tick in _ticks(0, x1 - x0) if x_time else _ticks(x0, x1):
        value = x0 + tick if x_time else tick
        x = px(value)
        label = _duration(tick) if x_time else _fmt(tick)
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle">{esc(label)}</text>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" stroke="#a0aec0"/>'
                 f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#a0aec0"/>')
    for i, s in enumerate(series):
        colour = s.colour or _PALETTE[i % len(_PALETTE)]
        if len(s.points) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{path}"/>')
        if s.dots:
            for j, (x, y) in enumerate(s.points):
                tip = f"<title>{esc(s.tips[j])}</title>" if j < len(s.tips) else ""
                dot = f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.2" fill="{colour}">{tip}</circle>'
                if j < len(s.links) and s.links[j]:
                    dot = f'<a href="{esc(s.links[j])}" class="point">{dot}</a>'
                parts.append(dot)
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{s.colour or _PALETTE[i % len(_PALETTE)]}"></i>{esc(s.label)}</span>'
                     for i, s in enumerate(series))
    return "".join(parts) + f'<div class="legend">{legend}</div>'


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    if seconds >= 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.1f}s"


def histogram(values: Sequence[float], *, bins: int = 20, width: int = 420, height: int = 150,
              marker: float | None = None) -> str:
    """Bars of how many ``values`` fall in each of ``bins`` equal ranges; ``marker`` draws a reference line."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return '<p class="muted">no values</p>'
    low, high = min(finite), max(finite)
    if marker is not None:
        low, high = min(low, marker), max(high, marker)
    if high <= low:
        low, high = low - 0.5, high + 0.5
    counts = [0] * bins
    for v in finite:
        counts[min(int((v - low) / (high - low) * bins), bins - 1)] += 1
    left, bottom, top = 30, 20, 6
    plot_w, plot_h = width - left - 8, height - bottom - top
    most = max(counts)
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    bar_w = plot_w / bins
    for i, count in enumerate(counts):
        h = count / most * plot_h if most else 0
        lo = low + (high - low) * i / bins
        hi = low + (high - low) * (i + 1) / bins
        parts.append(f'<rect x="{left + i * bar_w:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 1, 1):.1f}" '
                     f'height="{h:.1f}" fill="#4299e1"><title>{esc(f"{lo:.3g} to {hi:.3g}: {count}")}</title></rect>')
    if marker is not None:
        x = left + (marker - low) / (high - low) * plot_w
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#c53030" '
                     f'stroke-dasharray="3,2"/>')
    parts.append(f'<text x="{left}" y="{height - 5}">{esc(_fmt(low))}</text>'
                 f'<text x="{width - 8}" y="{height - 5}" text-anchor="end">{esc(_fmt(high))}</text>'
                 f'<text x="{left - 4}" y="{top + 9}" text-anchor="end">{most}</text></svg>')
    return "".join(parts)
