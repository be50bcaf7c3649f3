#!/usr/bin/env python3
r"""Start vLLM's CPU build on a tiny model and check everything OpenForge relies on.

Standard library only; run it with any Python 3.11+::

    python scripts/vllm/verify_server.py --python "$(scripts/vllm/install.sh | tail -n 1)" \\
        --model /path/to/tiny-model --model2 /path/to/tiny-model-seed1 --report report.json

``--model2`` must be a model with the same shapes and different weights (``make_tiny_model.py
--seed 1``); it is what the weight-publish check loads. ``--url`` checks a server that is already
running instead of starting one (then start time and memory are not measured).

Checks (each prints one line; the exit status is non-zero if any fails):

* chat completions with ``logprobs`` and ``return_token_ids``, streaming and not, greedy answers
  equal across both, ``/tokenize`` and ``/v1/chat/completions/render`` equal ``prompt_token_ids``;
* tools with ``tool_choice`` "required" and "auto", streaming and not;
* the token-in/token-out path (render -> ``/inference/v1/generate`` -> derender), which is where
  this vLLM reports ``weight_versions``;
* publishing weights from disk: pause(keep) -> reload_weights -> reset_prefix_cache ->
  update_weight_version -> resume, ``/weight_info``, answers change and carry the new version,
  a request in flight across the update reports two version spans, reloading the first weights
  restores the first answers exactly;
* stale prefix cache after a reload without ``/reset_prefix_cache`` (reported, not failed);
* latency of a 16-token completion, server start time and resident memory.

The report (``--report``) holds the measurements and trimmed real responses.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            # Without "strict" (or --tool-strict-level parameter) the grammar pins only the
            # envelope and the tool name; the arguments may be any JSON value.
            "strict": True,
            "parameters": {
                "type": "object",
                # A random model ends a free string only by chance: an enum lets the
                # constrained call finish within a few dozen tokens.
                "properties": {
                    "city": {"type": "string", "description": "The city.", "enum": ["Paris", "London"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
SERVER_FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "128M",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--enable-scale-out",
]


class Checker:
    """HTTP helpers, check bookkeeping and the report."""

    def __init__(self, base: str, model: str) -> None:
        self.base = base
        self.model = model
        self.failures: list[str] = []
        self.report: dict[str, Any] = {"checks": {}, "examples": {}, "figures": {}}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record and print one pass/fail check."""
        self.report["checks"][name] = {"ok": ok, "detail": detail}
        print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        if not ok:
            self.failures.append(name)
        return ok

    def note(self, name: str, value: Any, detail: str = "") -> None:
        """Record an observation that is not a pass/fail check."""
        self.report["figures"][name] = value
        print(f"[info] {name} = {value}{': ' + detail if detail else ''}", flush=True)

    def post(self, path: str, body: Any = None, timeout: float = 120) -> Any:
        """POST JSON, return the decoded answer (None for an empty body)."""
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.base + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"POST {path} -> {exc.code}: {exc.read()[:500]!r}") from exc
        return json.loads(raw) if raw.strip() else None

    def get(self, path: str) -> Any:
        """GET and decode JSON."""
        with urllib.request.urlopen(self.base + path, timeout=30) as resp:
            return json.loads(resp.read())

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST and yield the decoded server-sent events until [DONE]."""
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    def chat(self, **extra: Any) -> dict[str, Any]:
        """Greedy 16-token chat completion of MESSAGES, with extra request fields."""
        body = {"model": self.model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        body.update(extra)
        return self.post("/v1/chat/completions", body)  # type: ignore[no-any-return]

    def greedy_ids(self, **extra: Any) -> list[int]:
        """Token ids of the greedy answer."""
        return self.chat(return_token_ids=True, **extra)["choices"][0]["token_ids"]  # type: ignore[no-any-return]


def trim(obj: Any, keep: int = 3) -> Any:
    """Shorten long lists (keeping the first ``keep``) so examples stay readable."""
    if isinstance(obj, list):
        items = [trim(x, keep) for x in obj[:keep]]
        if len(obj) > keep:
            items.append(f"... {len(obj) - keep} more")
        return items
    if isinstance(obj, dict):
        return {k: trim(v, keep) for k, v in obj.items()}
    return obj


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree_memory_mib(pid: int) -> dict[str, float]:
    """RSS and PSS of a process and all its descendants, in MiB (Linux /proc).

    RSS counts the shared libraries (torch) once per process; PSS splits them, so its sum is
    what the server really costs.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    rss_kib, pss_kib, procs, todo = 0, 0, 0, [pid]
    while todo:
        cur = todo.pop()
        todo.extend(children.get(cur, []))
        try:
            for line in Path(f"/proc/{cur}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss_kib += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss_kib += int(line.split()[1])
            procs += 1
        except OSError:
            continue
    return {"processes": procs, "rss": round(rss_kib / 1024, 1), "pss": round(pss_kib / 1024, 1)}


def start_server(python: str, model: str, cache: str, log_path: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """Start the server in its own process group; return it, its URL and its start time."""
    port = free_port()
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CACHE_ROOT=cache,
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *SERVER_FLAGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print("[..] starting: " + " ".join(cmd), flush=True)
    log = log_path.open("wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {log_path}")
        if time.monotonic() - t0 > 600:
            stop_server(proc)
            sys.exit(f"server not healthy after 600 s; see {log_path}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    return proc, base, time.monotonic() - t0


def stop_server(proc: subprocess.Popen[bytes]) -> float:
    """Stop the server's process group; return the seconds it took."""
    t0 = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return time.monotonic() - t0


def check_chat(c: Checker) -> list[int]:
    """Token ids, logprobs, streaming and /tokenize; return the greedy answer's ids."""
    body = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_weight_versions": True}
    resp = c.chat(**body)
    c.report["examples"]["chat_nonstream"] = trim(resp)
    choice = resp["choices"][0]
    prompt_ids = resp.get("prompt_token_ids")
    c.check(
        "chat: prompt_token_ids (top level)",
        isinstance(prompt_ids, list) and len(prompt_ids) > 0,
        f"{len(prompt_ids or [])} ids, usage.prompt_tokens={resp['usage']['prompt_tokens']}",
    )
    ids = choice.get("token_ids")
    lps = (choice.get("logprobs") or {}).get("content") or []
    c.check("chat: choices[0].token_ids", isinstance(ids, list) and len(ids) == 16, f"{ids}")
    c.check(
        "chat: choices[0].logprobs.content one per token",
        len(lps) == len(ids or []),
        f"{len(lps)} entries, first {lps[0]['logprob'] if lps else None}",
    )
    c.note(
        "chat_has_weight_versions",
        "weight_versions" in choice,
        "return_weight_versions is ignored by /v1/chat/completions in this vLLM",
    )

    tok = c.post("/tokenize", {"model": c.model, "messages": MESSAGES, "add_generation_prompt": True})
    c.report["examples"]["tokenize"] = trim(tok, 5)
    c.check("/tokenize(messages) == prompt_token_ids", tok["tokens"] == prompt_ids, f"{tok['count']} tokens")
    render = c.post(
        "/v1/chat/completions/render", {"model": c.model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    )
    c.check("/v1/chat/completions/render token_ids == prompt_token_ids", render["token_ids"] == prompt_ids)

    chunks = list(
        c.stream(
            "/v1/chat/completions",
            {
                "model": c.model,
                "messages": MESSAGES,
                "max_tokens": 16,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **body,
            },
        )
    )
    c.report["examples"]["chat_stream_chunks"] = [trim(x) for x in chunks[:2] + chunks[-2:]]
    c.report["figures"]["chat_stream_chunk_count"] = len(chunks)
    first = chunks[0]
    c.check(
        "stream: prompt_token_ids on first chunk only",
        first.get("prompt_token_ids") == prompt_ids and all(x.get("prompt_token_ids") is None for x in chunks[1:]),
    )
    s_ids: list[int] = []
    s_lps: list[float] = []
    for x in chunks:
        for ch in x.get("choices", []):
            s_ids += ch.get("token_ids") or []
            s_lps += [e["logprob"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    per_chunk = [len(ch.get("token_ids") or []) for x in chunks for ch in x.get("choices", [])]
    c.check(
        "stream: token_ids per chunk concatenate to the non-streamed ids", s_ids == ids, f"ids per chunk {per_chunk}"
    )
    c.check(
        "stream: logprobs match non-streamed",
        len(s_lps) == len(lps) and all(abs(a - b["logprob"]) < 1e-4 for a, b in zip(s_lps, lps, strict=True)),
    )
    c.note(
        "chat_stream_has_weight_versions", any("weight_versions" in ch for x in chunks for ch in x.get("choices", []))
    )
    return ids or []


def check_tools(c: Checker) -> None:
    """tool_choice required and auto, streaming and not."""
    for choice_mode in ("required", "auto"):
        resp = c.chat(
            tools=TOOLS,
            tool_choice=choice_mode,
            logprobs=True,
            return_token_ids=True,
            parallel_tool_calls=False,
            max_tokens=128,
            temperature=1.0,
            seed=0,
        )
        c.report["examples"][f"tools_{choice_mode}"] = trim(resp, 4)
        ch = resp["choices"][0]
        calls = ch["message"].get("tool_calls") or []
        text = c.post("/detokenize", {"model": c.model, "tokens": ch["token_ids"]})["prompt"]
        c.report["examples"][f"tools_{choice_mode}_decoded_output"] = text
        if choice_mode == "required":
            tok = c.post(
                "/tokenize",
                {"model": c.model, "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": True},
            )
            c.check(
                "/tokenize(messages, tools) == prompt_token_ids of the tools request",
                tok["tokens"] == resp["prompt_token_ids"],
                f"{tok['count']} tokens",
            )
        ok = bool(calls) if choice_mode == "required" else True
        c.check(
            f"tools: tool_choice={choice_mode}",
            ok and bool(ch.get("token_ids")),
            f"finish={ch['finish_reason']} tool_calls={[t['function'] for t in calls]} sampled text={text[:120]!r}",
        )
    chunks = list(
        c.stream(
            "/v1/chat/completions",
            {
                "model": c.model,
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "max_tokens": 128,
                "temperature": 1.0,
                "seed": 0,
                "stream": True,
                "logprobs": True,
                "return_token_ids": True,
            },
        )
    )
    deltas = [d for x in chunks for ch in x["choices"] for d in (ch["delta"].get("tool_calls") or [])]
    with_calls = [x for x in chunks if any(ch["delta"].get("tool_calls") for ch in x["choices"])]
    c.report["examples"]["tools_required_stream_chunks"] = [
        trim(x) for x in chunks[:2] + with_calls[:2] + with_calls[-1:] + chunks[-1:]
    ]
    c.check(
        "tools: tool_choice=required streaming", bool(deltas), f"{len(chunks)} chunks, {len(deltas)} tool_call deltas"
    )


def generate(c: Checker, max_tokens: int = 16, **sp: Any) -> dict[str, Any]:
    """Render MESSAGES and run them through /inference/v1/generate."""
    render = c.post(
        "/v1/chat/completions/render",
        {"model": c.model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "logprobs": True},
    )
    # /render leaves out sampling fields equal to SamplingParams' defaults, max_tokens=16
    # included, and /generate then fills in its own default (the rest of the context): always
    # set max_tokens explicitly on the generate request.
    render["sampling_params"].update(max_tokens=max_tokens, **sp)
    return c.post("/inference/v1/generate", render)  # type: ignore[no-any-return]


def check_token_path(c: Checker) -> None:
    """Render -> /inference/v1/generate -> derender, with tools."""
    render = c.post(
        "/v1/chat/completions/render",
        {
            "model": c.model,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 128,
            "temperature": 1.0,
            "seed": 0,
            "logprobs": True,
        },
    )
    c.report["examples"]["render"] = trim(render, 4)
    gen = c.post("/inference/v1/generate", render)
    c.report["examples"]["generate"] = trim(gen, 4)
    wv = gen["choices"][0].get("weight_versions")
    c.check("generate: choices[0].weight_versions", bool(wv), json.dumps(wv))
    chat_request = {k: render.get(k) for k in ("model",)}
    chat_request.update({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    der = c.post(
        "/v1/chat/completions/derender",
        {
            "generate_response": gen,
            "prompt_token_ids": render["token_ids"],
            "prompt_tokens": len(render["token_ids"]),
            "chat_request": chat_request,
        },
    )
    c.report["examples"]["derender"] = trim(der, 4)
    calls = der["choices"][0]["message"].get("tool_calls") or []
    c.check(
        "derender: tool calls parsed from generated tokens",
        bool(calls),
        json.dumps([t["function"] for t in calls])[:200],
    )


def publish(c: Checker, path: str, version: str, reset_cache: bool = True) -> dict[str, float]:
    """Publish weights from ``path`` as ``version``; return the seconds each step took."""
    t: dict[str, float] = {}
    t0 = time.monotonic()
    c.post("/pause?mode=keep")
    t["pause"] = time.monotonic() - t0
    t1 = time.monotonic()
    c.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
    t["reload_weights"] = time.monotonic() - t1
    if reset_cache:
        t2 = time.monotonic()
        res = c.post("/reset_prefix_cache?reset_running_requests=true")
        t["reset_prefix_cache"] = time.monotonic() - t2
        if not res.get("success"):
            raise RuntimeError(f"reset_prefix_cache failed: {res}")
    t3 = time.monotonic()
    c.report["examples"]["update_weight_version"] = c.post("/update_weight_version", {"new_version": version})
    t["update_weight_version"] = time.monotonic() - t3
    t4 = time.monotonic()
    c.post("/resume")
    t["resume"] = time.monotonic() - t4
    t["total"] = time.monotonic() - t0
    return {k: round(v, 4) for k, v in t.items()}


def check_publish(c: Checker, model: str, model2: str, greedy1: list[int]) -> None:
    """Weight publishing from disk, versions, in-flight spans, prefix cache."""
    info0 = c.get("/weight_info")
    c.report["examples"]["weight_info_initial"] = info0
    c.check("/weight_info before any update", "weight_version" in info0, json.dumps(info0))

    # A long request in flight across the update: its tokens come from two versions.
    import threading

    result: dict[str, Any] = {}
    running = threading.Event()

    def long_request() -> None:
        render = c.post("/v1/chat/completions/render", {"model": c.model, "messages": MESSAGES, "temperature": 0})
        render["sampling_params"].update(max_tokens=600, ignore_eos=True)
        render["stream"] = True
        chunks = []
        for chunk in c.stream("/inference/v1/generate", render):
            chunks.append(chunk)
            if len(chunks) == 20:
                running.set()
        running.set()
        result["chunks"] = chunks

    th = threading.Thread(target=long_request)
    th.start()
    running.wait(120)
    timings = publish(c, model2, "2")
    th.join()
    c.report["figures"]["publish_seconds"] = timings
    chunks = result["chunks"]
    c.report["examples"]["generate_stream_chunks"] = [trim(x) for x in chunks[:2] + chunks[-2:]]
    spans = [s for x in chunks for ch in x["choices"] for s in (ch.get("weight_versions") or [])]
    c.report["examples"]["weight_versions_across_update"] = spans
    c.check("publish: pause(keep) -> reload -> reset cache -> version -> resume", True, json.dumps(timings))
    c.check(
        "publish: in-flight request reports two version spans",
        len(spans) == 2 and spans[1]["version"] == "2" and spans[1]["end"] == 600,
        json.dumps(spans),
    )

    info = c.get("/weight_info")
    c.check("/weight_info shows the new version", info.get("weight_version") == "2", json.dumps(info))
    gen = generate(c)
    wv = gen["choices"][0]["weight_versions"]
    c.check("next answer carries the new version", wv == [{"version": "2", "start": 0, "end": 16}], json.dumps(wv))
    greedy2 = c.greedy_ids()
    c.check("new weights change the greedy answer", greedy2 != greedy1, f"{greedy2[:8]}...")

    # Stale prefix cache: reload without reset, then compare with a salted (uncached) request.
    long_msgs = [MESSAGES[0], {"role": "user", "content": " ".join(["weather in Paris"] * 120)}]

    def logprobs(**extra: Any) -> list[float]:
        resp = c.post(
            "/v1/chat/completions",
            {"model": c.model, "messages": long_msgs, "max_tokens": 4, "temperature": 0, "logprobs": True, **extra},
        )
        return [e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]]

    publish(c, model, "3")
    logprobs()  # fills the prefix cache with version-3 KV for long_msgs
    c.post("/pause?mode=keep")
    c.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model2}})
    c.post("/update_weight_version", {"new_version": "4-no-reset"})
    c.post("/resume")
    cached, fresh = logprobs(), logprobs(cache_salt="fresh-after-reload")
    diff = max(abs(a - b) for a, b in zip(cached, fresh, strict=True))
    c.note(
        "stale_prefix_cache_without_reset",
        diff > 1e-4,
        f"max |logprob diff| {diff:.3g} between a cached and an uncached prompt after a reload "
        "without /reset_prefix_cache",
    )

    publish(c, model, "5")
    greedy_back = c.greedy_ids()
    c.check("reloading the first weights restores the first answer exactly", greedy_back == greedy1)
    c.check("/weight_info after restore", c.get("/weight_info").get("weight_version") == "5")


def check_latency(c: Checker) -> None:
    """Latency of a 16-token completion and of the first streamed chunk."""
    body = {
        "model": c.model,
        "messages": MESSAGES,
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    c.post("/v1/chat/completions", body)  # warm-up
    lat = []
    for _ in range(10):
        t0 = time.monotonic()
        resp = c.post("/v1/chat/completions", body)
        lat.append(time.monotonic() - t0)
        assert len(resp["choices"][0]["token_ids"]) == 16
    ttft = []
    for _ in range(5):
        t0 = time.monotonic()
        for _chunk in c.stream("/v1/chat/completions", {**body, "stream": True}):
            ttft.append(time.monotonic() - t0)
            break
    lat.sort()
    c.report["figures"]["latency_16_tokens_s"] = {
        "p50": round(statistics.median(lat), 4),
        "min": round(lat[0], 4),
        "max": round(lat[-1], 4),
        "stream_first_chunk_p50": round(statistics.median(ttft), 4),
    }
    c.check("latency of a 16-token completion", True, json.dumps(c.report["figures"]["latency_16_tokens_s"]))


def check_hf_parity(c: Checker, python: str, model: str) -> None:
    """Compare vLLM's logprobs with a Hugging Face forward pass in float32.

    Greedy: they must match. Sampled at temperature 0.7: report whether vLLM's default logprobs
    are those of the raw model (temperature 1) or of the tempered distribution it sampled from.
    """
    code = (
        "import json,sys,torch\nfrom transformers import AutoModelForCausalLM\n"
        "d=json.load(sys.stdin)\n"
        "m=AutoModelForCausalLM.from_pretrained(d['model'],dtype=torch.float32).eval()\n"
        "out=[]\n"
        "for prompt,ids,temp in d['cases']:\n"
        "  x=torch.tensor([prompt+ids])\n"
        "  with torch.no_grad(): logits=m(x).logits[0].float()\n"
        "  n=len(prompt)\n"
        "  raw=torch.log_softmax(logits,-1); tem=torch.log_softmax(logits/temp,-1)\n"
        "  out.append([[raw[n-1+i,t].item() for i,t in enumerate(ids)],"
        "[tem[n-1+i,t].item() for i,t in enumerate(ids)]])\n"
        "print(json.dumps(out))\n"
    )
    cases, vllm = [], []
    for temp in (0.0, 0.7):
        resp = c.chat(logprobs=True, return_token_ids=True, max_tokens=16, temperature=temp, seed=0)
        cases.append((resp["prompt_token_ids"], resp["choices"][0]["token_ids"], temp or 1.0))
        vllm.append([e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]])
    proc = subprocess.run(
        [python, "-c", code],
        input=json.dumps({"model": model, "cases": cases}),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        c.check("HF parity", False, proc.stderr[-500:])
        return
    hf = json.loads(proc.stdout.strip().splitlines()[-1])

    def maxdiff(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    greedy = maxdiff(hf[0][0], vllm[0])
    c.report["figures"]["hf_max_abs_logprob_diff"] = greedy
    c.check("vLLM logprobs == Hugging Face float32 forward", greedy < 1e-3, f"max |diff| {greedy:.2e}")
    raw, tempered = maxdiff(hf[1][0], vllm[1]), maxdiff(hf[1][1], vllm[1])
    c.note(
        "logprobs_at_temperature_0.7",
        "raw (temperature 1)" if raw < tempered else "tempered",
        f"max |diff| to raw {raw:.2e}, to tempered {tempered:.2e}",
    )


def main() -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", help="python of the vLLM venv (to start the server)")
    ap.add_argument("--model", required=True, help="model folder (make_tiny_model.py)")
    ap.add_argument("--model2", required=True, help="same shapes, other weights (--seed 1)")
    ap.add_argument("--url", help="check a running server instead of starting one")
    ap.add_argument("--cache", default=None, help="VLLM_CACHE_ROOT (default: a temp dir)")
    ap.add_argument("--report", type=Path, help="write the JSON report here")
    ap.add_argument("--log", type=Path, default=None, help="server log (default: temp file)")
    args = ap.parse_args()
    model, model2 = str(Path(args.model).resolve()), str(Path(args.model2).resolve())

    proc = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        if not args.python:
            ap.error("--python or --url is needed")
        cache = args.cache or tempfile.mkdtemp(prefix="vllm-cache-")
        log = args.log or Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        proc, base, started = start_server(args.python, model, cache, log)
        print(f"[ok] server healthy after {started:.1f} s (log {log})", flush=True)
    c = Checker(base, model)
    if proc is not None:
        c.report["figures"]["start_to_health_s"] = round(started, 1)
        c.report["figures"]["memory_mib_idle"] = tree_memory_mib(proc.pid)
        c.report["server_command_flags"] = SERVER_FLAGS
    try:
        c.report["figures"]["version"] = c.get("/version")
        greedy1 = check_chat(c)
        check_tools(c)
        check_token_path(c)
        check_latency(c)
        if args.python:
            check_hf_parity(c, args.python, model)
        check_publish(c, model, model2, greedy1)
        if proc is not None:
            c.report["figures"]["memory_mib_after_checks"] = tree_memory_mib(proc.pid)
    except Exception as exc:
        c.check("unexpected error", False, repr(exc))
    finally:
        if proc is not None:
            c.report["figures"]["stop_s"] = round(stop_server(proc), 1)
    if args.report:
        args.report.write_text(json.dumps(c.report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(c.report["figures"], indent=2))
    print(f"{len(c.report['checks']) - len(c.failures)} passed, {len(c.failures)} failed")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
