"""Random Qwen2-architecture models of released sizes, made locally (no download), for benchmarks
and GPU checks: the shapes of Qwen2.5-0.5B, 1.5B, 7B and 32B, with the tiny model's tokenizer
(its 4,096 ids fit any of these vocabularies), so an engine serves them and answers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "make_model", "parameters"]

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    "32b": {"hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
            "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False},
}
"""Released Qwen2.5 shapes (config.json of each), by size."""


def parameters(shape: dict[str, Any]) -> int:
    """Parameter count of a Qwen2 of ``shape`` (q/k/v biases included, tied embeddings counted once)."""
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if shape["tie_word_embeddings"] else 2) + h


def make_model(out: Path, size: str, *, tokenizer_from: Path, dtype: str = "bfloat16", seed: int = 0,
               layers: int | None = None) -> Path:
    """Save a randomly initialised Qwen2 of ``size`` (``layers`` overrides its depth) in ``dtype`` into ``out``.

    The config names ``dtype``, as a released model's does, so the learner's ``auto`` serving dtype
    and an engine's ``--dtype auto`` both pick it.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(SHAPES[size])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = Qwen2Config(max_position_embeddings=4096, **shape)  # type: ignore[no-untyped-call]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out, safe_serialization=True)
    from learner.workers.weights import CARRIED

    for name in CARRIED:  # tokenizer, chat template, generation config
        if (tokenizer_from / name).is_file() and not (out / name).exists():
            shutil.copy2(tokenizer_from / name, out / name)
    return out
