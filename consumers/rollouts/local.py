"""The local backend: each rollout is a process group on this machine.

It keeps the Kubernetes backend's contract (same environment, verifier after harness, same
lifecycle events) so the one-machine demo and the tests exercise the launcher exactly as a
cluster would. Unlike a pod, a process has no API server that remembers it, so the backend keeps
one folder per rollout under a state directory: that folder is what makes ``launch`` idempotent
and lets a restarted launcher know what already exists.

State folder of one rollout (``<state_dir>/<rollout_id>/``)::

    rollout.json   who it is (task, group, harness), written before the folder appears
    process.json   process group id and start time of the running harness or verifier
    terminal.json  the terminal lifecycle event, and whether Kafka acknowledged it
    harness.log    harness stdout and stderr
    verifier.log   verifier stdout and stderr
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from consumers.rollouts.backend import ENV_REWARD_URL, ENV_VERIFIER_TOKEN, RolloutSpec, harness_argv
from schemas.failures import classify
from schemas.rollout.v1 import Backend, RolloutEventV1, RolloutPhase, RolloutReason
from stream.producer import EventProducer
from stream.telemetry import count_rollout_outcome
from stream.topics import ROLLOUTS

__all__ = ["LocalBackend", "inherited_environment"]

logger = logging.getLogger(__name__)

_ROLLOUT_FILE = "rollout.json"
_PROCESS_FILE = "process.json"
_TERMINAL_FILE = "terminal.json"
_LOG_TAIL_BYTES = 2000

Outcome = Literal["exited", "deadline", "stopped"]


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the launcher's own environment a rollout process may inherit.

    Everything named ``OPENFORGE_*`` is dropped: the launcher's environment holds the credential
    signing key, and a harness that inherited it could mint itself a verifier token. Vendor
    names the launcher sets per rollout (base URLs, API keys) are overwritten by the spec.
    """
    return {k: v for k, v in environ.items() if not k.startswith("OPENFORGE_")}


@dataclass(frozen=True)
class _Identity:
    """What lifecycle events need to name a rollout, kept on disk for restarts."""

    rollout_id: str
    task_id: str
    run_id: str | None
    group_index: int
    group_size: int
    harness: str

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__)

    @classmethod
    def from_json(cls, data: bytes) -> _Identity:
        return cls(**orjson.loads(data))


class LocalBackend:
    """Run rollouts as local process groups and publish their lifecycle events.

    The backend is its own watcher: it publishes ``running`` and the terminal event of every
    rollout it starts (the launcher publishes ``scheduled``). A rollout is one harness process
    group in a fresh temporary workspace (or the task's ``workdir``), then, if the harness exited
    0, one verifier process group in the same workspace, both within the task deadline.
    """

    kind = Backend.LOCAL

    def __init__(
        self,
        producer: EventProducer,
        state_dir: Path,
        *,
        workspace_root: Path | None = None,
        keep_workspaces: bool = False,
        kill_grace_s: float = 5.0,
        base_environ: Mapping[str, str] | None = None,
    ) -> None:
        """Create the backend.

        Args:
            producer: Started producer for lifecycle events (owned by the caller).
            state_dir: Folder holding one sub-folder per rollout; keep it across restarts.
            workspace_root: Where temporary workspaces are made (system default when None).
            keep_workspaces: Leave temporary workspaces behind for inspection.
            kill_grace_s: Time between SIGTERM and SIGKILL of a process group at a deadline.
            base_environ: Environment processes inherit (minus ``OPENFORGE_*``); the launcher's
                own environment when None.
        """
        self._producer = producer
        self.state_dir = state_dir
        self._workspace_root = workspace_root
        self._keep_workspaces = keep_workspaces
        self._kill_grace_s = kill_grace_s
        self._base_env = inherited_environment(os.environ if base_environ is None else base_environ)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._existing: set[str] = set()
        self._stopping = asyncio.Event()
        self._started = False
        self._stopped = False

    async def start(self) -> None:
        """Load what exists, settle rollouts a previous process left behind, and be ready.

        A rollout without a terminal record was running when its launcher died. Its process
        cannot be supervised again (its exit code went to the dead parent), so it is stopped and
        reported ``failed`` as an infrastructure failure rather than left running unobserved. A
        terminal event that Kafka never acknowledged is published again, with its original id.
        """
        if self._started:
            return
        self._started = True
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._workspace_root is not None:
            self._workspace_root.mkdir(parents=True, exist_ok=True)
        for folder in sorted(self.state_dir.iterdir()):
            if folder.name.startswith(".") or not (folder / _ROLLOUT_FILE).is_file():
                shutil.rmtree(folder, ignore_errors=True)  # half-made by a crash during launch (see launch())
                continue
            self._existing.add(folder.name)
            await self._settle_previous(folder)

    async def stop(self) -> None:
        """Terminate running rollouts, reporting each ``cancelled`` with reason ``shutdown``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def launch(self, spec: RolloutSpec) -> bool:
        """Create the rollout's state folder and start supervising it; False if it existed."""
        if self._stopping.is_set():
            raise RuntimeError("the local backend is stopped")
        final = self.state_dir / spec.rollout_id
        identity = _Identity(spec.rollout_id, spec.task.task_id, spec.task.run_id, spec.group_index,
                             spec.task.group_size, spec.task.harness.name)
        # The folder appears atomically with its identity file: renaming onto an existing
        # non-empty folder fails, so two launches of one rollout cannot both win.
        staging = self.state_dir / f".{spec.rollout_id}.{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        (staging / _ROLLOUT_FILE).write_bytes(identity.to_json())
        try:
            if final.exists():
                raise FileExistsError(final)
            staging.rename(final)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if final.exists():
                return False
            raise
        self._existing.add(spec.rollout_id)
        self._tasks[spec.rollout_id] = asyncio.create_task(
            self._supervise(spec, identity, final), name=f"rollout:{spec.rollout_id}")
        return True

    async def active(self) -> set[str]:
        """Rollouts this process is supervising that have not finished."""
        return {rid for rid, task in self._tasks.items() if not task.done()}

    async def existing(self) -> set[str]:
        """Every rollout with a state folder, finished or not, including earlier processes' ones."""
        return set(self._existing)

    async def wait_idle(self) -> None:
        """Return once every rollout started so far has finished (tests, draining)."""
        while pending := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.wait(pending)

    # -- one rollout ---------------------------------------------------------------------------

    async def _supervise(self, spec: RolloutSpec, who: _Identity, folder: Path) -> None:
        try:
            event = await self._run(spec, who, folder)
        except Exception as exc:
            logger.exception("rollout %s: supervision failed", spec.rollout_id)
            event = self._event(who, RolloutPhase.FAILED, reason=RolloutReason.OTHER,
                                message=f"the local backend failed to run the rollout: {exc!r}")
        await self._finish(folder, event)

    async def _run(self, spec: RolloutSpec, who: _Identity, folder: Path) -> RolloutEventV1:
        launch = spec.task.harness.launch
        if launch.kind == "container":
            return self._event(
                who, RolloutPhase.FAILED, reason=RolloutReason.OTHER,
                message=(f"harness {spec.task.harness.name!r} is a container launch (image {launch.image!r}); "
                         "it needs the kubernetes backend (OPENFORGE_LAUNCHER_BACKEND=kubernetes)"))
        if spec.task.environment_image is not None:
            logger.warning("rollout %s: the local backend ignores environment_image %r and uses this host",
                           spec.rollout_id, spec.task.environment_image)
        deadline = time.monotonic() + spec.deadline_s
        temporary = launch.workdir is None
        workspace = Path(launch.workdir) if launch.workdir is not None else Path(
            tempfile.mkdtemp(prefix=f"{spec.rollout_id}-", dir=self._workspace_root))
        try:
            workspace.mkdir(parents=True, exist_ok=True)
            harness_env = {**self._base_env, **spec.harness_env}
            # Defence in depth: whatever the spec says, the harness never holds the verifier's credential.
            harness_env.pop(ENV_VERIFIER_TOKEN, None)
            harness_env.pop(ENV_REWARD_URL, None)
            try:
                harness = await self._spawn(harness_argv(spec.task), workspace, harness_env,
                                            folder / "harness.log", folder)
            except OSError as exc:
                return self._event(who, RolloutPhase.FAILED, reason=RolloutReason.OTHER,
                                   message=f"harness command {launch.command[0]!r} could not start: {exc}")
            await self._publish(self._event(who, RolloutPhase.RUNNING))
            outcome = await self._wait(harness, deadline - time.monotonic())
            if outcome == "stopped":
                return self._event(who, RolloutPhase.CANCELLED, reason=RolloutReason.SHUTDOWN,
                                   message="the launcher shut down while the harness ran")
            if outcome == "deadline":
                return self._event(who, RolloutPhase.TIMED_OUT, reason=RolloutReason.DEADLINE_EXCEEDED,
                                   message=f"the harness ran past the task deadline of {spec.deadline_s:g}s")
            code = harness.returncode
            assert code is not None
            if code != 0:
                return self._event(who, RolloutPhase.FAILED, reason=RolloutReason.EXIT_CODE, harness_exit_code=code,
                                   message=f"the harness exited with {code}: {_tail(folder / 'harness.log')}")
            return await self._verify(spec, who, folder, workspace, deadline)
        finally:
            if temporary and not self._keep_workspaces:
                shutil.rmtree(workspace, ignore_errors=True)

    async def _verify(self, spec: RolloutSpec, who: _Identity, folder: Path, workspace: Path,
                      deadline: float) -> RolloutEventV1:
        verifier = spec.task.verifier
        env = {**self._base_env, **spec.verifier_env}
        try:
            process = await self._spawn(verifier.command, workspace, env, folder / "verifier.log", folder)
        except OSError as exc:
            return self._event(who, RolloutPhase.FAILED, reason=RolloutReason.VERIFIER_FAILED, harness_exit_code=0,
                               message=f"verifier command {verifier.command[0]!r} could not start: {exc}")
        remaining = deadline - time.monotonic()
        own_limit = verifier.timeout_s is not None and verifier.timeout_s < remaining
        outcome = await self._wait(process, verifier.timeout_s if own_limit and verifier.timeout_s else remaining)
        if outcome == "stopped":
            return self._event(who, RolloutPhase.CANCELLED, reason=RolloutReason.SHUTDOWN, harness_exit_code=0,
                               message="the launcher shut down while the verifier ran")
        if outcome == "deadline" and own_limit:
            return self._event(who, RolloutPhase.FAILED, reason=RolloutReason.VERIFIER_FAILED, harness_exit_code=0,
                               message=f"the verifier ran past its own timeout of {verifier.timeout_s:g}s")
        if outcome == "deadline":
            return self._event(who, RolloutPhase.TIMED_OUT, reason=RolloutReason.DEADLINE_EXCEEDED,
                               harness_exit_code=0,
                               message=f"the verifier ran past the task deadline of {spec.deadline_s:g}s")
        code = process.returncode
        assert code is not None
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
            return self._event(who, RolloutPhase.FAILED, reason=RolloutReason.VERIFIER_FAILED, harness_exit_code=0,
                               verifier_exit_code=code,
                               message=f"the verifier {how}: {_tail(folder / 'verifier.log')}")
        return self._event(who, RolloutPhase.SUCCEEDED, harness_exit_code=0, verifier_exit_code=0)

    async def _spawn(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path,
                     folder: Path) -> asyncio.subprocess.Process:
        with log.open("ab") as out:
            # A session of its own: the whole group (harness and its children) can be killed at once,
            # and a Ctrl-C aimed at the launcher does not hit the rollouts behind its back.
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        (folder / _PROCESS_FILE).write_bytes(orjson.dumps(
            {"pgid": process.pid, "start_ticks": _start_ticks(process.pid)}))
        return process

    async def _wait(self, process: asyncio.subprocess.Process, timeout_s: float) -> Outcome:
        exited = asyncio.ensure_future(process.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({exited, stopping}, timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if exited.done():
            return "exited"
        outcome: Outcome = "stopped" if self._stopping.is_set() else "deadline"
        await self._kill_group(process, exited)
        return outcome

    async def _kill_group(self, process: asyncio.subprocess.Process, exited: asyncio.Future[int]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        done, _ = await asyncio.wait({exited}, timeout=self._kill_grace_s)
        if not done:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await exited
        # Children that ignored SIGTERM outlive their leader; the group id still reaches them.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    # -- events and state ----------------------------------------------------------------------

    def _event(self, who: _Identity, phase: RolloutPhase, reason: RolloutReason | None = None,
               **fields: object) -> RolloutEventV1:
        # Whether the policy is to blame is the taxonomy's call, the same as the pod watcher's.
        failure = classify(phase, reason) if phase.is_terminal else None
        return RolloutEventV1.model_validate({
            "rollout_id": who.rollout_id, "task_id": who.task_id, "run_id": who.run_id,
            "group_index": who.group_index, "group_size": who.group_size, "harness": who.harness,
            "phase": phase, "reason": reason, "backend": Backend.LOCAL,
            "infrastructure_failure": failure is not None and failure.is_infrastructure, **fields})

    async def _finish(self, folder: Path, event: RolloutEventV1) -> None:
        # The terminal record is written before publishing, so a crash in between is repaired at
        # the next start by re-publishing the same event (same id: consumers drop the duplicate).
        record = folder / _TERMINAL_FILE
        record.write_bytes(orjson.dumps({"published": False, "event": event.model_dump(mode="json")}))
        with contextlib.suppress(FileNotFoundError):
            (folder / _PROCESS_FILE).unlink()
        if await self._publish(event):
            record.write_bytes(orjson.dumps({"published": True, "event": event.model_dump(mode="json")}))
        count_rollout_outcome(event.phase.value, event.reason.value if event.reason else None,
                              event.infrastructure_failure)
        logger.info("rollout %s: %s%s", event.rollout_id, event.phase.value,
                    f" ({event.reason.value}: {event.message})" if event.reason else "")

    async def _publish(self, event: RolloutEventV1) -> bool:
        try:
            await self._producer.publish(ROLLOUTS, event)
        except Exception:
            logger.exception("rollout %s: could not publish its %s event", event.rollout_id, event.phase.value)
            return False
        return True

    async def _settle_previous(self, folder: Path) -> None:
        record = folder / _TERMINAL_FILE
        if record.is_file():
            data = orjson.loads(record.read_bytes())
            if not data["published"]:
                event = RolloutEventV1.model_validate(data["event"])
                if await self._publish(event):
                    record.write_bytes(orjson.dumps({"published": True, "event": data["event"]}))
            return
        who = _Identity.from_json((folder / _ROLLOUT_FILE).read_bytes())
        message = "the launcher stopped while this rollout ran; its processes were ended on restart"
        process = folder / _PROCESS_FILE
        if process.is_file():
            info = orjson.loads(process.read_bytes())
            pgid = int(info["pgid"])
            # Only signal the group if its leader is the very process we started (pids are reused).
            if _start_ticks(pgid) == info["start_ticks"] and info["start_ticks"] is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        else:
            message = "the launcher stopped before this rollout's process started"
        await self._finish(folder, self._event(who, RolloutPhase.FAILED, reason=RolloutReason.SHUTDOWN,
                                               message=message))


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to recognise it after a restart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 counts from after the parenthesised command name, which may itself hold spaces.
    return int(stat.rpartition(")")[2].split()[19])


def _tail(log: Path) -> str:
    """The last line of a log, to put the cause of a failure into the lifecycle event."""
    try:
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - _LOG_TAIL_BYTES))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return lines[-1].strip()[:500] if lines else "(no output)"
