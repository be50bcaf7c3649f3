"""Tasks and programs for the rollout tests: the probe and echo agents under tests/agents."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from schemas import TaskV1

AGENTS = Path(__file__).resolve().parent / "agents"
PROBE = [sys.executable, str(AGENTS / "probe.py")]
ECHO_AGENT = [sys.executable, str(AGENTS / "echo_agent.py")]
CHECK_ANSWER = [sys.executable, str(AGENTS / "check_answer.py")]
KEY = b"test-signing-key-0123456789"


def task_dict(task_id: str = "task-1", *, harness: list[str] | None = None, verifier: list[str] | None = None,
              group_size: int = 1, timeout_s: float = 60.0, **extra: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "instruction": "say hello",
        "harness": {"name": "probe", "launch": {"kind": "local", "command": harness or ["true"]}},
        "verifier": {"command": verifier or ["true"]},
        "group_size": group_size,
        "timeout_s": timeout_s,
        **extra,
    }


def make_task(task_id: str = "task-1", **kwargs: Any) -> TaskV1:
    return TaskV1.model_validate(task_dict(task_id, **kwargs))


def log_lines(log: Path) -> list[tuple[str, str, float]]:
    """(rollout id, "start"|"end", time) lines a probe wrote."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        rollout, what, when = line.split()
        out.append((rollout, what, float(when)))
    return out
