"""Every long-lived ``openforge`` command starts as a real process, stays up, and drains on SIGTERM.

In-process tests build components inside a running event loop; a command builds them from its
own ``main``. This catches what only the process sees: settings read from the environment, clients
created outside a loop, signal handling and the exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openforge.engine import make_tiny_model
from stream import KafkaSettings, TopicRegistry
from stream.broker import cache_root, free_port

pytestmark = pytest.mark.kafka

UP_FOR_S = 6.0
"""A process still running after this long has got past its start-up."""


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return make_tiny_model(Path(sys.executable), cache_root() / "models" / "tiny-qwen2-seed0")


def commands(tmp: Path, model: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    engine = f"http://127.0.0.1:{free_port()}"  # nothing listens: the processes must cope
    return {
        "proxy": (["proxy", "--port", str(free_port()), "--upstream", engine],
                  {"OPENFORGE_PROXY_SPOOL_DIR": str(tmp / "spool")}),
        "assembler": (["assembler"], {}),
        "launcher": (["launcher", "--backend", "local"], {"OPENFORGE_LAUNCHER_STATE_DIR": str(tmp / "state")}),
        "learner": (["learner"], {"OPENFORGE_LEARNER_MODEL_DIR": str(model),
                                  "OPENFORGE_LEARNER_CHECKPOINT_DIR": str(tmp / "ckpt")}),
        "publisher": (["publisher", "--replica", engine, "--model", "tiny"], {}),
        "ui": (["ui", "--port", str(free_port()), "--index", str(tmp / "ui.sqlite")], {}),
    }


@pytest.mark.parametrize("name", ["proxy", "assembler", "launcher", "learner", "publisher", "ui"])
def test_command_runs_until_sigterm_then_exits_cleanly(name: str, kafka_settings: KafkaSettings,
                                                       topics: TopicRegistry, tmp_path: Path,
                                                       tiny_model: Path) -> None:
    args, extra = commands(tmp_path, tiny_model)[name]
    env = {**os.environ, **extra, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "OPENFORGE_PROXY_CREDENTIAL_KEY": "k" * 32}
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "openforge", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + UP_FOR_S
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        # uvicorn re-raises a captured SIGTERM once its graceful shutdown is done, so the proxy and
        # the flight recorder end "killed by SIGTERM" after draining; every other process returns 0.
        clean = {0, -signal.SIGTERM} if name in ("proxy", "ui") else {0}
        assert code in clean, f"{name} exited with {code} after SIGTERM:\n{log.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", ["proxy", "assembler", "launcher", "learner", "publisher", "ui"])
def test_command_without_its_topics_stops_at_once_saying_how_to_create_them(
        name: str, kafka_settings: KafkaSettings, tmp_path: Path, tiny_model: Path) -> None:
    """A consumer subscribed to a missing topic would wait silently forever, and a proxy would journal
    calls for a topic nobody creates: the process must say so, in one line."""
    args, extra = commands(tmp_path, tiny_model)[name]
    env = {**os.environ, **extra, "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": f"missing{os.urandom(4).hex()}.",  # nothing was created here
           "OPENFORGE_PROXY_CREDENTIAL_KEY": "k" * 32}
    done = subprocess.run([sys.executable, "-m", "openforge", *args], env=env, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode != 0, output[-3000:]
    assert "not exist" in output and "openforge topics create" in output, output[-3000:]
    assert "Traceback" not in output and "Error: topic" in output, output[-3000:]
