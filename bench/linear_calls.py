"""Bytes on the calls topic per conversation: calls stored whole against calls stored linearly.

Run from the repository root with ``python -m bench.linear_calls``.

Each conversation is a harness's tool loop of 1, 10 and 30 turns, recorded through the proxy's own
path: the call's capture (its request as the engine got it, the engine's answer with prompt ids,
sampled ids and logprobs), the reference the proxy's record step takes from the rollout's token
history (``proxy.continuation.prefix.refer``), the journal record (``pack_raw_call``) and the
shipper's conversion into the record that goes to the calls topic (``ship_record``). Every call is
shipped twice from the same capture: without a reference (**whole**, what every call stored before)
and with it (**linear**). The figure is the uncompressed record value in bytes, as sent to Kafka.

The conversation: a system prompt and tools of ``--system-tokens`` ids (with as many characters
of text per id as ``--chars-per-token``), then per turn a sampled answer of ``--sampled-tokens``
ids and a tool result of ``--tool-tokens`` ids, with their text in the messages the harness sends
back. Two ways a prompt continues the context:

* **extends**: the prompt is the previous prompt, the sampled ids and the new ids (continuation
  mode, or a template that writes the sampled turn back as sampled);
* **forks**: the template re-spells the last ``--respelled`` sampled ids of each turn (chat mode's
  usual break: a tool call's spelling, the end-of-turn token), so the prompt shares all but those.

The goal is linear is at least 10 times smaller than whole at 30 turns, and the linear bytes of a
call do not grow with the turn.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Any

from producers.capture import CallCapture, normalize_request
from producers.raw_calls import pack_raw_call, ship_record
from proxy.continuation.history import RolloutHistory
from proxy.continuation.prefix import refer
from schemas.call.v1 import ApiProtocol, CallStatus
from stream import CALLS, KafkaSettings, TopicRegistry

REGISTRY = TopicRegistry.from_settings(KafkaSettings(topic_prefix="bench."))
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} a file or a directory of the workspace.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name in ("read", "write", "list", "search", "run")]


@dataclass(frozen=True)
class Shape:
    """The conversation's sizes."""

    system_tokens: int
    sampled_tokens: int
    tool_tokens: int
    respelled: int
    chars_per_token: int


@dataclass
class Result:
    """One conversation's bytes on the calls topic."""

    turns: int
    mode: str
    whole: int
    linear: int
    last_whole: int
    last_linear: int


def _text(rng: random.Random, tokens: int, chars_per_token: int) -> str:
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(tokens * chars_per_token))


def _ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(count)]


def _shipped(capture: CallCapture) -> int:
    topic, key, value, headers = pack_raw_call(capture, CallStatus.OK, upstream_status_code=200)
    out_topic, _, out_value, _ = ship_record(REGISTRY, topic, key, value, headers, seq=0)
    if out_topic != REGISTRY[CALLS].name:
        raise RuntimeError(f"the shipper made no call event of turn {capture.call_id}: {out_value[:300]!r}")
    return len(out_value)


def conversation(turns: int, mode: str, shape: Shape, seed: int) -> Result:
    """Record one conversation both ways and count the bytes."""
    rng = random.Random(seed)
    history = RolloutHistory()
    messages: list[Any] = [{"role": "system", "content": _text(rng, shape.system_tokens, shape.chars_per_token)},
                           {"role": "user", "content": "Fix the failing test in the workspace."}]
    prompt = _ids(rng, shape.system_tokens + 20)
    whole = linear = last_whole = last_linear = 0
    for turn in range(turns):
        sampled = _ids(rng, shape.sampled_tokens)
        answer_text = _text(rng, shape.sampled_tokens, shape.chars_per_token)
        chat = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 512, "temperature": 1.0}
        capture = CallCapture(rollout_id="r-bench", call_id=f"c{turn}", protocol=ApiProtocol.OPENAI_CHAT, model="m",
                              request=normalize_request(chat, {}), streamed=False, task_id="t-bench")
        capture.on_response({
            "id": f"cmpl-{turn}", "model": "m", "prompt_token_ids": prompt,
            "choices": [{"index": 0, "token_ids": sampled, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": answer_text},
                         "logprobs": {"content": [{"token": "x", "logprob": -rng.random()} for _ in sampled]}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled)}})
        last_whole = _shipped(capture)
        reference = refer(history, capture.call_id, prompt, sampled, capture.request.messages, capture.request.tools)
        capture.prompt_prefix = reference.prefix
        last_linear = _shipped(capture)
        if reference.turn is not None:
            history.record(reference.turn)
        whole, linear = whole + last_whole, linear + last_linear
        # The harness sends the answer back with the tool's result; the template renders both.
        kept = sampled if mode == "extends" else sampled[:-shape.respelled] + _ids(rng, shape.respelled)
        prompt = [*prompt, *kept, *_ids(rng, shape.tool_tokens + 5)]
        messages = [*messages, {"role": "assistant", "content": answer_text},
                    {"role": "tool", "tool_call_id": f"t{turn}", "content": _text(rng, shape.tool_tokens,
                                                                                  shape.chars_per_token)}]
    return Result(turns, mode, whole, linear, last_whole, last_linear)


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 10, 30])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--sampled-tokens", type=int, default=150)
    parser.add_argument("--tool-tokens", type=int, default=400)
    parser.add_argument("--respelled", type=int, default=20)
    parser.add_argument("--chars-per-token", type=int, default=4)
    args = parser.parse_args(argv)
    shape = Shape(args.system_tokens, args.sampled_tokens, args.tool_tokens, args.respelled, args.chars_per_token)
    results = [conversation(turns, mode, shape, seed=turns) for mode in ("extends", "forks") for turns in args.turns]
    out = sys.stdout
    out.write("| turns | prompt continues | whole (bytes) | linear (bytes) | whole / linear "
              "| last call whole → linear |\n")
    out.write("|---|---|---|---|---|---|\n")
    for r in results:
        out.write(f"| {r.turns} | {r.mode} | {r.whole:,} | {r.linear:,} | {r.whole / r.linear:.1f}x | "
                  f"{r.last_whole:,} → {r.last_linear:,} |\n")
    missed = []
    for mode in ("extends", "forks"):
        rows = {r.turns: r for r in results if r.mode == mode}
        if 30 in rows and rows[30].whole / rows[30].linear < 10:
            missed.append(f"{mode}: {rows[30].whole / rows[30].linear:.1f}x at 30 turns (goal ≥ 10x)")
        if 10 in rows and 30 in rows and rows[30].last_linear > 1.1 * rows[10].last_linear:
            missed.append(f"{mode}: a call's linear bytes grew from turn 10 to 30")
    for line in missed:
        out.write(f"missed: {line}\n")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
