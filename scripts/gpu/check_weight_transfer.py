#!/usr/bin/env python3
"""GPU check of the publisher's weight transfer: update seconds and inference pause, nccl against disk.

For a machine with at least two GPUs and vLLM's CUDA build (NCCL cannot put two ranks of one
group on one GPU): the sender (this process) on GPU 0, one vLLM replica on GPU 1. For each size
(``--sizes``, default 0.5b and 1.5b) it

1. makes a random Qwen2 of that size locally in bfloat16 (``bench.random_qwen2``, the tiny
   model's tokenizer from ``scripts/vllm/make_tiny_model.py``), and starts ``vllm serve`` on it
   with ``--weight-transfer-config '{"backend": "nccl"}'`` and the dev-mode RL endpoints;
2. loads the same model in this process on GPU 0 and, per update, perturbs it (so every update
   carries new bytes) and runs the publisher's own steps around the publisher's own
   :class:`~consumers.weight_transfer.NcclTransfer` fed by :class:`~learner.workers.weights.ModuleSource`
   (the learner's live-model source): pause (keep), transfer, prefix-cache reset, version,
   resume; then the same with the ``disk`` backend from a folder this process writes (the write
   not timed: the learner writes it before the event);
3. while it updates, a client streams a long greedy answer and records every token's arrival:
   the **inference pause** is the longest gap between tokens across an update, against the median
   gap outside updates;
4. checks after the last update of each backend that the replica's ``/weight_checker`` digests
   equal the sender's (every parameter is compared on a GPU), and writes
   ``weight_transfer_check.json`` to ``--out`` (default ``$OUT``).

Exit status 0 only when every check passed. Needs, importable by the running Python: torch with
CUDA, vllm, transformers, httpx, pydantic-settings, opentelemetry-api, safetensors.

    python3 scripts/gpu/check_weight_transfer.py [--sizes 0.5b,1.5b] [--updates 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(message: str) -> None:
    print(f"[check-weight-transfer] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model: Path, port: int, gpu: str, log_file: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--enforce-eager",
           "--weight-transfer-config", json.dumps({"backend": "nccl"}), "--host", "127.0.0.1", "--port", str(port)]
    with log_file.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def tail(log_file: Path) -> str:
    return log_file.read_text(errors="replace")[-4000:]


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_file: Path, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail(log_file)}")
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"vLLM not healthy within {timeout_s:.0f}s:\n{tail(log_file)}")


class Stream:
    """A long greedy answer streamed in the background; every token's arrival time."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.arrivals: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=None) as client:
            while True:
                body = {"model": self.model, "prompt": "The weights", "max_tokens": 3000, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self.arrivals.append(time.perf_counter())

    def __enter__(self) -> Stream:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def longest_gap(self, start: float, end: float) -> float:
        """Longest wait for a token that spans any part of [start, end]."""
        times = self.arrivals
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
        return max(gaps, default=float("nan"))

    def typical_gap(self, windows: list[tuple[float, float]]) -> float:
        times = self.arrivals
        gaps = [b - a for a, b in itertools.pairwise(times)
                if not any(b >= s and a <= e for s, e in windows)]
        return statistics.median(gaps) if gaps else float("nan")


async def check_size(size: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from bench.random_qwen2 import make_model
    from consumers.weight_digests import verify
    from consumers.weight_transfer import DiskTransfer, NcclSettings, NcclTransfer, StreamDigests
    from learner.workers.weights import ModuleSource

    tokenizer = work / "tiny"
    if not tokenizer.exists():
        await asyncio.to_thread(subprocess.run, [sys.executable, str(ROOT / "scripts" / "vllm" / "make_tiny_model.py"),
                                                 str(tokenizer)], check=True, capture_output=True)
    folder = await asyncio.to_thread(make_model, work / size, size, tokenizer_from=tokenizer)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = work / f"vllm-{size}.log"
    server = start_server(folder, port, args.server_gpu, log_file)
    result: dict[str, Any] = {"size": size, "failures": []}
    try:
        await wait_healthy(url, server, log_file)
        device = torch.device(args.sender_device)
        torch.cuda.set_device(device)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
        result["parameters"] = sum(p.numel() for p in model.parameters())
        async with httpx.AsyncClient() as http:

            async def call(url: str, method: str, path: str, *, timeout_s: float | None = None,
                           params: dict[str, str] | None = None, json: dict[str, Any] | None = None) -> dict[str, Any]:
                response = await http.request(method, url + path, params=params, json=json, timeout=timeout_s or 60)
                if response.status_code != 200:
                    raise RuntimeError(f"{method} {path} answered {response.status_code}: {response.text[:300]}")
                try:
                    body = response.json()
                except ValueError:
                    return {}
                return body if isinstance(body, dict) else {}

            settings = NcclSettings(device=str(device), bucket_bytes=args.bucket_mib << 20, timeout_s=120)
            nccl = NcclTransfer(call, settings, request_timeout_s=60, finish_timeout_s=600,
                                source=lambda _folder: ModuleSource(model, torch.bfloat16, device))
            disk = DiskTransfer(call, 600)
            served = work / f"{size}-served"
            with Stream(url, str(folder)) as stream:
                await asyncio.sleep(3)
                windows: list[tuple[float, float]] = []
                for backend, transfer in (("nccl", nccl), ("disk", disk)):
                    rows = []
                    for update in range(args.updates):
                        with torch.no_grad():
                            for param in model.parameters():
                                param.add_(torch.randn_like(param), alpha=1e-3)
                        if backend == "disk":
                            model.save_pretrained(served, safe_serialization=True)
                        version = f"{backend}-{update}"
                        paused = time.perf_counter()
                        await call(url, "POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
                        started = time.perf_counter()
                        await transfer.load(url, served)
                        moved = time.perf_counter() - started
                        await call(url, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
                        await call(url, "POST", "/update_weight_version", json={"new_version": version})
                        await call(url, "POST", "/resume")
                        resumed = time.perf_counter()
                        await asyncio.sleep(1.0)  # let the stream show the recompute after resume
                        windows.append((paused, resumed + 1.0))
                        rows.append({"transfer_s": moved, "paused_s": resumed - paused,
                                     "longest_token_gap_s": stream.longest_gap(paused, resumed + 1.0)})
                    digests = StreamDigests([m.name for m in ModuleSource(model, torch.bfloat16, device).metadata()])
                    source = ModuleSource(model, torch.bfloat16, device)
                    for name, tensor in source.tensors([m.name for m in source.metadata()]):
                        digests.add(name, tensor)
                    checksums = (await call(url, "POST", "/weight_checker", json={"action": "checksum"},
                                            timeout_s=600))["checksums"]
                    verdict = verify({str(k): str(v) for k, v in checksums.items()}, digests.digests)
                    if not verdict.ok:
                        result["failures"].append(f"{size} {backend}: the replica's digests differ "
                                                  f"({verdict.mismatched[:5]}, {verdict.checked} compared)")
                    result[backend] = {
                        "updates": rows, "verified_parameters": verdict.checked,
                        "transfer_s_median": statistics.median(r["transfer_s"] for r in rows),
                        "paused_s_median": statistics.median(r["paused_s"] for r in rows),
                        "longest_token_gap_s_median": statistics.median(r["longest_token_gap_s"] for r in rows),
                    }
                    log(f"{size} {backend}: transfer {result[backend]['transfer_s_median']:.3f}s, paused "
                        f"{result[backend]['paused_s_median']:.3f}s, longest token gap "
                        f"{result[backend]['longest_token_gap_s_median']:.3f}s (median of {len(rows)})")
                result["typical_token_gap_s"] = stream.typical_gap(windows)
            await nccl.close()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b", help="random Qwen2 sizes to check (bench.random_qwen2)")
    parser.add_argument("--updates", type=int, default=5, help="updates per backend and size")
    parser.add_argument("--bucket-mib", type=int, default=1024, help="NCCL bucket (and packed buffer) size")
    parser.add_argument("--sender-device", default="cuda:0", help="this process's GPU")
    parser.add_argument("--server-gpu", default="1", help="CUDA_VISIBLE_DEVICES of the vLLM replica")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args(argv)
    import torch

    if torch.cuda.device_count() < 2:
        log(f"ERROR: {torch.cuda.device_count()} GPU(s) visible; NCCL needs the sender and the replica on "
            "different GPUs (two or more)")
        return 2
    report: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                              "sizes": []}
    with tempfile.TemporaryDirectory(prefix="openforge-weight-transfer-") as tmp:
        for size in args.sizes.split(","):
            report["sizes"].append(asyncio.run(check_size(size.strip(), args, Path(tmp))))
    failures = [f for size in report["sizes"] for f in size["failures"]]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weight_transfer_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({s["size"]: {b: {k: v for k, v in s[b].items() if k != "updates"}
                                  for b in ("nccl", "disk") if b in s} for s in report["sizes"]}, indent=2))
    for failure in failures:
        log(f"ERROR: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
