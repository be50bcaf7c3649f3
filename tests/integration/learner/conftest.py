"""The tiny model the learner trains in tests (made once, cached; the same folder vLLM serves)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from openforge.engine import make_tiny_model
from stream.broker import cache_root


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")
