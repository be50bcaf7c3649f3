"""Continuation mode against chat mode: the latency each adds per call, on the real engine, in one run.

Run from the repository root with ``python -m bench.continuation`` (``--vllm URL`` reuses a running
vLLM started with ``--enable-scale-out``; otherwise the tiny local model is served on a free port;
``--bootstrap`` reuses a Kafka broker, otherwise a private one is started).

Two proxies, both capturing to Kafka, in front of the same engine: one in continuation mode (the
default), one forced into chat mode (``OPENFORGE_PROXY_CONTINUATION=false``). Each rollout is a
conversation of ``--turns`` turns (the model's answer, then a follow-up), sent to both proxies and
directly to the engine's chat endpoint, the three conversations advancing turn by turn in lockstep
and the order of the targets rotating call by call, so that a noisy machine disturbs them alike.
Every call asks for the same ``max_tokens`` with a fixed seed. After the first turn the modes'
prompts differ (that is the point), so their answers may too, in length as well (an answer ends
early on an end-of-sequence token): the figures compare per-call latency around similar, not
identical, engine work. Reported: p50 and p99 per call of each target, each proxy's added latency over the
direct call (the difference of the percentiles), and continuation's over chat mode's. Then, from the
calls both proxies recorded, each mode's trainable tokens per rollout: the assembler builds the
rollout's training samples (:func:`~consumers.assembler.samples.build_samples`), and the figure is
the loss-mask size of its largest sample, against the tokens the rollout sampled in all; a turn
whose prompt does not extend the one before starts a new sample, so its tokens are not trained in
the same sequence as the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.broker import private_broker
from bench.proxy import Process, openforge_env, pct, progress
from consumers.assembler.samples import build_samples
from schemas import ModelCallV1
from schemas.call.linear import WholeCalls
from schemas.credentials import Role, mint_token
from stream import CALLS, TopicRegistry
from stream.admin import KafkaAdmin
from stream.broker import free_port
from stream.settings import KafkaSettings
from stream.tooling import read_topic

GOAL_ADDED_OVER_CHAT_MS = 2.0
"""Continuation's added p50 per call may exceed chat mode's by at most this."""

TARGETS = ("direct", "chat", "continuation")
FOLLOW_UPS = ("Tell me more.", "Why is that?", "And then?", "Go on.", "What next?")


class _Conversation:
    """One rollout's conversation with one target: the messages so far."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self.headers = {**headers, "content-type": "application/json"}
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a story about a lighthouse."}]

    async def turn(self, client: httpx.AsyncClient, model: str, turn: int, max_tokens: int, seed: int) -> float:
        """Send the next call; the seconds it took."""
        body = orjson.dumps({"model": model, "messages": self.messages, "max_tokens": max_tokens, "seed": seed})
        started = time.perf_counter()
        answer = await client.post(self.url, content=body, headers=self.headers)
        took = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"{self.url} answered {answer.status_code}: {answer.text[:500]}")
        content = answer.json()["choices"][0]["message"].get("content") or ""
        self.messages += [{"role": "assistant", "content": content},
                          {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
        return took


async def measure(engine_url: str, ports: dict[str, int], key: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Latencies per target over ``args.rollouts`` rollouts (after ``args.warmup`` unrecorded ones).

    The three targets' conversations of a rollout advance in lockstep, turn by turn, the order of
    the targets rotating call by call, so that the machine's load disturbs them alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in TARGETS}
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{engine_url}/v1/models")).json()["data"][0]["id"]
        rotation = 0
        for index in range(args.warmup + args.rollouts):
            conversations: dict[str, _Conversation] = {}
            for name in TARGETS:
                rollout = f"bench-{index}-{name}"
                if name == "direct":
                    conversations[name] = _Conversation(f"{engine_url}/v1/chat/completions", {})
                else:
                    token = mint_token(key.encode(), rollout, Role.AGENT, 3600.0)
                    conversations[name] = _Conversation(
                        f"http://127.0.0.1:{ports[name]}/rollouts/{rollout}/v1/chat/completions",
                        {"authorization": f"Bearer {token}"})
            for turn in range(args.turns):
                rotation += 1
                for name in TARGETS[rotation % 3:] + TARGETS[:rotation % 3]:
                    took = await conversations[name].turn(client, model, turn, args.max_tokens, seed=index * 10 + turn)
                    if index >= args.warmup:
                        samples[name].append(took)
            if index % 20 == 19:
                progress(f"{index + 1 - args.warmup} rollouts measured")
    return samples


async def recorded_calls(kafka: KafkaSettings, expect: int, timeout_s: float = 60.0) -> list[ModelCallV1]:
    """The calls both proxies recorded, whole (prompts by reference rebuilt), once all ``expect`` are there."""
    topic = TopicRegistry.from_settings(kafka)[CALLS].name
    deadline = time.monotonic() + timeout_s
    while True:
        whole = WholeCalls()
        calls = [whole.whole(event) async for record in read_topic(kafka, topic)
                 if isinstance(event := record.decode(), ModelCallV1)]
        if len(calls) >= expect:
            return calls
        if time.monotonic() > deadline:
            raise RuntimeError(f"read {len(calls)} recorded calls of {expect} within {timeout_s:g} s")
        await asyncio.sleep(0.5)  # the proxies' shippers are still sending


def trainable(calls: list[ModelCallV1], warmup: int) -> dict[str, dict[str, float]]:
    """Per proxy mode, means per measured rollout: tokens sampled, samples built, and trainable tokens.

    Trainable: the loss-mask size of the rollout's largest sample.
    """
    rollouts: dict[str, list[ModelCallV1]] = {}
    for call in calls:
        rollouts.setdefault(call.rollout_id, []).append(call)
    figures: dict[str, dict[str, float]] = {}
    for name in ("chat", "continuation"):
        measured = [rollout for rollout_id, rollout in rollouts.items()
                    if rollout_id.endswith(f"-{name}") and int(rollout_id.split("-")[1]) >= warmup]
        built = [build_samples(sorted(rollout, key=lambda c: c.timings.started_at)) for rollout in measured]
        sampled = [sum(len(c.choices[0].completion_token_ids) for c in rollout if c.choices) for rollout in measured]
        figures[name] = {
            "rollouts": len(measured),
            "sampled": sum(sampled) / max(len(measured), 1),
            "samples": sum(len(b.samples) for b in built) / max(len(built), 1),
            "trainable": sum(max((sum(s.loss_mask) for s in b.samples), default=0) for b in built) / max(len(built), 1)}
    return figures


def summarize(samples: dict[str, list[float]]) -> dict[str, Any]:
    ms = {name: {"p50": pct(values, 0.50) * 1000, "p99": pct(values, 0.99) * 1000, "calls": len(values)}
          for name, values in samples.items()}
    added = {name: {q: ms[name][q] - ms["direct"][q] for q in ("p50", "p99")} for name in ("chat", "continuation")}
    over_chat = {q: added["continuation"][q] - added["chat"][q] for q in ("p50", "p99")}
    return {"latency_ms": ms, "added_ms": added, "continuation_over_chat_ms": over_chat,
            "goal_met": over_chat["p50"] <= GOAL_ADDED_OVER_CHAT_MS}


def report(summary: dict[str, Any]) -> str:
    lines = ["| target | calls | p50 ms | p99 ms | added p50 ms | added p99 ms |", "|---|---|---|---|---|---|"]
    for name in TARGETS:
        row = summary["latency_ms"][name]
        added = summary["added_ms"].get(name, {"p50": 0.0, "p99": 0.0})
        lines.append(f"| {name} | {row['calls']} | {row['p50']:.1f} | {row['p99']:.1f} | "
                     f"{added['p50']:+.2f} | {added['p99']:+.2f} |")
    over = summary["continuation_over_chat_ms"]
    verdict = "met" if summary["goal_met"] else "missed"
    lines.append(f"\ncontinuation over chat mode: p50 {over['p50']:+.2f} ms, p99 {over['p99']:+.2f} ms "
                 f"(goal p50 ≤ {GOAL_ADDED_OVER_CHAT_MS:g} ms: {verdict})")
    tokens = summary.get("tokens_per_rollout")
    if tokens:
        lines += ["", "| per rollout (mean) | rollouts | sampled tokens | samples | trainable (largest sample) |",
                  "|---|---|---|---|---|"]
        for name in ("chat", "continuation"):
            row = tokens[name]
            lines.append(f"| {name} | {row['rollouts']} | {row['sampled']:.1f} | {row['samples']:.2f} | "
                         f"{row['trainable']:.1f} |")
    return "\n".join(lines)


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    processes: list[Process] = []
    engine = broker = None
    try:
        engine_url = args.vllm
        if engine_url is None:
            from openforge.engine import LocalEngine, install_vllm, make_tiny_model
            from stream.broker import cache_root

            python = install_vllm()
            model = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
            engine = LocalEngine(model, free_port(), python, tmp / "vllm.log")
            progress("starting vLLM (about a minute) ...")
            engine.start()
            engine_url = engine.url
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            broker = private_broker(tmp / "kafka")
            broker.start()
            bootstrap = broker.bootstrap
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"benchcont{uuid.uuid4().hex[:10]}.")
        async with KafkaAdmin(kafka) as admin:
            await admin.create_topics()
        key = secrets.token_hex(24)
        ports = {"chat": free_port(), "continuation": free_port()}
        for name, port in ports.items():
            env = {**openforge_env(kafka, key, tmp / f"spool-{name}", capture=True),
                   "OPENFORGE_PROXY_CONTINUATION": "true" if name == "continuation" else "false"}
            processes.append(Process(f"openforge proxy ({name})", [
                sys.executable, "-m", "openforge", "--log-level", "WARNING", "proxy", "--host", "127.0.0.1",
                "--upstream", engine_url, "--port", str(port)], env, tmp / f"proxy-{name}.log"))
        async with httpx.AsyncClient() as client:
            for process, port in zip(processes, ports.values(), strict=True):
                for _ in range(300):
                    process.check_alive()
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
        samples = await measure(engine_url, ports, key, args)
        summary = summarize(samples)
        calls = await recorded_calls(kafka, 2 * (args.warmup + args.rollouts) * args.turns)
        summary["tokens_per_rollout"] = trainable(calls, args.warmup)
        return summary
    finally:
        for process in processes:
            process.stop()
        if broker is not None:
            broker.stop()
        if engine is not None:
            engine.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=None, help="a running vLLM (with --enable-scale-out) to use")
    parser.add_argument("--bootstrap", default=None, help="a running Kafka broker to use")
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-continuation-") as tmp:
        summary = asyncio.run(run(args, Path(tmp)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    sys.stdout.write(report(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
