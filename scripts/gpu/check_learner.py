#!/usr/bin/env python3
"""GPU check of the learner: the ``hf`` and ``fsdp`` engines side by side on one device.

Made for a machine that has CUDA torch and transformers but not this project's environment:
``check_learner.sh`` puts the repository and a folder of wheels (veRL and the few pure-Python or
small packages the learner imports) on ``PYTHONPATH`` and runs this file with the machine's
``python3``. It

1. makes the tiny tokenizer with ``scripts/vllm/make_tiny_model.py`` and a randomly initialised
   Qwen2 of moderate size on it (hidden 1024, 8 layers; ``--small``: the tiny model itself);
2. runs ``--steps`` learner steps per engine (``hf``; ``fsdp`` in float32; on CUDA also ``fsdp``
   with bfloat16 compute) through the real :class:`~learner.trainer.Learner` loop fed by a
   :class:`~learner.sources.ListTrajectorySource` of synthetic ``TrajectoryV1`` groups, and writes
   one checkpoint per engine;
3. checks that every loss is finite, that ``hf`` and float32 ``fsdp`` agree on the first step
   (loss and gradient norm), and that each checkpoint has the initial model's safetensors layout;
4. prints tokens/s side by side and writes ``learner_gpu_check.json`` to ``--out`` (default
   ``$OUT`` when set). Exit status 0 only when every check passed.

Ray: ``import verl`` imports Ray (for ``DataProto``), which is far too large to ship in the wheel
folder. When Ray is not importable, a stand-in module named ``ray`` is registered that defines
only ``ray.ObjectRef`` (the one name veRL's import chain touches, in type hints) and raises on any
other use, so a Ray call could not pass silently. The learner never calls Ray.

    python3 scripts/gpu/check_learner.py [--device cuda|cpu] [--small] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

SHAPES: dict[str, dict[str, Any]] = {
    # About 110M parameters with the 4096-token vocabulary: big enough to load an H200 usefully in
    # seconds, small enough that both engines finish well inside the check's time budget.
    "moderate": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "small": {},
}
AGREE_REL = 1e-3
"""First-step tolerance between hf and float32 fsdp (relative; absolute for a loss near zero)."""


def log(message: str) -> None:
    """Progress on stderr with the seconds since start, so a slow phase is visible in the log."""
    sys.stderr.write(f"[check-learner +{time.monotonic() - _START:6.1f}s] {message}\n")
    sys.stderr.flush()


_START = time.monotonic()


def stand_in_for_ray() -> bool:
    """Register the ``ray`` stand-in described in the module docstring; return whether it was needed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pass
    else:
        return False

    class ObjectRef:  # only for isinstance checks and annotations in veRL's import chain
        pass

    module = types.ModuleType("ray")
    module.ObjectRef = ObjectRef  # type: ignore[attr-defined]

    def missing(name: str) -> Any:
        raise AttributeError(f"ray.{name}: Ray is not installed here; the learner check does not use it")

    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules["ray"] = module
    return True


def make_model(folder: Path, shape: str, python: str) -> Path:
    """The tiny tokenizer (and tiny model) from make_tiny_model.py; a bigger random Qwen2 on it if asked."""
    tiny = folder / "tiny"
    proc = subprocess.run([python, str(ROOT / "scripts" / "vllm" / "make_tiny_model.py"), str(tiny)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py failed:\n{proc.stderr[-4000:]}")
    if not SHAPES[shape]:
        return tiny
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = folder / shape
    model.save_pretrained(out, safe_serialization=True)
    for item in tiny.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json" and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
    params = sum(p.numel() for p in model.parameters())
    log(f"made a {shape} Qwen2: {params / 1e6:.1f}M parameters, vocab {config.vocab_size}")
    return out


def run_engine(name: str, model: Path, data: list[Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Train ``args.steps`` steps with one engine through the Learner loop; return its numbers."""
    import torch

    from consumers.checkpoint_files import read_layout
    from learner.settings import LearnerSettings
    from learner.sources import ListTrajectorySource
    from learner.trainer import Learner

    engine, _, dtype = name.partition("-")
    settings = LearnerSettings(
        model_dir=model, engine=engine, device=args.device, fsdp_param_dtype="bfloat16" if dtype else "float32",  # type: ignore[arg-type]
        checkpoint_dir=work / name, lr=1e-5, groups_per_step=args.groups_per_step, max_steps=args.steps,
        checkpoint_every=args.steps, batch_wait_s=60.0, max_staleness=10_000, token_budget=args.token_budget,
    )
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(settings, source=ListTrajectorySource(data))

    async def train(learner: Learner) -> None:
        async with learner:
            await learner.wait()

    started = time.perf_counter()
    asyncio.run(train(learner))
    wall = time.perf_counter() - started
    st = learner.stats
    steady_tokens = st.processed_tokens - st.first_step_tokens
    steady_seconds = st.step_seconds - st.first_step_seconds
    folder = st.checkpoints[-1] if st.checkpoints else None
    layout_ok = False
    if isinstance(folder, Path):
        read_layout(folder, read_layout(model))  # raises with the difference
        layout_ok = True
    result = {
        "engine": engine, "param_dtype": dtype or "float32", "steps": st.steps, "tokens": st.processed_tokens,
        "trained_tokens": st.trained_tokens, "step_seconds": round(st.step_seconds, 3), "wall_seconds": round(wall, 3),
        "first_step_seconds": round(st.first_step_seconds, 3),
        "tokens_per_s": round(st.processed_tokens / st.step_seconds, 1) if st.step_seconds else None,
        "steady_tokens_per_s": round(steady_tokens / steady_seconds, 1) if steady_seconds > 0 else None,
        "first_loss": st.first_metrics.get("loss"), "first_grad_norm": st.first_metrics.get("grad_norm"),
        "last_loss": st.last_metrics.get("loss"), "last_grad_norm": st.last_metrics.get("grad_norm"),
        "losses_finite": all(math.isfinite(m.get("loss", math.nan)) for m in (st.first_metrics, st.last_metrics)),
        "checkpoint_layout_ok": layout_ok,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
    }
    del learner
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    log(f"{name}: {result['steps']} steps, {result['tokens_per_s']} tokens/s "
        f"(steady {result['steady_tokens_per_s']}), first loss {result['first_loss']}")
    return result


def agree(a: float | None, b: float | None) -> bool:
    """Whether two first-step numbers agree within ``AGREE_REL`` (absolute near zero)."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= AGREE_REL * max(1.0, abs(a))


def main(argv: list[str] | None = None) -> int:
    """Run the check; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="the tiny model and short sequences (CPU smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per engine (default 8; 2 with --small)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--engines", default=None, help="comma separated (default hf,fsdp and fsdp-bf16 on cuda)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.small else 8)
    engines = (args.engines or ("hf,fsdp,fsdp-bf16" if args.device == "cuda" else "hf,fsdp")).split(",")
    stubbed = stand_in_for_ray()
    log(f"python {platform.python_version()}; ray {'stand-in' if stubbed else 'installed'}")

    import torch
    import transformers
    from trajectories import groups

    if args.device == "cuda" and not torch.cuda.is_available():
        log("CUDA is not available to this torch")
        return 2
    log(f"torch {torch.__version__}, transformers {transformers.__version__}")
    # Sequence shape per trajectory and the step size: about 33k tokens a step on the GPU.
    prompt_len, completion_len, group_size = (24, 16, 4) if args.small else (512, 512, 8)
    args.groups_per_step = 2 if args.small else 4
    args.token_budget = 8192 if args.small else 16384
    data = groups(args.groups_per_step * args.steps, group_size, prefix="gpu", prompt_len=prompt_len,
                  completion_len=completion_len)
    report: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "ray_stand_in": stubbed,
        "shape": "small" if args.small else "moderate", "steps": args.steps, "group_size": group_size,
        "groups_per_step": args.groups_per_step, "prompt_len": prompt_len, "completion_len": completion_len,
        "engines": {}, "checks": {},
    }
    ok = True
    with tempfile.TemporaryDirectory(prefix="openforge-gpu-check-") as tmp:
        work = Path(tmp)
        model = make_model(work / "models", "small" if args.small else "moderate", sys.executable)
        for name in engines:
            try:
                report["engines"][name] = run_engine(name, model, data, args, work / "checkpoints")
            except Exception as exc:  # report every engine, then fail
                log(f"{name} FAILED: {exc!r}")
                report["engines"][name] = {"error": repr(exc)}
                ok = False
    results = report["engines"]
    for name, result in results.items():
        report["checks"][f"{name}_finite"] = bool(result.get("losses_finite"))
        report["checks"][f"{name}_checkpoint_layout"] = bool(result.get("checkpoint_layout_ok"))
    if "hf" in results and "fsdp" in results:
        hf, fsdp = results["hf"], results["fsdp"]
        report["checks"]["first_step_loss_agrees"] = agree(hf.get("first_loss"), fsdp.get("first_loss"))
        report["checks"]["first_step_grad_norm_agrees"] = agree(hf.get("first_grad_norm"), fsdp.get("first_grad_norm"))
    ok = ok and all(report["checks"].values())
    report["ok"] = ok
    header = f"{'engine':12} {'dtype':9} {'steps':>5} {'tokens':>9} {'seconds':>8} {'tokens/s':>10} {'steady':>10} " \
             f"{'first loss':>11} {'grad norm':>10} {'peak GiB':>8}"
    lines = [header]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:12} ERROR {r['error'][:100]}")
            continue
        lines.append(f"{name:12} {r['param_dtype']:9} {r['steps']:5d} {r['tokens']:9d} {r['step_seconds']:8.2f} "
                     f"{r['tokens_per_s'] or 0:10.0f} {r['steady_tokens_per_s'] or 0:10.0f} "
                     f"{r['first_loss']:11.6f} {r['first_grad_norm']:10.4f} {r['peak_memory_gib'] or 0:8.2f}")
    lines += [f"check {k}: {'ok' if v else 'FAILED'}" for k, v in report["checks"].items()]
    lines.append(f"learner GPU check: {'PASSED' if ok else 'FAILED'}")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "learner_gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
