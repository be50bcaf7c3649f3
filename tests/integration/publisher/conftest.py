"""Two real vLLM (CPU build) replicas of the tiny model, shared by the module, and checkpoint folders."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from netutil import free_port

from consumers.checkpoint_files import write_scaled_copy
from openforge.engine import LocalEngine, install_vllm, make_tiny_model
from stream.broker import cache_root


@dataclass
class Checkpoints:
    """Folders the tests publish: the served weights again, two changed copies, and broken ones."""

    base: Path
    same: Path
    scaled: Path
    scaled_more: Path
    truncated: Path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalEngine]]:
    """Two replicas started side by side (30-70 s on a busy machine); restartable by the tests."""
    python = install_vllm()
    model = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
    logs = tmp_path_factory.mktemp("replicas")
    pair = [LocalEngine(model, free_port(), python, logs / f"replica{i}.log") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(engine.start) for engine in pair]:
                future.result()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture(scope="module")
def checkpoints(engines: list[LocalEngine], tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    base = engines[0].model_dir
    root = tmp_path_factory.mktemp("checkpoints")
    write_scaled_copy(base, root / "same", 1.0)
    truncated = write_scaled_copy(base, root / "truncated", 1.0)
    file = truncated / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return Checkpoints(base=base, same=root / "same", scaled=write_scaled_copy(base, root / "scaled", 3.0, tensor_suffix="lm_head.weight"),
                       scaled_more=write_scaled_copy(base, root / "scaled_more", 5.0), truncated=truncated)


_VERSIONS = itertools.count(1)


@pytest.fixture
def versions() -> itertools.count[int]:
    """Weight versions that keep growing across the module's tests (the replicas keep theirs)."""
    return _VERSIONS
