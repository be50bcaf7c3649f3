"""What a replica should hold after loading a checkpoint, and whether it does.

``reload_weights`` answers success and ``/weight_info`` shows whatever label the publisher sets: neither
says what the engine actually loaded. vLLM's ``POST /weight_checker {"action": "checksum"}`` does: a
SHA-256 of each parameter's bytes as the engine holds it. This module makes the same digests from a
checkpoint folder's safetensors (raw bytes, no tensor library) and compares the two.

The engine's parameters are not always the checkpoint's tensors:

* **Fused projections.** vLLM's Llama-family models hold ``q_proj``, ``k_proj`` and ``v_proj`` as one
  ``qkv_proj`` and ``gate_proj`` with ``up_proj`` as ``gate_up_proj``, concatenated along the first
  dimension, which for row-major tensors is their bytes one after the other: the digest of the
  fused parameter is made by hashing the parts' bytes in that order.
* **Repacked weights.** The CPU build moves linear layers' weights into packed copies of its own and
  leaves the parameter empty: such a digest (SHA-256 of nothing) says nothing and is skipped.
* **Sharded weights.** With tensor parallelism each rank holds a slice: a parameter whose ranks
  report different digests is a shard and is skipped; one they all report alike is compared.

What is compared then covers at least the embeddings, norms and biases on CPU, and every parameter on
one GPU. The expected digests are the learner's own where the folder carries them
(:data:`MANIFEST`, written as the checkpoint is saved, so bytes that changed on the way to the
engines are caught too), else made from the folder when it is published.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from consumers.checkpoint_files import CheckpointError, read_layout, weight_files

__all__ = ["EMPTY", "MANIFEST", "PACKED", "Verification", "expected_digests", "folder_digests", "verify",
           "write_manifest"]

MANIFEST = "weight_digests.json"
"""File of a checkpoint folder holding its digests in the engine's parameter names."""
EMPTY = hashlib.sha256(b"").hexdigest()
"""Digest of a parameter the engine holds elsewhere (repacked): nothing to compare."""
PACKED: Mapping[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                         "gate_up_proj": ("gate_proj", "up_proj")}
"""Fused engine parameters and the checkpoint tensors they concatenate, in order."""
_CHUNK = 16 << 20


def _tensor_spans(folder: Path) -> dict[str, tuple[Path, int, int]]:
    """Each tensor's file and absolute byte range."""
    spans: dict[str, tuple[Path, int, int]] = {}
    for file in weight_files(folder):
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        base = 8 + header_len
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                spans[name] = (file, base + begin, base + end)
    return spans


def _hash(spans: list[tuple[Path, int, int]]) -> str:
    digest = hashlib.sha256()
    for file, begin, end in spans:
        with file.open("rb") as handle:
            handle.seek(begin)
            left = end - begin
            while left:
                chunk = handle.read(min(_CHUNK, left))
                if not chunk:
                    raise CheckpointError(f"{file.name} ended before byte {end}")
                digest.update(chunk)
                left -= len(chunk)
    return digest.hexdigest()


def folder_digests(folder: Path) -> dict[str, str]:
    """The digests an engine that loaded ``folder`` reports, in its parameter names (see the module docstring).

    Raises:
        CheckpointError: the folder holds no safetensors files, or a malformed one.
    """
    read_layout(folder)  # a malformed file is refused with what is wrong, before its bytes are read
    spans = _tensor_spans(folder)
    digests: dict[str, str] = {}
    fused: set[str] = set()
    for name in spans:
        for engine_name, parts in PACKED.items():
            head, dot, tail = name.partition(f".{parts[0]}.")
            if not dot:
                continue
            names = [f"{head}.{part}.{tail}" for part in parts]
            if all(n in spans for n in names):
                digests[f"{head}.{engine_name}.{tail}"] = _hash([spans[n] for n in names])
                fused.update(names)
    for name, span in spans.items():
        if name not in fused:
            digests[name] = _hash([span])
    return digests


def write_manifest(folder: Path) -> Path:
    """Record ``folder``'s digests in it (the learner, right after writing the weights); returns the file."""
    path = folder / MANIFEST
    path.write_text(json.dumps({"algorithm": "sha256", "parameters": folder_digests(folder)}, sort_keys=True))
    return path


def expected_digests(folder: Path) -> tuple[dict[str, str], bool]:
    """The digests a replica must report after loading ``folder``, and whether they are the learner's own.

    Raises:
        CheckpointError: the manifest is unreadable, or the folder holds no readable weights.
    """
    path = folder / MANIFEST
    if not path.is_file():
        return folder_digests(folder), False
    try:
        data = json.loads(path.read_text())
        parameters = data["parameters"]
        if data.get("algorithm") != "sha256" or not isinstance(parameters, dict):
            raise ValueError("not a sha256 manifest")
        return {str(k): str(v) for k, v in parameters.items()}, True
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid weight digest manifest: {exc}") from exc


@dataclass(frozen=True)
class Verification:
    """The engine's digests against the expected ones."""

    checked: int
    """Parameters compared."""
    mismatched: list[str]
    """Names of the compared parameters whose digests differ."""
    skipped: int
    """Parameters the engine holds repacked or sharded, or that the checkpoint does not name."""

    @property
    def ok(self) -> bool:
        """At least one parameter compared, and every compared one equal."""
        return self.checked > 0 and not self.mismatched


def verify(engine: Mapping[str, str], expected: Mapping[str, str]) -> Verification:
    """Compare ``/weight_checker`` checksums (keys ``dp0:pp0:pcp0:tp0:<name>``) with ``expected``."""
    by_name: dict[str, set[str]] = {}
    for key, digest in engine.items():
        by_name.setdefault(key.split(":")[-1], set()).add(digest)
    checked, skipped, mismatched = 0, 0, []
    for name, digests in sorted(by_name.items()):
        if len(digests) != 1 or EMPTY in digests or name not in expected:
            skipped += 1
            continue
        checked += 1
        if next(iter(digests)) != expected[name]:
            mismatched.append(name)
    return Verification(checked, mismatched, skipped)
