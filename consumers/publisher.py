"""The checkpoint publisher: brings every vLLM replica to the newest checkpoint of its model.

The learner writes a checkpoint folder and a :class:`~schemas.CheckpointV1` event on the compacted
checkpoints topic. The publisher reads that topic and, on every replica, runs the sequence that
vLLM's dev-mode RL endpoints offer: pause (``mode=keep``: in-flight requests are frozen, not
lost), load the new weights (:mod:`consumers.weight_transfer`: the replica reads the folder, or
the weights arrive over NCCL), reset the prefix cache (its blocks were computed with the old
weights), set the weight version label, resume. Each attempt's
outcome becomes a :class:`~schemas.CheckpointAppliedV1` event on the same topic (keyed per replica).

Design points:

* **One task per replica.** A replica that is down, slow or restarting retries on its own backoff
  and never holds the others back.
* **Converge, don't replay.** A replica always goes to the newest checkpoint known; versions it
  missed while down are skipped. Before loading, ``GET /weight_info`` is read: a replica already on
  the version is left alone, so restarts of the publisher are idempotent. While idle each replica is
  checked every ``check_interval_s``, so one that restarted on its initial weights is caught up.
* **Start from the topic.** On start the compacted topic is read to its end without a consumer
  group, giving the newest checkpoint per model, then a group consumer follows new events. The
  publisher's own applied events arrive there too and are ignored.
* **Refuse malformed folders before any engine sees them.** A failed ``reload_weights`` leaves a
  vLLM engine broken (see :mod:`consumers.checkpoint_files`), so the folder is checked first; a
  bad checkpoint gets an error event per replica and the replicas keep their version.
* **Verify before labelling.** After the reload, still paused, the replica's own digests of its
  parameters (``/weight_checker``) are compared with the checkpoint's (see
  :mod:`consumers.weight_digests`); only then is the version label set, so the proxy never labels
  tokens with a version the replica did not verify. A replica that loaded something else is
  reloaded with the version it served before (its label unchanged) or, when that folder is not
  known, left paused: out of rotation, rather than serving weights nobody can name.
* **Always resume.** Once a pause was sent, resume is sent whatever happened after it, with
  retries, so a failed reload never leaves a replica paused (except as just said).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
from opentelemetry import metrics
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from consumers.checkpoint_files import CheckpointError, TensorInfo, local_path, read_layout
from consumers.weight_digests import Verification, expected_digests, verify
from consumers.weight_transfer import (
    Backend,
    DiskTransfer,
    NcclSettings,
    NcclTransfer,
    TensorSource,
    TransferError,
    WeightTransfer,
    timeouts,
)
from schemas import CheckpointAppliedV1, CheckpointV1, DecodeError
from schemas.backoff import Backoff
from stream.consumer import EventConsumer, Received
from stream.lifecycle import Managed
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.tooling import read_topic
from stream.topics import CHECKPOINTS, MissingTopicsError, TopicRegistry

_meter = metrics.get_meter("openforge.publisher")
publish_latency = _meter.create_histogram(
    "openforge.publisher.publish_latency", unit="s",
    description="Time to load one checkpoint into one vLLM replica (pause, reload, relabel, resume), by outcome.",
    explicit_bucket_boundaries_advisory=[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0])
applied = _meter.create_counter(
    "openforge.publisher.applied", unit="{checkpoint}",
    description="Checkpoint loads attempted on a replica, by outcome (ok, failed).")
verify_failures = _meter.create_counter(
    "openforge.publisher.verify_failures", unit="{checkpoint}",
    description="Loads whose parameters the replica reported different from the checkpoint's, by what "
                "followed (rolled_back, out_of_rotation).")

__all__ = ["CheckpointPublisher", "PublisherSettings", "ReplicaState"]

logger = logging.getLogger(__name__)


class PublisherSettings(BaseSettings):
    """Which replicas get which model's checkpoints, and how patiently (``OPENFORGE_PUBLISHER_*``)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_PUBLISHER_", frozen=True, extra="ignore")

    replicas: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Base URLs of the vLLM replicas serving the model (comma-separated in the environment).
    Each URL is also the replica's id in applied events."""

    model: str = ""
    """Model name whose checkpoints to publish (as the learner writes it in CheckpointV1.model).
    Checkpoints of other models on the topic are ignored. Required."""

    group_id: str = "openforge-publisher"
    """Kafka consumer group following new checkpoint events (the topic prefix goes in front)."""

    request_timeout_s: float = Field(default=30.0, gt=0)
    """Limit of each short engine call (weight_info, pause, version, resume), in seconds."""

    reload_timeout_s: float = Field(default=600.0, gt=0)
    """Limit of one ``reload_weights`` call (and of ``/finish_weight_update`` over NCCL, and of a
    ``/weight_checker`` checksum), in seconds; large models read for minutes."""

    transfer: Backend = "disk"
    """How weights reach a replica: ``disk`` (the replica reads the serving folder from storage it
    shares with the learner) or ``nccl`` (vLLM's weight-transfer endpoints; this process needs a
    GPU, and the replicas ``--weight-transfer-config '{"backend": "nccl"}'``)."""

    nccl: NcclSettings = Field(default_factory=NcclSettings)
    """The ``nccl`` backend (``OPENFORGE_PUBLISHER_NCCL_*``)."""

    retry_backoff_s: float = Field(default=0.5, gt=0)
    """Wait before retrying a replica after a failed attempt; doubles per failure."""

    retry_backoff_max_s: float = Field(default=10.0, gt=0)
    """Cap of that wait, so a replica that comes back is caught up within this long."""

    check_interval_s: float = Field(default=5.0, gt=0)
    """How often an idle replica's ``/weight_info`` is read to notice a restart on old weights."""

    resume_attempts: int = Field(default=5, ge=1)
    """Tries of ``/resume`` after a pause; a paused replica serves nobody, so it is retried hard."""

    max_reload_failures: int = Field(default=3, ge=1)
    """Reloads the engine itself rejects (an HTTP error, not an unreachable replica) before the
    replica gives up on that version and waits for a newer one."""

    validate_checkpoints: bool = True
    """Check the folder's safetensors headers before loading. Turn off only when the publisher
    cannot see the engines' storage."""

    verify_weights: bool = True
    """After each reload, compare the replica's parameter digests (vLLM's ``/weight_checker``, a
    development endpoint) with the checkpoint's before labelling it with the version. Needs the
    publisher to see the checkpoint folders; turn off only for engines without the endpoint."""

    reference_weights: Path | None = None
    """A folder with the served model's weights (what the replicas started from); checkpoints must
    match its tensor names, dtypes and shapes. Without it the first valid checkpoint sets the layout."""

    bootstrap_timeout_s: float = Field(default=30.0, gt=0)
    """Limit for reading the compacted topic to its end on start."""

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    """Kafka connection (``OPENFORGE_KAFKA_*``)."""

    @field_validator("replicas", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        if isinstance(value, list | tuple):
            return [str(u).strip().rstrip("/") for u in value]
        return value

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one replica URL is needed")
        if len(set(value)) != len(value):
            raise ValueError(f"replica URLs repeat: {value}")
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        return value


class _EngineRejected(RuntimeError):
    """The engine answered an RL endpoint with an error status (it is up, but refused)."""


class _NotVerified(_EngineRejected):
    """The replica loaded the folder and holds other parameters than the checkpoint's.

    Not retried: the same folder loads the same bytes again.
    """


@dataclass
class ReplicaState:
    """What the publisher knows about one replica (read by tests and metrics)."""

    url: str
    serving: int | None = None
    """Version the replica was last seen serving (None: unknown or its initial weights)."""
    reported: tuple[int, bool] | None = None
    """(version, ok) of the last applied event on the topic for this replica."""
    attempts: int = 0
    """Apply attempts so far (ok or not)."""
    failures: int = 0
    """Failed attempts so far."""
    verified: tuple[int, str] | None = None
    """(version, folder) of the last load the replica verified: what a failed one rolls back to."""
    out_of_rotation: bool = False
    """Left paused after a load that failed to verify and could not be rolled back."""


class CheckpointPublisher(Managed):
    """Consume checkpoint events and apply them to every replica; see the module docstring.

    Use as ``async with CheckpointPublisher(settings) as publisher: await publisher.wait()``. With
    the ``nccl`` backend, ``source`` gives the tensors of a version from its serving folder (default:
    the folder's safetensors; a process that holds the live model passes one that reads it).
    """

    def __init__(self, settings: PublisherSettings, *, registry: TopicRegistry | None = None,
                 source: Callable[[Path], TensorSource] | None = None) -> None:
        if not settings.model:
            raise ValueError("set the model whose checkpoints to publish (OPENFORGE_PUBLISHER_MODEL)")
        self.settings = settings
        self.registry = registry or TopicRegistry.from_settings(settings.kafka)
        self._topic = self.registry[CHECKPOINTS]
        self._producer = EventProducer(settings.kafka, registry=self.registry,
                                       client_id=f"{settings.kafka.client_id}-publisher")
        self._consumer = EventConsumer([CHECKPOINTS], self._on_event, group_id=settings.kafka.scoped(settings.group_id),
                                       kafka=settings.kafka, registry=self.registry,
                                       dead_letters=self._producer)
        self._http = httpx.AsyncClient(timeout=settings.request_timeout_s)
        self.transfer = self._make_transfer(source)
        self.replicas = {url: ReplicaState(url) for url in settings.replicas}
        self._wake = {url: asyncio.Event() for url in settings.replicas}
        self._tasks: list[asyncio.Task[None]] = []
        self._target: CheckpointV1 | None = None
        self._rejected: set[int] = set()
        self._layout: dict[str, TensorInfo] | None = None
        self._expected: dict[int, dict[str, str]] = {}  # the target's digests, by version
        self._stopping = asyncio.Event()
        self._started = False
        self._stopped = False

    def _make_transfer(self, source: Callable[[Path], TensorSource] | None) -> WeightTransfer:
        if self.settings.transfer == "nccl":
            return NcclTransfer(self._call, self.settings.nccl, request_timeout_s=self.settings.request_timeout_s,
                                finish_timeout_s=self.settings.reload_timeout_s, source=source)
        return DiskTransfer(self._call, self.settings.reload_timeout_s)

    @property
    def target(self) -> CheckpointV1 | None:
        """The newest valid checkpoint of the model, which every replica converges on."""
        return self._target

    async def start(self) -> None:
        """Read the compacted topic, start one task per replica, then follow new events."""
        if self._started:
            return
        self._started = True
        try:
            if self.settings.validate_checkpoints and self.settings.reference_weights is not None:
                self._layout = await asyncio.to_thread(read_layout, self.settings.reference_weights)
            await self._producer.start()
            newest = await self._bootstrap()
            if newest is not None:
                await self.offer(newest)
            for url in self.replicas:
                self._tasks.append(asyncio.create_task(self._replica_loop(url), name=f"publish:{url}"))
            await self._consumer.start()
        except BaseException:
            await self.stop()  # a missing topic, say: close what was opened, stop what started
            raise

    async def wait(self) -> None:
        """Return when the publisher stopped; re-raise what ended it, if anything did."""
        waits = [asyncio.ensure_future(self._consumer.wait()), *self._tasks,
                 asyncio.ensure_future(self._stopping.wait())]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for fut in waits[:1] + waits[-1:]:
            if not fut.done():
                fut.cancel()
        for fut in done:
            failure = None if fut.cancelled() else fut.exception()
            if failure is not None:
                raise failure

    async def stop(self) -> None:
        """Stop intake, let each replica finish its attempt (it resumes), flush events. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        with contextlib.suppress(Exception):
            await self._consumer.stop()
        for event in self._wake.values():
            event.set()
        if self._tasks:
            # A replica task stops between attempts; one in the middle of an attempt finishes it,
            # resume included, unless the reload outlasts the deadline.
            _, pending = await asyncio.wait(self._tasks, timeout=self.settings.reload_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.transfer.close()
        await self._http.aclose()
        await self._producer.stop()


    # -- intake -------------------------------------------------------------------------------

    async def _on_event(self, received: Received) -> None:
        event = received.event
        if isinstance(event, CheckpointV1):
            await self.offer(event)
        # CheckpointAppliedV1: our own (or another publisher's) notices; nothing to do.

    async def offer(self, checkpoint: CheckpointV1) -> bool:
        """Make ``checkpoint`` the target if it is newer and loadable; return whether it became it.

        A malformed checkpoint gets an error applied event for every replica and changes nothing.
        """
        if checkpoint.model != self.settings.model:
            logger.debug("ignoring checkpoint of model %r (publishing %r)", checkpoint.model, self.settings.model)
            return False
        if self._target is not None and checkpoint.version <= self._target.version:
            return False
        if checkpoint.version in self._rejected:
            return False
        try:
            if self.settings.validate_checkpoints:
                self._layout = await asyncio.to_thread(read_layout, local_path(checkpoint.uri), self._layout)
            if self.settings.verify_weights:
                digests, own = await asyncio.to_thread(expected_digests, local_path(checkpoint.uri))
        except (CheckpointError, OSError) as exc:
            self._rejected.add(checkpoint.version)
            logger.error("checkpoint %s v%d at %s refused: %s", checkpoint.model, checkpoint.version,
                         checkpoint.uri, exc)
            for url in self.replicas:
                await self._report(url, checkpoint, 0.0, f"checkpoint refused before loading: {exc}")
            return False
        if self.settings.verify_weights:
            if not own:
                logger.warning("checkpoint %s v%d has no digest manifest: replicas are verified against the "
                               "folder as it is now", checkpoint.model, checkpoint.version)
            # Kept for a few versions: a replica may still be loading the previous target.
            self._expected = {v: d for v, d in self._expected.items() if v >= checkpoint.version - 3}
            self._expected[checkpoint.version] = digests
        self._target = checkpoint
        logger.info("new target: %s v%d (%s)", checkpoint.model, checkpoint.version, checkpoint.uri)
        for event in self._wake.values():
            event.set()
        return True

    async def _bootstrap(self) -> CheckpointV1 | None:
        """Read the compacted topic to its end: newest checkpoint, and what was reported per replica."""
        newest: CheckpointV1 | None = None
        try:
            async with asyncio.timeout(self.settings.bootstrap_timeout_s):
                async for raw in read_topic(self.settings.kafka, self._topic.name):
                    try:
                        event = raw.decode()
                    except DecodeError:
                        continue  # the group consumer dead-letters it; bootstrap needs only valid ones
                    if isinstance(event, CheckpointV1) and event.model == self.settings.model:
                        if newest is None or event.version > newest.version:
                            newest = event
                    elif (isinstance(event, CheckpointAppliedV1) and event.model == self.settings.model
                          and event.replica in self.replicas):
                        self.replicas[event.replica].reported = (event.version, event.ok)
        except KeyError:
            raise MissingTopicsError.of([self._topic.name], self.settings.kafka.bootstrap_servers) from None
        logger.info("bootstrap: newest %s checkpoint on %s is %s", self.settings.model, self._topic.name,
                    f"v{newest.version}" if newest else "none")
        return newest

    # -- per replica --------------------------------------------------------------------------

    async def _replica_loop(self, url: str) -> None:
        state = self.replicas[url]
        wake = self._wake[url]
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        given_up: int | None = None  # version this replica stopped retrying (engine kept rejecting)
        rejections, rejected_version = 0, -1
        while not self._stopping.is_set():
            wake.clear()
            target = self._target
            delay = self.settings.check_interval_s
            if target is not None and target.version != rejected_version:
                rejections, rejected_version = 0, target.version  # each version gets its own tries
            if target is not None and target.version != given_up:
                try:
                    await self._converge(state, target)
                    backoff.reset()
                    rejections = 0
                except _EngineRejected as exc:
                    rejections += 1
                    if rejections >= self.settings.max_reload_failures or isinstance(exc, _NotVerified):
                        logger.error("%s: giving up on v%d after %d rejected reloads: %s",
                                     url, target.version, rejections, exc)
                        given_up, rejections = target.version, 0
                    else:
                        delay = backoff.next_s()
                except (httpx.HTTPError, OSError) as exc:
                    delay = backoff.next_s()
                    logger.warning("%s: unreachable (%s); retrying in %.1fs", url, _describe(exc), delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=delay)

    async def _converge(self, state: ReplicaState, target: CheckpointV1) -> None:
        """Bring one replica to ``target`` unless it serves it already.

        Raises:
            _EngineRejected: the engine refused a step (it answered with an error status).
            httpx.HTTPError: the replica could not be reached; the outcome was reported.
        """
        try:
            serving = await self._serving(state.url)
        except (httpx.HTTPError, _EngineRejected) as exc:
            if state.reported != (target.version, False) or state.serving is not None:
                # Report a replica going away once per version, not on every backoff tick.
                await self._report(state.url, target, 0.0, f"replica unreachable: {_describe(exc)}")
                state.attempts += 1
                state.failures += 1
            state.serving = None
            raise
        state.serving = serving
        if serving is not None and serving >= target.version:
            if state.reported != (serving, True) and serving == target.version:
                await self._report(state.url, target, 0.0, None)
            return
        state.attempts += 1
        started = time.monotonic()
        try:
            checked = await self._apply(state, target, serving)
        except (httpx.HTTPError, _EngineRejected, OSError) as exc:
            state.failures += 1
            state.serving = None
            await self._report(state.url, target, time.monotonic() - started, _describe(exc))
            raise
        state.serving = target.version
        await self._report(state.url, target, time.monotonic() - started, None, verified=checked)
        logger.info("%s: now serving %s v%d (%.3fs)", state.url, target.model, target.version,
                    time.monotonic() - started)

    async def _serving(self, url: str) -> int | None:
        """The replica's version label as a number (None for its initial weights or a foreign label)."""
        info = await self._call(url, "GET", "/weight_info")
        label = str(info.get("weight_version", ""))
        return int(label) if label.isdecimal() else None

    async def _apply(self, state: ReplicaState, target: CheckpointV1, serving: int | None) -> int | None:
        """Pause (keep), reload, verify, relabel, and resume once a pause was sent; the parameters verified.

        ``serving`` is the version the replica served before: what a load that fails to verify rolls
        back to, when its folder is known. Otherwise the replica stays paused (out of rotation).
        """
        url = state.url
        paused = keep_paused = False
        failure: BaseException | None = None
        checked: int | None = None
        try:
            try:
                # vLLM 0.32 resets its caches at a pause unless told not to (its docstring says
                # the flag is ignored with mode=keep; the code honours it): the one reset
                # correctness needs comes after the load, in _load.
                await self._call(url, "POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
            except httpx.ConnectError:
                raise  # never reached the engine: nothing to undo
            except BaseException:
                paused = True  # a timed-out or refused pause may still have taken effect
                raise
            paused = True
            await self._load(url, local_path(target.uri))
            if self.settings.verify_weights:
                result = await self._verify(url, self._expected.get(target.version))
                if not result.ok:
                    keep_paused = not await self._roll_back(state, serving)
                    state.out_of_rotation = keep_paused
                    verify_failures.add(1, {"outcome": "out_of_rotation" if keep_paused else "rolled_back"})
                    before = "its start" if serving is None else f"v{serving}"
                    what = ("left paused (out of rotation) until a checkpoint verifies" if keep_paused
                            else f"reloaded the weights of {before}")
                    differ = ", ".join(result.mismatched[:5]) or "none could be compared"
                    raise _NotVerified(f"after loading v{target.version} the replica's parameters differ from "
                                          f"the checkpoint's ({differ}; {result.checked} compared); {what}")
                checked = result.checked
            await self._call(url, "POST", "/update_weight_version", json={"new_version": str(target.version)})
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if paused and not keep_paused:
                await self._resume(url, failure)
        state.out_of_rotation = False
        state.verified = (target.version, target.uri)
        serving_now = await self._serving(url)
        if serving_now != target.version:
            raise _EngineRejected(f"after the update /weight_info reports {serving_now}, not {target.version}")
        return checked

    async def _load(self, url: str, folder: Path) -> None:
        """Load ``folder``'s weights into the replica and drop what its cache computed with the old ones."""
        try:
            await self.transfer.load(url, folder)
        except TransferError as exc:
            raise _EngineRejected(str(exc)) from exc
        # Prompts cached under the old weights would otherwise be reused by new requests (every
        # rollout of a task shares its prompt), so what is sampled would mix old and new weights.
        # Running requests hold their blocks, so the reset succeeds only by preempting them: they
        # are recomputed under the new weights, not dropped. Both are tested as needed.
        reset = await self._call(url, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if reset.get("success") is False:
            raise _EngineRejected("the engine could not reset its prefix cache after the reload")

    async def _verify(self, url: str, expected: dict[str, str] | None) -> Verification:
        """The replica's parameter digests against ``expected`` (none known: nothing compared)."""
        try:
            # Hashing every parameter reads all of them: as slow as a reload on a large model.
            body = await self._call(url, "POST", "/weight_checker", json={"action": "checksum"},
                                    timeout_s=self.settings.reload_timeout_s)
        except _EngineRejected as exc:
            raise _EngineRejected(f"{exc} (vLLM serves /weight_checker with VLLM_SERVER_DEV_MODE=1; "
                                  "OPENFORGE_PUBLISHER_VERIFY_WEIGHTS=false publishes unverified)") from None
        checksums = body.get("checksums")
        if not isinstance(checksums, dict):
            raise _EngineRejected("/weight_checker answered no checksums")
        return verify({str(k): str(v) for k, v in checksums.items()}, expected or {})

    async def _roll_back(self, state: ReplicaState, serving: int | None) -> bool:
        """Load the weights the replica served before, verified; False when unknown or that fails too."""
        if state.verified is not None and state.verified[0] == serving:
            folder = local_path(state.verified[1])
        elif serving is None and self.settings.reference_weights is not None:
            folder = self.settings.reference_weights
        else:
            logger.error("%s: the folder of v%s is not known to this publisher: no roll back", state.url, serving)
            return False
        try:
            await self._load(state.url, folder)
            expected, _ = await asyncio.to_thread(expected_digests, folder)
            result = await self._verify(state.url, expected)
        except (httpx.HTTPError, _EngineRejected, CheckpointError, OSError) as exc:
            logger.error("%s: rolling back to %s failed: %s", state.url, folder, _describe(exc))
            return False
        if not result.ok:
            logger.error("%s: after rolling back to %s its parameters still differ (%s)", state.url, folder,
                         ", ".join(result.mismatched[:5]) or "none compared")
        return result.ok

    async def _resume(self, url: str, failure: BaseException | None) -> None:
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        for attempt in range(1, self.settings.resume_attempts + 1):
            try:
                await self._call(url, "POST", "/resume")
                return
            except (httpx.HTTPError, _EngineRejected) as exc:
                # A refused connection means the process is gone; a restarted engine starts unpaused.
                if attempt == self.settings.resume_attempts or isinstance(exc, httpx.ConnectError):
                    logger.error("%s: resume failed %d times (%s); the replica may stay paused",
                                 url, attempt, _describe(exc))
                    if failure is None:
                        raise
                    return  # the original failure is what gets reported
                await asyncio.sleep(backoff.next_s())

    async def _call(self, url: str, method: str, path: str, *, timeout_s: float | None = None,
                    params: dict[str, str] | None = None, json: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            response = await self._http.request(method, url + path, params=params, json=json,
                                                timeout=timeout_s or self.settings.request_timeout_s)
        except httpx.TimeoutException:
            timeouts.add(1, {"step": path.strip("/")})
            raise
        if response.status_code != 200:
            raise _EngineRejected(f"{method} {path} answered {response.status_code}: {response.text[:500]}")
        try:
            body = response.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    async def _report(self, url: str, target: CheckpointV1, duration_s: float, error: str | None, *,
                      verified: int | None = None) -> None:
        event = CheckpointAppliedV1(model=target.model, version=target.version, replica=url,
                                    applied_at=datetime.now(UTC), duration_s=max(duration_s, 0.0),
                                    ok=error is None, error=error, verified_parameters=verified)
        await self._producer.publish(self._topic, event)
        self.replicas[url].reported = (target.version, error is None)
        outcome = {"outcome": "ok" if error is None else "failed"}
        applied.add(1, outcome)
        if duration_s > 0:  # 0 marks a replica found already serving it: nothing was loaded
            publish_latency.record(duration_s, outcome)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
