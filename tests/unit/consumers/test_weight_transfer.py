"""The weight transfer's plan and checks, with no engine: buckets, the declared-versus-sent check,
and digests of streamed tensors equal to the folder's (fused engine parameters included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from consumers.weight_digests import folder_digests
from consumers.weight_transfer import FolderSource, StreamDigests, TensorMeta, TransferError, _checked, buckets


def _folder(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    layer = "model.layers.0"
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 16),
        f"{layer}.self_attn.q_proj.weight": torch.randn(16, 16),
        f"{layer}.self_attn.k_proj.weight": torch.randn(8, 16),
        f"{layer}.self_attn.v_proj.weight": torch.randn(8, 16),
        f"{layer}.self_attn.q_proj.bias": torch.randn(16),
        f"{layer}.self_attn.k_proj.bias": torch.randn(8),
        f"{layer}.self_attn.v_proj.bias": torch.randn(8),
        f"{layer}.mlp.gate_proj.weight": torch.randn(32, 16),
        f"{layer}.mlp.up_proj.weight": torch.randn(32, 16),
        f"{layer}.mlp.down_proj.weight": torch.randn(16, 32),
        "model.norm.weight": torch.randn(16),
    }
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_buckets_keep_order_and_limit_and_a_large_tensor_goes_alone() -> None:
    meta = [TensorMeta(f"t{i}", "bfloat16", (n,)) for i, n in enumerate([10, 20, 100, 5, 5, 30])]
    plan = buckets(meta, limit_bytes=60)
    assert [[m.name for m in b] for b in plan] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert all(sum(m.nbytes for m in b) <= 60 for b in plan if len(b) > 1)
    assert [m for b in plan for m in b] == meta


def test_streamed_digests_equal_the_folders_in_the_engines_names(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    source = FolderSource(folder)
    meta = source.metadata()
    assert {m.dtype for m in meta} == {"bfloat16"}
    digests = StreamDigests([m.name for m in meta])
    for bucket in buckets(meta, limit_bytes=1024):
        for name, tensor in _checked(source.tensors([m.name for m in bucket]), bucket):
            digests.add(name, tensor)
    expected = folder_digests(folder)
    assert "model.layers.0.self_attn.qkv_proj.weight" in expected
    assert "model.layers.0.mlp.gate_up_proj.weight" in expected
    assert digests.digests == expected
    assert digests.bytes == sum(m.nbytes for m in meta)


def test_a_tensor_other_than_declared_stops_the_transfer(tmp_path: Path) -> None:
    source = FolderSource(_folder(tmp_path))
    declared = source.metadata()[:2]
    wrong = [declared[0], TensorMeta(declared[1].name, "float32", declared[1].shape)]
    with pytest.raises(TransferError, match="declared"):
        list(_checked(source.tensors([m.name for m in declared]), wrong))
    with pytest.raises(TransferError, match="1 of the 2"):
        list(_checked(source.tensors([declared[0].name]), declared))
