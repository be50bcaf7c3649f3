"""The token view of one trajectory sample: every token, coloured by what it is and where it came from.

Colourings: ``mask`` (trained against context tokens), ``origin`` (who wrote the token, from the
sample's recorded origins; a sample from before origins shows sampled against context, from the
mask), ``logprob`` (the behaviour probability of each sampled token) and ``version`` (the weight
version that sampled it). Call boundaries are
marked in the completion, and a sample that a merge break started shows where its prompt left the
earlier context, with the drift reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from openforge.ui.html import esc, fmt_int, link
from schemas import TrajectorySample

__all__ = ["COLOURINGS", "CallSpan", "call_spans", "render_sample", "token_origins"]

COLOURINGS = ("mask", "origin", "logprob", "version")
"""The colourings the view offers."""

_VERSION_COLOURS = ("#bee3f8", "#c6f6d5", "#fefcbf", "#fed7e2", "#e9d8fd", "#feebc8", "#b2f5ea", "#e2e8f0")
PAGE_TOKENS = 6000
"""Completion tokens per page of the view."""


@dataclass(frozen=True)
class CallSpan:
    """Where one merged call's tokens are in a sample's completion: the context before it, then what it sampled."""

    call_id: str
    context_start: int
    sampled_start: int
    end: int


def call_spans(prompt_len: int, calls: Sequence[tuple[str, int, int]]) -> list[CallSpan]:
    """Each merged call's span in the completion, from its prompt and completion lengths.

    Args:
        prompt_len: Length of the sample's prompt (the first call's).
        calls: ``(call_id, prompt_tokens, sampled_tokens)`` of the sample's calls, in order.
    """
    spans: list[CallSpan] = []
    position = 0
    for i, (call_id, prompt_tokens, sampled) in enumerate(calls):
        gap = 0 if i == 0 else max(prompt_tokens - (prompt_len + position), 0)
        spans.append(CallSpan(call_id, position, position + gap, position + gap + sampled))
        position += gap + sampled
    return spans


def token_origins(sample: TrajectorySample) -> list[str]:
    """Who wrote each completion token: the sample's recorded origins, or for a sample without them, the mask."""
    if not sample.origins:
        return ["sampled" if m else "context" for m in sample.loss_mask]
    prompt = len(sample.prompt_ids)
    out = ["context"] * len(sample.completion_ids)
    for span in sample.origins:
        for i in range(max(span.start, prompt), span.end):
            out[i - prompt] = span.origin.value
    return out


def _versions(sample: TrajectorySample) -> list[str | None]:
    out: list[str | None] = [None] * len(sample.completion_ids)
    for item in sample.weight_versions:
        for i in range(item.start, min(item.end, len(out))):
            out[i] = item.version
    return out


def render_sample(sample: TrajectorySample, *, colouring: str, spans: Sequence[CallSpan],
                  text_of: Callable[[int], str] | None, start: int = 0, diverged_from: int | None = None,
                  call_link: Callable[[str], str] | None = None) -> str:
    """The prompt (collapsed) and the completion as coloured token spans, from ``start`` on (one page).

    Args:
        sample: The sample.
        colouring: One of :data:`COLOURINGS`.
        spans: The merged calls' spans (:func:`call_spans`), for the call marks.
        text_of: Token id to text; None shows ids.
        start: First completion token shown.
        diverged_from: For a sample that a merge break started: the prompt tokens from here on left
            the earlier context; they are outlined.
        call_link: The href of a call's entry on the rollout page.
    """
    ids = list(sample.completion_ids)
    mask = list(sample.loss_mask)
    logprobs = list(sample.behavior_logprobs)
    origins = token_origins(sample)
    versions = _versions(sample)
    palette: dict[str, str] = {}
    for v in versions:
        if v is not None and v not in palette:
            palette[v] = _VERSION_COLOURS[len(palette) % len(_VERSION_COLOURS)]
    marks = {s.sampled_start: s.call_id for s in spans}
    context_marks = {s.context_start for s in spans[1:] if s.context_start < s.sampled_start}
    stop = min(start + PAGE_TOKENS, len(ids))
    out = []
    for i in range(start, stop):
        if i in context_marks:
            out.append('<span class="callmark ctx">context</span>')
        if i in marks:
            call_id = marks[i]
            target = call_link(call_id) if call_link else f"#call-{call_id}"
            out.append(f'<a class="callmark" href="{esc(target)}" title="sampled by call {esc(call_id)}">'
                       f"call {esc(call_id[:8])}</a>")
        out.append(_token(ids[i], mask[i], logprobs[i], versions[i], origins[i], colouring, palette, text_of))
    prompt = list(sample.prompt_ids)
    prompt_html = "".join(
        f'<span class="tok m0{" diverged" if diverged_from is not None and j >= diverged_from else ""}" '
        f'title="prompt token {j}: id {t}">{esc(text_of(t) if text_of else t)}</span>' for j, t in enumerate(prompt))
    legend = _legend(colouring, palette)
    where = "" if diverged_from is None else \
        f"; outlined from token {fmt_int(diverged_from)} on: where it left the earlier context"
    return (f'<details{" open" if diverged_from is not None else ""}><summary>prompt: {fmt_int(len(prompt))} tokens'
            f"{where}"
            f'</summary><div class="tokens" id="prompt">{prompt_html}</div></details>'
            f'<div class="legend">{legend}</div>'
            f'<div class="tokens" id="completion" data-start="{start}" data-stop="{stop}">{"".join(out)}</div>')


def _token(token: int, mask: int, logprob: float, version: str | None, origin: str, colouring: str,
           palette: dict[str, str], text_of: Callable[[int], str] | None) -> str:
    style = ""
    classes = f"tok m{mask}"
    if colouring == "origin":
        classes += f" o-{esc(origin)}"
    elif colouring == "logprob" and mask:
        p = math.exp(logprob) if logprob <= 0 else 1.0
        style = f' style="background:hsl({int(120 * p)},70%,82%)"'
    elif colouring == "version":
        style = f' style="background:{palette[version]}"' if version in palette else ' style="background:#fff"'
    tip = f"id {token} · {'trained' if mask else 'context'} · {origin}"
    if mask:
        tip += f" · logprob {logprob:.3f} · version {version or 'unknown'}"
    text = text_of(token) if text_of else str(token)
    return (f'<span class="{classes}"{style} data-id="{token}" data-m="{mask}" data-lp="{logprob:.4g}" '
            f'data-v="{esc(version or "")}" title="{esc(tip)}">{esc(text)}</span>')


def _legend(colouring: str, palette: dict[str, str]) -> str:
    if colouring == "mask":
        items = [("var(--trained)", "trained (loss mask 1)"), ("var(--context)", "context (loss mask 0)")]
    elif colouring == "origin":
        items = [("#c6f6d5", "sampled"), ("#edf2f7", "context"), ("#e9d8fd", "template"), ("#feebc8", "tool"),
                 ("#bee3f8", "user")]
    elif colouring == "logprob":
        items = [("hsl(0,70%,82%)", "p ≈ 0"), ("hsl(60,70%,82%)", "p ≈ 0.5"), ("hsl(120,70%,82%)", "p ≈ 1"),
                 ("var(--context)", "context")]
    else:
        items = [(c, f"version {v}") for v, c in palette.items()] or [("#fff", "no version recorded")]
    return "".join(f'<span><i style="background:{c}"></i>{esc(label)}</span>' for c, label in items)


def page_links(path: str, params: dict[str, str], start: int, total: int) -> str:
    """Previous/next page links of a long completion."""
    from openforge.ui.html import query

    if total <= PAGE_TOKENS:
        return ""
    parts = []
    if start > 0:
        parts.append(link(query(path, {**params, "start": str(max(start - PAGE_TOKENS, 0))}), "previous tokens"))
    if start + PAGE_TOKENS < total:
        parts.append(link(query(path, {**params, "start": str(start + PAGE_TOKENS)}), "next tokens"))
    shown = f"tokens {fmt_int(start)} to {fmt_int(min(start + PAGE_TOKENS, total))} of {fmt_int(total)}"
    return f'<nav class="pager">{shown} · {" ".join(parts)}</nav>'
