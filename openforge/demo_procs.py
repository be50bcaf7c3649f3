"""Child processes of the one-machine demo: start with a log file each, watch, stop in order.

Every part runs as its own ``openforge <command>`` process, exactly as on a cluster where each is a
Deployment: a crash of one shows up as that process's exit (with its log tail), not as a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Child", "ChildExitedError"]


class ChildExitedError(RuntimeError):
    """A demo process exited while the demo still needed it."""


@dataclass
class Child:
    """One ``openforge`` subcommand running in its own process group."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_file: Path
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start ``python -m openforge <args>`` with the given extra environment."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", "openforge", *self.args], env={**os.environ, **self.env},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def check(self) -> None:
        """Raise if the process exited.

        Raises:
            ChildExitedError: it exited; the message holds its code and log tail.
        """
        if self._proc is not None and self._proc.poll() is not None:
            raise ChildExitedError(f"{self.name} exited with code {self._proc.returncode}; "
                                   f"last lines of {self.log_file}:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the process drains), SIGKILL after ``timeout_s``; idempotent. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def tail(self, lines: int = 30) -> str:
        """The last lines of the log."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"
