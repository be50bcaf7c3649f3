"""Digests of a checkpoint in the engine's parameter names, and their comparison with an engine's."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from consumers.checkpoint_files import CheckpointError
from consumers.weight_digests import EMPTY, MANIFEST, expected_digests, folder_digests, verify, write_manifest


def _floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _write(path: Path, tensors: dict[str, bytes]) -> None:
    header: dict[str, object] = {}
    data = b""
    for name, raw in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(raw) // 4], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


LAYER = "model.layers.0"
TENSORS = {
    "model.embed_tokens.weight": _floats(1, 2, 3, 4),
    f"{LAYER}.self_attn.q_proj.weight": _floats(1, 1),
    f"{LAYER}.self_attn.k_proj.weight": _floats(2),
    f"{LAYER}.self_attn.v_proj.weight": _floats(3),
    f"{LAYER}.self_attn.q_proj.bias": _floats(0.5),
    f"{LAYER}.self_attn.k_proj.bias": _floats(0.25),
    f"{LAYER}.self_attn.v_proj.bias": _floats(0.125),
    f"{LAYER}.mlp.gate_proj.weight": _floats(7),
    f"{LAYER}.mlp.up_proj.weight": _floats(8),
    f"{LAYER}.mlp.down_proj.weight": _floats(9),
}


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def test_fused_projections_hash_their_parts_in_the_engines_order(tmp_path: Path) -> None:
    # Split over two files, as a sharded checkpoint is: the parts of one fused parameter included.
    items = list(TENSORS.items())
    _write(tmp_path / "a.safetensors", dict(items[:3]))
    _write(tmp_path / "b.safetensors", dict(items[3:]))
    digests = folder_digests(tmp_path)
    attn = f"{LAYER}.self_attn"
    assert digests == {
        "model.embed_tokens.weight": _sha(TENSORS["model.embed_tokens.weight"]),
        f"{attn}.qkv_proj.weight": _sha(_floats(1, 1, 2, 3)),
        f"{attn}.qkv_proj.bias": _sha(_floats(0.5, 0.25, 0.125)),
        f"{LAYER}.mlp.gate_up_proj.weight": _sha(_floats(7, 8)),
        f"{LAYER}.mlp.down_proj.weight": _sha(_floats(9)),
    }


def test_the_learners_manifest_is_what_the_engine_is_checked_against(tmp_path: Path) -> None:
    _write(tmp_path / "model.safetensors", TENSORS)
    assert expected_digests(tmp_path) == (folder_digests(tmp_path), False)  # no manifest: the folder now
    write_manifest(tmp_path)
    _write(tmp_path / "model.safetensors", {**TENSORS, "model.embed_tokens.weight": _floats(0, 0, 0, 0)})
    expected, own = expected_digests(tmp_path)
    assert own and expected["model.embed_tokens.weight"] == _sha(TENSORS["model.embed_tokens.weight"])
    (tmp_path / MANIFEST).write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid weight digest manifest"):
        expected_digests(tmp_path)


def test_verify_compares_what_the_engine_holds_whole_and_skips_the_rest() -> None:
    expected = {"embed": "e", "norm": "n", "qkv": "q", "down": "d"}
    engine = {
        "dp0:pp0:pcp0:tp0:embed": "e", "dp0:pp0:pcp0:tp1:embed": "e",  # replicated on both ranks: compared
        "dp0:pp0:pcp0:tp0:norm": "n", "dp0:pp0:pcp0:tp1:norm": "x",    # ranks disagree: a shard, skipped
        "dp0:pp0:pcp0:tp0:qkv": "q0", "dp0:pp0:pcp0:tp1:qkv": "q1",    # a shard per rank: skipped
        "dp0:pp0:pcp0:tp0:down": EMPTY,                                # repacked by the CPU build: skipped
        "dp0:pp0:pcp0:tp0:rotary.inv_freq": "r",                        # not in the checkpoint: skipped
    }
    result = verify(engine, expected)
    assert (result.checked, result.mismatched, result.skipped) == (1, [], 4) and result.ok
    wrong = verify({"dp0:pp0:pcp0:tp0:embed": "other", "dp0:pp0:pcp0:tp0:norm": "n"}, expected)
    assert wrong.mismatched == ["embed"] and not wrong.ok
    assert not verify({"dp0:pp0:pcp0:tp0:down": EMPTY}, expected).ok  # nothing compared proves nothing
