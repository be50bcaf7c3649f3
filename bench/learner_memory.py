"""Learner memory: peak host RSS per rank, step time and checkpoint cost, before and after, side by side.

A random Qwen2-architecture model (Qwen2.5-0.5B's shape by default: 24 layers, hidden 896,
vocabulary 151,936) is made locally; then two FSDP ranks on CPU (gloo) run the same two steps
and one checkpoint with the learner of a baseline revision (default: ``main`` before the learner
that loads shards, packs rows and chunks its logprobs; read from git) and with the learner of this
tree. Each rank reports its peak RSS (``ru_maxrss``: the whole life of the process, model load
included) and that peak as it stood after the load and after the steps (where it is reached), the
second step's seconds and what its checkpoint wrote:
before, float32 weights plus ``optimizer.pt``; after, serving weights in bfloat16 and, apart, the
training state. Goal: peak RSS per rank <= 0.6x the baseline's.

    python -m bench.learner_memory [--layers 24] [--tokens 1024] [--baseline REVISION]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

from bench.random_qwen2 import SHAPES

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.6
BASELINE = "2f93acf^1"  # main before that learner: the first parent of the merge that brought it
QWEN2_0_5B = {k: v for k, v in SHAPES["0.5b"].items() if k != "num_hidden_layers"} | {"max_position_embeddings": 4096}


def make_model(folder: Path, layers: int) -> int:
    """A random Qwen2 of Qwen2.5-0.5B's shape with ``layers`` layers, saved in float32; return its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(num_hidden_layers=layers, **QWEN2_0_5B)  # type: ignore[no-untyped-call]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def baseline_tree(revision: str, folder: Path) -> Path:
    """The repository at ``revision`` (from git, read only), unpacked into ``folder``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def rank_main(tree: Path, model: Path, out: Path, tokens: int) -> None:
    """One rank: load, two steps, one checkpoint; write this rank's numbers (run under torchrun)."""
    sys.path.insert(0, str(tree))
    import torch

    from learner.protocol import Row, TrainBatch
    from learner.settings import LearnerSettings
    from learner.workers.fsdp import FSDPPolicyWorker

    fields = LearnerSettings.model_fields
    extra: dict[str, Any] = {"serving_dtype": "bfloat16"} if "serving_dtype" in fields else {}
    settings = LearnerSettings(model_dir=model, engine="fsdp", device="cpu", lr=1e-5, token_budget=tokens // 2,
                               **extra)
    started = time.perf_counter()
    worker = FSDPPolicyWorker(settings, model)
    load_s = time.perf_counter() - started
    load_peak = _peak_gib()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(4):  # two rows per rank, tokens / 4 each: one micro-batch per rank
        ids = torch.randint(0, 151936, (tokens // 4,), generator=generator).tolist()
        half = len(ids) // 2
        rows.append(Row(input_ids=ids, prompt_len=half, loss_mask=[1] * (len(ids) - half),
                        behavior_logprobs=[-12.0] * (len(ids) - half), advantage=1.0 if i % 2 else -1.0))
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        worker.train_step(TrainBatch(rows))
        seconds.append(time.perf_counter() - started)
    folder = out / "checkpoint"
    report: dict[str, Any] = {"load_s": load_s, "step_s": seconds[-1], "first_step_s": seconds[0],
                              "load_peak_gib": load_peak, "steps_peak_gib": _peak_gib()}
    if hasattr(worker, "save_serving"):
        started = time.perf_counter()
        worker.save_serving(folder / "serving")
        report["serving_s"] = time.perf_counter() - started
        started = time.perf_counter()
        worker.save_state(folder / "state")
        report["state_s"] = time.perf_counter() - started
    else:
        started = time.perf_counter()
        worker.save(folder / "serving")
        report["serving_s"], report["state_s"] = time.perf_counter() - started, 0.0
    torch.distributed.barrier()
    report["peak_rss_gib"] = _peak_gib()
    (out / f"rank{worker.rank}.json").write_text(json.dumps(report))
    worker.close()


def _run(tree: Path, model: Path, out: Path, tokens: int) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "bench.learner_memory", "--rank", str(tree), str(model), str(out), str(tokens)],
                   env=env, check=True, cwd=ROOT)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    folder = out / "checkpoint"
    for kind in ("serving", "state"):
        reports[0][f"{kind}_bytes"] = _size(folder / kind) if (folder / kind).exists() else 0
    return reports


def main(argv: list[str] | None = None) -> int:
    """Make the model, run both learners, print the table."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        rank_main(Path(argv[1]), Path(argv[2]), Path(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: Qwen2.5-0.5B)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step, over both ranks")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the baseline learner")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="openforge-learner-memory-") as tmp:
        work = Path(tmp)
        params = make_model(work / "model", args.layers)
        before = _run(baseline_tree(args.baseline, work / "baseline"), work / "model", work / "before", args.tokens)
        after = _run(ROOT, work / "model", work / "after", args.tokens)
    rows = [("peak RSS rank 0 (GiB)", "peak_rss_gib", 0), ("peak RSS rank 1 (GiB)", "peak_rss_gib", 1),
            ("  by end of load, rank 0", "load_peak_gib", 0), ("  by end of load, rank 1", "load_peak_gib", 1),
            ("  by end of steps, rank 0", "steps_peak_gib", 0), ("  by end of steps, rank 1", "steps_peak_gib", 1),
            ("load (s)", "load_s", 0), ("step (s)", "step_s", 0),
            ("serving checkpoint (GB)", "serving_bytes", 0), ("serving checkpoint (s)", "serving_s", 0),
            ("training state (GB)", "state_bytes", 0), ("training state (s)", "state_s", 0)]
    print(f"random Qwen2, {params / 1e6:.0f}M parameters ({args.layers} layers), 2 FSDP ranks on CPU (gloo), "
          f"{args.tokens} tokens per step; baseline {args.baseline}")
    print(f"{'':26}{'before':>10}{'after':>10}{'after/before':>14}")
    for label, key, rank in rows:
        a, b = before[rank].get(key, 0.0), after[rank].get(key, 0.0)
        if key.endswith("_bytes"):
            a, b = a / 1e9, b / 1e9
        ratio = f"{b / a:.2f}" if a else "-"
        print(f"{label:26}{a:10.2f}{b:10.2f}{ratio:>14}")
    ratio = max(after[r]["peak_rss_gib"] for r in (0, 1)) / max(before[r]["peak_rss_gib"] for r in (0, 1))
    print(f"peak RSS per rank, after/before: {ratio:.2f} (goal <= {GOAL})")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
