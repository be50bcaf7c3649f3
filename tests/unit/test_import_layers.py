"""The packages depend on each other in one direction only (docs/architecture.md):

    schemas  <-  stream  <-  producers, consumers  <-  proxy, learner  <-  openforge

and ``schemas`` and ``stream`` import neither the web stack nor the learner's. Read from the source
(every import, at any depth, lazy ones included), so a crossing fails here before it lands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ALLOWED = {
    "schemas": set(),
    "stream": {"schemas"},
    "producers": {"schemas", "stream"},
    "consumers": {"schemas", "stream"},
    "proxy": {"schemas", "stream", "producers", "consumers"},
    "learner": {"schemas", "stream", "producers", "consumers"},
    "openforge": {"schemas", "stream", "producers", "consumers", "proxy", "learner"},
}
"""Which of the project's packages each package may import."""

FORBIDDEN_THIRD_PARTY = {
    "schemas": {"fastapi", "starlette", "uvicorn", "torch", "transformers", "verl", "aiokafka", "httpx"},
    "stream": {"fastapi", "starlette", "uvicorn", "torch", "transformers", "verl"},
}
"""Libraries a low layer must not pull in: whatever imports it would pay for them."""


def imports_of(package: str, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """Every absolute import in the package's modules: (file, line, top-level module)."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.extend((str(path.relative_to(root)), node.lineno, name.split(".")[0]) for name in names)
    return found


def crossings(package: str, root: Path = ROOT) -> list[str]:
    """The imports of ``package`` that go to a project package it may not import."""
    return [f"{where}:{line} imports {top}" for where, line, top in imports_of(package, root)
            if top in ALLOWED and top != package and top not in ALLOWED[package]]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    crossing = crossings(package)
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("package", sorted(FORBIDDEN_THIRD_PARTY))
def test_low_layers_import_neither_the_web_nor_the_learner_stack(package: str) -> None:
    heavy = [f"{where}:{line} imports {top}" for where, line, top in imports_of(package)
             if top in FORBIDDEN_THIRD_PARTY[package]]
    assert not heavy, "\n".join(heavy)


def test_the_check_finds_a_lazy_crossing(tmp_path: Path) -> None:
    # As the reward client once did: a producer reaching into consumers, here inside a function.
    (tmp_path / "producers").mkdir()
    (tmp_path / "producers" / "client.py").write_text(
        "import os\n\ndef f():\n    from consumers.rollouts.backend import ENV_REWARD_URL\n")
    assert crossings("producers", tmp_path) == ["producers/client.py:4 imports consumers"]
