"""The checkpoint folder check that runs before any engine is asked to load weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from pydantic import ValidationError

from consumers.checkpoint_files import CheckpointError, TensorInfo, local_path, read_layout, write_scaled_copy
from consumers.publisher import CheckpointPublisher, PublisherSettings


def _write(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], *, pad: bytes = b"") -> Path:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data + pad)
    return path


def _good(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "model.safetensors", {
        "model.embed_tokens.weight": ("F32", [2, 3], struct.pack("<6f", 1, 2, 3, 4, 5, 6)),
        "model.norm.weight": ("F32", [3], struct.pack("<3f", 1, 1, 1)),
    })
    return folder


def test_valid_folder_gives_its_layout(tmp_path: Path) -> None:
    layout = read_layout(_good(tmp_path / "ok"))
    assert layout == {"model.embed_tokens.weight": TensorInfo("F32", (2, 3)), "model.norm.weight": TensorInfo("F32", (3,))}


def test_missing_folder_and_empty_folder_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_layout(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors"):
        read_layout(tmp_path / "empty")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    file = _good(tmp_path / "t") / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="lies outside the file's data"):
        read_layout(tmp_path / "t")


def test_padded_file_and_garbage_header_are_refused(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    _write(tmp_path / "p" / "model.safetensors", {"w": ("F32", [1], b"\0\0\0\0")}, pad=b"x")
    with pytest.raises(CheckpointError, match="truncated or padded"):
        read_layout(tmp_path / "p")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_layout(tmp_path / "g")
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "model.safetensors").write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CheckpointError, match="exceeds the file"):
        read_layout(tmp_path / "h")


def test_shape_that_does_not_match_its_bytes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    _write(tmp_path / "s" / "model.safetensors", {"w": ("F32", [2], b"\0\0\0\0")})
    with pytest.raises(CheckpointError, match="needs 8"):
        read_layout(tmp_path / "s")
    (tmp_path / "d").mkdir()
    _write(tmp_path / "d" / "model.safetensors", {"w": ("F31", [1], b"\0\0\0\0")})
    with pytest.raises(CheckpointError, match="unknown dtype"):
        read_layout(tmp_path / "d")


def test_layout_must_match_the_reference(tmp_path: Path) -> None:
    reference = read_layout(_good(tmp_path / "ref"))
    (tmp_path / "other").mkdir()
    _write(tmp_path / "other" / "model.safetensors", {
        "model.embed_tokens.weight": ("F32", [3, 2], struct.pack("<6f", 1, 2, 3, 4, 5, 6)),
        "model.norm.weight": ("F32", [3], struct.pack("<3f", 1, 1, 1)),
    })
    with pytest.raises(CheckpointError, match=r"different dtype/shape: \['model.embed_tokens.weight'\]"):
        read_layout(tmp_path / "other", reference)


def test_index_listing_a_missing_shard_is_refused(tmp_path: Path) -> None:
    folder = _good(tmp_path / "i")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors, which is missing"):
        read_layout(folder)


def test_uris(tmp_path: Path) -> None:
    assert local_path(str(tmp_path)) == tmp_path
    assert local_path(f"file://{tmp_path}") == tmp_path
    with pytest.raises(CheckpointError, match="absolute"):
        local_path("relative/ckpt")
    with pytest.raises(CheckpointError, match="scheme 's3'"):
        local_path("s3://bucket/ckpt")
    with pytest.raises(CheckpointError, match="remote host"):
        local_path("file://otherhost/ckpt")


def test_scaled_copy_changes_only_the_chosen_tensor(tmp_path: Path) -> None:
    source = _good(tmp_path / "src")
    dest = write_scaled_copy(source, tmp_path / "dst", 2.0)
    assert read_layout(dest) == read_layout(source)
    raw = (dest / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert struct.unpack("<6f", raw[8 + n:8 + n + 24]) == (2, 4, 6, 8, 10, 12)
    assert struct.unpack("<3f", raw[8 + n + 24:]) == (1, 1, 1)
    with pytest.raises(CheckpointError, match="no float32 tensor"):
        write_scaled_copy(source, tmp_path / "dst2", 2.0, tensor_suffix="lm_head.weight")


def test_publisher_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_PUBLISHER_REPLICAS", "http://a:1/, http://b:2")
    monkeypatch.setenv("OPENFORGE_PUBLISHER_MODEL", "m")
    settings = PublisherSettings()
    assert settings.replicas == ["http://a:1", "http://b:2"]
    with pytest.raises(ValidationError, match="repeat"):
        PublisherSettings(replicas=["http://a:1", "http://a:1/"])
    with pytest.raises(ValidationError, match="http:// or https://"):
        PublisherSettings(replicas=["a:1"])
    with pytest.raises(ValidationError, match="at least one"):
        PublisherSettings(replicas=[])
    with pytest.raises(ValueError, match="OPENFORGE_PUBLISHER_MODEL"):
        CheckpointPublisher(PublisherSettings(model=""))


def test_publisher_command_refuses_bad_settings_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from openforge.cli import main

    monkeypatch.delenv("OPENFORGE_PUBLISHER_MODEL", raising=False)
    result = CliRunner().invoke(main, ["publisher", "--replica", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "OPENFORGE_PUBLISHER_MODEL" in result.output
    result = CliRunner().invoke(main, ["publisher", "--replica", "127.0.0.1:1", "--model", "m"])
    assert result.exit_code == 1 and "must start with http://" in result.output
