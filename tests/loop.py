"""The whole learning loop as real processes, for tests that judge how it runs for many steps.

A vLLM server (CPU build, the tiny model) of its own, since the publisher reloads its weights; the
proxy, assembler, learner, publisher and launcher (local backend) each as ``openforge <command>``;
tasks whose harness makes one short call and whose verifier scores it. The learner gets exactly
the environment a test names (besides where its model and checkpoints are), so the settings under
test are the learner's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from openforge.engine import LocalEngine, install_vllm, make_tiny_model
from proxy.settings import POLICY_SAMPLING
from schemas import TaskV1
from stream.broker import cache_root, free_port
from stream.settings import KafkaSettings

AGENTS = Path(__file__).resolve().parent / "agents"
MODEL = "tiny"


@dataclass
class Process:
    """One ``openforge`` command with its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class Loop:
    """The running loop: its engine, processes and where they log."""

    engine: LocalEngine
    model_dir: Path
    folder: Path
    processes: list[Process] = field(default_factory=list)

    def check(self) -> None:
        """Fail with the log tail of any process that exited."""
        for process in self.processes:
            process.check()

    def log(self, name: str) -> str:
        return next(p for p in self.processes if p.name == name).log.read_text(errors="replace")


def tasks(n: int, *, group_size: int, run_id: str, max_tokens: int = 2, timeout_s: float = 60.0) -> list[TaskV1]:
    """``n`` tasks of the one-call harness and the parity verifier."""
    return [TaskV1.model_validate({
        "task_id": f"{run_id}-{i}", "run_id": run_id, "instruction": f"Count to {i % 7 + 1}.",
        "harness": {"name": "one-call", "launch": {"kind": "local", "command": [
            sys.executable, str(AGENTS / "one_call_agent.py"), MODEL, str(max_tokens)]}},
        "verifier": {"command": [sys.executable, str(AGENTS / "length_verifier.py")]},
        "group_size": group_size, "timeout_s": timeout_s,
    }) for i in range(n)]


def _wait_ready(url: str, process: Process, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.check()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.3)
    raise AssertionError(f"{process.name} not ready at {url}:\n{process.tail()}")


@contextlib.contextmanager
def running_loop(kafka: KafkaSettings, folder: Path, learner_env: dict[str, str],
                 env_by_process: dict[str, dict[str, str]] | None = None) -> Iterator[Loop]:
    """Start engine and processes (learner with ``learner_env``); stop them all on exit.

    ``env_by_process`` adds variables to the named processes (e.g. the OpenTelemetry settings the
    chart gives each Deployment).
    """
    python = install_vllm()
    model_dir = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
    engine = LocalEngine(model_dir, free_port(), python, folder / "vllm.log")
    loop = Loop(engine, model_dir, folder)
    base = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
            "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
            "OPENFORGE_PROXY_CREDENTIAL_KEY": "loop-test-signing-key-0123456789",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proxy_port = free_port()
    commands: list[tuple[str, list[str], dict[str, str]]] = [
        ("proxy", ["proxy", "--port", str(proxy_port), "--upstream", engine.url],
         {"OPENFORGE_PROXY_SPOOL_DIR": str(folder / "spool"), "OPENFORGE_PROXY_SERVED_MODEL": str(model_dir),
          "OPENFORGE_PROXY_SAMPLING": json.dumps(POLICY_SAMPLING)}),
        ("assembler", ["assembler"], {}),
        ("learner", ["learner"], {"OPENFORGE_LEARNER_MODEL_NAME": MODEL, "OPENFORGE_LEARNER_MODEL_DIR": str(model_dir),
                                  "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(folder / "checkpoints"), **learner_env}),
        ("publisher", ["publisher", "--replica", engine.url, "--model", MODEL],
         {"OPENFORGE_PUBLISHER_REFERENCE_WEIGHTS": str(model_dir)}),
        ("launcher", ["launcher", "--backend", "local", "--proxy-url", f"http://127.0.0.1:{proxy_port}"],
         {"OPENFORGE_LAUNCHER_STATE_DIR": str(folder / "launcher-state"),
          "OPENFORGE_LAUNCHER_WORKSPACE_ROOT": str(folder / "workspaces")}),
    ]
    try:
        engine.start()
        for name, args, env in commands:
            log = folder / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "openforge", *args],
                    env={**base, **(env_by_process or {}).get(name, {}), **env}, stdout=out,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            process = Process(name, proc, log)
            loop.processes.append(process)
            if name == "proxy":
                _wait_ready(f"http://127.0.0.1:{proxy_port}/ready", process)
        yield loop
    finally:
        for process in reversed(loop.processes):
            process.stop()
        engine.stop()
