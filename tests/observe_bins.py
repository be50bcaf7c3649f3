"""The Prometheus and Jaeger binaries, built once by their install scripts (a test fails if a build fails)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _install(name: str) -> Path:
    proc = subprocess.run(["bash", str(SCRIPTS / name / "install.sh")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/{name}/install.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def prometheus_binary() -> Path:
    return _install("prometheus") / "prometheus"


def promtool_binary() -> Path:
    return _install("prometheus") / "promtool"


def jaeger_binary() -> Path:
    return _install("jaeger") / "jaeger"
