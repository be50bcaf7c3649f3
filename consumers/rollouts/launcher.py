"""The rollout launcher: tasks in, ``group_size`` rollouts per task out.

For each task the launcher derives deterministic rollout ids, mints an agent and a verifier
token per rollout, publishes the ``scheduled`` lifecycle event and asks the backend to start the
rollout. It commits a task's offset only once every rollout of the task exists, and it pauses
its partitions (rather than dropping or buffering tasks) while it may not start more: at the
in-flight cap, or while the learner could not train in time what more rollouts would produce
(pacing, :mod:`consumers.rollouts.pacing`). A task's rollouts start together (when its group fits
under the cap at all), so a group's members finish within its timeout of each other. Because ids
are deterministic and the backend answers "already exists", a launcher that crashed and
restarted re-reads uncommitted tasks and launches nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from consumers.rollouts.backend import (
    ENV_AGENT_KEYS,
    ENV_ANTHROPIC_BASE_URL,
    ENV_INSTRUCTION,
    ENV_OPENAI_BASE_URL,
    ENV_PROXY_URL,
    ENV_REWARD_URL,
    ENV_ROLLOUT_ID,
    ENV_TASK_ID,
    ENV_VERIFIER_TOKEN,
    RolloutBackend,
    RolloutSpec,
)
from consumers.rollouts.pacing import Pace
from schemas import DeadLetterErrorType, DeadLetterV1, DecodeError, TaskV1, decode
from schemas.credentials import MAX_TOKEN_TTL_S, Role, mint_token, signing_key_from
from schemas.rollout.pod import LABEL_ROLLOUT, LABEL_RUN, LABEL_TASK, scheduled_event_id
from schemas.rollout.v1 import Backend, RolloutEventV1, RolloutPhase
from stream.broker import cache_root
from stream.lifecycle import Managed
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.telemetry import ConsumerLag, track_consumer_lag
from stream.topics import CHECKPOINTS, DEAD_LETTERS, ROLLOUTS, TASKS, TopicRegistry, start_consumer

__all__ = ["Launcher", "LauncherSettings", "build_spec", "make_backend", "proxy_for", "rollout_id_for"]

logger = logging.getLogger(__name__)

_NON_LABEL = re.compile(r"[^a-z0-9-]+")


class LauncherSettings(BaseSettings):
    """Settings of the launcher process (``OPENFORGE_LAUNCHER_*``)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_LAUNCHER_", frozen=True, extra="ignore",
                                      populate_by_name=True)

    backend: Backend = Backend.LOCAL
    """Where rollouts run: ``local`` processes (the demo) or ``kubernetes`` pods."""

    proxy_url: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["http://127.0.0.1:8100"],
                                                      min_length=1)
    """The proxy's root URL as seen from inside a rollout (``OPENFORGE_LAUNCHER_PROXY_URL``); with
    several proxy replicas, each replica's own stable address, comma-separated. Every rollout is
    pinned to one of them (:func:`proxy_for`), so all its calls and its verifier's reward pass
    through one replica, which ships them to Kafka in the order it took them: a reward can then
    never overtake calls a backlogged replica still holds, and the assembler never closes a
    trajectory without them. Behind a plain Service the calls of one rollout would spread over
    replicas."""

    credential_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("OPENFORGE_LAUNCHER_CREDENTIAL_KEY",
                                      "OPENFORGE_PROXY_CREDENTIAL_KEY"))
    """HMAC key that signs rollout tokens: the proxy's key, so the proxy's variable is read too."""

    credential_key_file: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("OPENFORGE_LAUNCHER_CREDENTIAL_KEY_FILE",
                                      "OPENFORGE_PROXY_CREDENTIAL_KEY_FILE"))
    """Read the signing key from this file instead (a mounted Kubernetes Secret)."""

    max_in_flight: int = Field(default=8, ge=1)
    """Rollouts running at once. At the cap the launcher pauses its partitions; tasks wait on Kafka."""

    pace: bool = True
    """Start rollouts only while the learner can still train what they will produce within its
    staleness bound, judged from its progress on the checkpoints topic (docs/rollouts.md,
    *Pacing*). Until a learner has reported, nothing starts. False launches up to
    ``max_in_flight`` whatever the learner does (collecting data without a learner)."""

    transit_timeout_s: float = Field(default=600.0, gt=0)
    """Pacing: how long a rollout that ended still counts as outstanding while its trajectory is not
    on the trajectories topic. The assembler publishes it after its grace period, or after its
    reward timeout (300 s by default) when a verifier never reported; keep this above that. It
    bounds how long a trajectory that is never published (refused by the broker, say) holds a place.
    """

    learner_model: str | None = None
    """The learner's model (its ``OPENFORGE_LEARNER_MODEL_NAME``) to pace by; unset paces by every
    learner that reports on the topic prefix, the tightest first."""

    token_ttl_s: float = Field(default=3600.0, gt=0)
    """Validity of minted tokens, in seconds. A rollout's tokens always outlive its deadline by
    ``token_grace_s`` whatever this says, so a slow rollout is never locked out mid-run."""

    token_grace_s: float = Field(default=300.0, ge=0)
    """Extra token validity beyond the task timeout (queueing, reward retries)."""

    group_id: str = "openforge-launcher"
    """Consumer group of the launcher replicas (the topic prefix goes in front)."""

    capacity_poll_s: float = Field(default=0.5, gt=0)
    """How often the launcher re-checks the in-flight count while at the cap."""

    drain_timeout_s: float = Field(default=20.0, gt=0)
    """How long stop() waits for the rollout being launched before giving up on it (it stays
    uncommitted and is reconciled on the next start)."""

    state_dir: Path | None = None
    """Local backend: where per-rollout state folders live; ``<cache>/launcher/<topic prefix>``
    when unset. Keep it across restarts: it is how the backend knows what already exists."""

    workspace_root: Path | None = None
    """Local backend: where temporary workspaces are made (the system temp folder when unset)."""

    keep_workspaces: bool = False
    """Local backend: keep temporary workspaces after the verifier ran (debugging)."""

    kill_grace_s: float = Field(default=5.0, ge=0)
    """Local backend: time between SIGTERM and SIGKILL when a rollout passes its deadline."""

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    """Kafka connection (``OPENFORGE_KAFKA_*``)."""

    @field_validator("proxy_url", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            urls = [str(u).strip().rstrip("/") for u in value if str(u).strip()]
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"proxy URLs must start with http:// or https://, got {', '.join(bad)}")
            if len(set(urls)) != len(urls):
                raise ValueError(f"a proxy URL is listed twice in {', '.join(urls)}")
            return urls
        return value

    def signing_key(self) -> bytes:
        """The credential key's bytes.

        Raises:
            ValueError: no key is configured; the message names the variables.
        """
        value = None if self.credential_key is None else self.credential_key.get_secret_value()
        try:
            key = signing_key_from(value, self.credential_key_file)
        except OSError as exc:
            raise ValueError(f"the credential key file cannot be read: {exc.strerror or exc} "
                             f"({self.credential_key_file})") from exc
        if key:
            return key
        raise ValueError("the launcher needs the proxy's signing key: set OPENFORGE_PROXY_CREDENTIAL_KEY "
                         "(or OPENFORGE_LAUNCHER_CREDENTIAL_KEY, or a _FILE variant)")

    def local_state_dir(self) -> Path:
        """The local backend's state folder, one per topic prefix so experiments stay apart."""
        if self.state_dir is not None:
            return self.state_dir
        return cache_root() / "launcher" / (self.kafka.topic_prefix.strip(".") or "default")


def rollout_id_for(task_id: str, group_index: int) -> str:
    """The rollout id of one group member: deterministic, and a valid DNS-1123 label.

    The same (task, index) always gives the same id, which is what makes launching idempotent.
    A readable slug of the task id is kept for humans; the hash keeps ids of tasks whose slugs
    collide (case, punctuation, truncation) apart.
    """
    slug = _NON_LABEL.sub("-", task_id.lower()).strip("-")[:30].strip("-") or "task"
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:10]
    return f"r-{slug}-{digest}-{group_index}"


def proxy_for(rollout_id: str, proxy_urls: Sequence[str]) -> str:
    """The proxy replica a rollout is pinned to: the highest of a hash of (rollout, replica).

    Rendezvous hashing: the choice depends only on the rollout id and the list, so a restarted
    launcher (or another launcher replica) pins a rollout where the first one did, and a rollout
    relaunched after a restart keeps its replica. Adding or removing a replica moves only the
    rollouts of that replica.
    """
    return max(proxy_urls, key=lambda url: hashlib.sha256(f"{url}\n{rollout_id}".encode()).digest())


def build_spec(task: TaskV1, group_index: int, *, proxy_url: str, key: bytes, token_ttl_s: float,
               backend: Backend) -> RolloutSpec:
    """Decide everything about one rollout: id, credentials and both environments.

    The harness environment carries the agent token under every name harnesses read; only the
    verifier environment adds the reward URL and the verifier token.
    """
    rollout_id = rollout_id_for(task.task_id, group_index)
    proxy = proxy_url.rstrip("/")
    ttl = max(token_ttl_s, task.timeout_s)
    agent_token = mint_token(key, rollout_id, Role.AGENT, ttl, task_id=task.task_id)
    verifier_token = mint_token(key, rollout_id, Role.VERIFIER, ttl, task_id=task.task_id)
    harness_env = {
        **task.harness.env,
        ENV_OPENAI_BASE_URL: f"{proxy}/rollouts/{rollout_id}/v1",
        ENV_ANTHROPIC_BASE_URL: f"{proxy}/rollouts/{rollout_id}",
        ENV_PROXY_URL: proxy,
        ENV_ROLLOUT_ID: rollout_id,
        ENV_TASK_ID: task.task_id,
        ENV_INSTRUCTION: task.instruction,
        **dict.fromkeys(ENV_AGENT_KEYS, agent_token),
    }
    for name in (ENV_VERIFIER_TOKEN, ENV_REWARD_URL):
        harness_env.pop(name, None)  # a task's env must not smuggle these names into the harness
    verifier_env = {**harness_env, ENV_REWARD_URL: f"{proxy}/rollouts/{rollout_id}/reward",
                    ENV_VERIFIER_TOKEN: verifier_token}
    labels = {LABEL_TASK: _label_value(task.task_id), LABEL_ROLLOUT: rollout_id}
    if task.run_id is not None:
        labels[LABEL_RUN] = _label_value(task.run_id)
    return RolloutSpec(rollout_id=rollout_id, name=rollout_id, task=task, group_index=group_index,
                       harness_env=harness_env, verifier_env=verifier_env, deadline_s=task.timeout_s,
                       labels=labels)


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "x"


def make_backend(settings: LauncherSettings, producer: EventProducer) -> RolloutBackend:
    """The configured backend. The Kubernetes one is imported only when chosen.

    Raises:
        ValueError: the Kubernetes backend was chosen but cannot be imported.
    """
    if settings.backend is Backend.KUBERNETES:
        # Optional: only clusters need it (and its client library), so only they import it.
        try:
            kubernetes = importlib.import_module("consumers.rollouts.kubernetes")
        except ImportError as exc:
            raise ValueError(f"the kubernetes backend cannot be loaded ({exc}); "
                             "use OPENFORGE_LAUNCHER_BACKEND=local or install its dependencies") from exc
        backend_cls: Any = kubernetes.KubernetesBackend
        factory = getattr(backend_cls, "from_settings", None)
        backend: RolloutBackend = factory(settings) if factory is not None else backend_cls()
        return backend
    from consumers.rollouts.local import LocalBackend

    return LocalBackend(producer, settings.local_state_dir(), workspace_root=settings.workspace_root,
                        keep_workspaces=settings.keep_workspaces, kill_grace_s=settings.kill_grace_s)


@dataclass
class _Work:
    """A task being launched, and how far."""

    tp: TopicPartition
    offset: int
    task: TaskV1
    record: ConsumerRecord[bytes, bytes]
    next_index: int = 0
    admitted: bool = False
    """The cap and pacing let its rollouts start."""


class Launcher(Managed):
    """Consume tasks and launch their rollouts on a backend, within the in-flight cap.

    Use ``async with Launcher(settings) as launcher: await launcher.wait()``. ``stop()`` stops
    intake, commits what is fully launched and stops the backend (the local backend ends its
    running rollouts; Kubernetes pods keep running).
    """

    def __init__(self, settings: LauncherSettings | None = None, *, backend: RolloutBackend | None = None) -> None:
        """Create the launcher (inside the event loop); ``backend`` overrides the configured one (tests)."""
        self._started = False
        self._stopped = False
        self.settings = settings or LauncherSettings()
        self._key = self.settings.signing_key()
        kafka = self.settings.kafka
        self.registry = TopicRegistry.from_settings(kafka)
        self.group_id = kafka.scoped(self.settings.group_id)
        self.producer = EventProducer(kafka, registry=self.registry, client_id=f"{kafka.client_id}-launcher")
        self.backend = backend if backend is not None else make_backend(self.settings, self.producer)
        self._consumer = AIOKafkaConsumer(
            **kafka.client_kwargs(), client_id=f"{kafka.client_id}-launcher",
            group_id=self.group_id, enable_auto_commit=False, auto_offset_reset="earliest",
            isolation_level="read_committed", request_timeout_ms=kafka.request_timeout_ms,
            max_partition_fetch_bytes=self.registry[TASKS].spec.max_message_bytes)
        self._lock = asyncio.Lock()  # held while launching; a rebalance waits for the rollout in hand
        self._backlog: deque[ConsumerRecord[bytes, bytes]] = deque()
        self._work: _Work | None = None
        self._handled: dict[TopicPartition, int] = {}
        self._lag: ConsumerLag | None = None
        self._committed: dict[TopicPartition, int] = {}
        self._known: set[str] = set()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pace = (Pace(kafka, self.registry, self.settings.learner_model,
                           transit_timeout_s=self.settings.transit_timeout_s) if self.settings.pace else None)
        self._held_since: float | None = None
        self._held_why: str | None = None  # the hold's kind last logged: a new kind is logged at once
        self.launched = 0
        """Rollouts this instance created (not counting ones found already existing)."""
        self.skipped = 0
        """Rollouts this instance found already existing and did not launch again."""
        self.dead_lettered = 0
        """Task records that could not be decoded and went to the dead-letter topic."""

    async def start(self) -> None:
        """Connect, reconcile with what the backend already holds, and begin consuming."""
        if self._started:
            return
        self._started = True
        try:
            await self.producer.start()
            await self.backend.start()
            # Reconciliation: whatever exists was launched by an earlier life of this launcher (or a
            # replica); those ids are skipped instead of launched twice.
            self._known = set(await self.backend.existing())
            if self._known:
                logger.info("launcher: %d rollouts already exist; they will not be launched again", len(self._known))
            self._consumer.subscribe([self.registry[TASKS].name], listener=_Rebalance(self))
            await start_consumer(self._consumer, [self.registry[TASKS].name], self.settings.kafka)
            if self._pace is not None:
                await self._pace.start()
        except BaseException:
            try:
                await self.stop()  # closes whichever clients were made, started or not
            except Exception:  # the start's error is the one to see; this one is logged
                logger.exception("launcher: closing after a failed start failed too")
            raise
        self._lag = track_consumer_lag(self.group_id, self._consumer, lambda: self._handled)
        self._task = asyncio.create_task(self._run(), name="launcher")

    async def wait(self) -> None:
        """Return when the launcher stopped; re-raise what ended it, if anything did."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop intake, let the rollout in hand be created, commit, stop backend and clients. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._lag is not None:
            self._lag.close()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=self.settings.drain_timeout_s)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        try:
            with contextlib.suppress(Exception):
                await self._commit()
        finally:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            try:
                if self._pace is not None:
                    await self._pace.stop()
                await self.backend.stop()
            finally:
                await self.producer.stop()


    @property
    def committed_offsets(self) -> dict[TopicPartition, int]:
        """Offsets this instance committed, per partition (next offset to read)."""
        return dict(self._committed)

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        last_commit = time.monotonic()
        while not self._stopping.is_set():
            async with self._lock:
                if self._work is None and self._backlog:
                    await self._take(self._backlog.popleft())
                blocked = False
                if self._work is not None:
                    blocked = not await self._advance(self._work)
            if self._work is None and not self._backlog:
                await self._resume()
                batch = await self._poll(500)
                for records in batch.values():
                    self._backlog.extend(records)
            elif blocked:
                # At the cap: keep polling (so the group keeps this member) with intake paused.
                self._consumer.pause(*self._consumer.assignment())
                await self._poll(int(self.settings.capacity_poll_s * 1000))
            if time.monotonic() - last_commit >= 1.0:
                await self._commit()
                last_commit = time.monotonic()

    async def _poll(self, timeout_ms: int) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        fetch = asyncio.ensure_future(self._consumer.getmany(timeout_ms=timeout_ms, max_records=16))
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not fetch.done():
            fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetch
            return {}
        result: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = fetch.result()
        return result

    async def _resume(self) -> None:
        paused = self._consumer.paused()
        if paused:
            self._consumer.resume(*paused)

    async def _take(self, record: ConsumerRecord[bytes, bytes]) -> None:
        tp = TopicPartition(record.topic, record.partition)
        if tp not in self._consumer.assignment():
            return  # revoked meanwhile; the new owner reads it
        headers = tuple((k, v) for k, v in (record.headers or ()))
        try:
            event = decode(headers, record.value if record.value is not None else b"")
        except DecodeError as exc:
            await self._dead_letter(record, exc.kind, exc.reason)
            self._handled[tp] = record.offset + 1
            return
        if not isinstance(event, TaskV1):
            await self._dead_letter(record, DeadLetterErrorType.INVALID_EVENT,
                                    f"{type(event).SCHEMA!r} events do not belong on {record.topic}")
            self._handled[tp] = record.offset + 1
            return
        self._work = _Work(tp, record.offset, event, record)

    async def _advance(self, work: _Work) -> bool:
        """Launch what the cap and pacing allow of ``work``; False when blocked."""
        task = work.task
        active = await self.backend.active()
        in_flight = len(active)
        if not work.admitted:
            if await self._untrainable(work):
                return True
            if not await self._admit(work, active):
                return False
            work.admitted = True
        while work.next_index < task.group_size:
            if self._stopping.is_set():
                return True
            if work.tp not in self._consumer.assignment():
                self._work = None  # revoked: the new owner relaunches from the committed offset
                return True
            # The rest of the group that fits under the cap, launched together: each launch waits for
            # Kafka and the backend (the API server), not the CPU, so a group takes one round trip.
            # Capped: a task's timeout has no upper bound, and a lifetime past the cap is refused.
            ttl_s = min(max(self.settings.token_ttl_s, task.timeout_s + self.settings.token_grace_s), MAX_TOKEN_TTL_S)
            batch: list[RolloutSpec] = []
            end = work.next_index
            while end < task.group_size:
                rollout_id = rollout_id_for(task.task_id, end)
                if rollout_id in self._known:  # launched before a restart: skipped even at the cap
                    self.skipped += 1
                    end += 1
                    continue
                if in_flight + len(batch) >= self.settings.max_in_flight:
                    break
                batch.append(build_spec(task, end, proxy_url=proxy_for(rollout_id, self.settings.proxy_url),
                                        key=self._key, token_ttl_s=ttl_s, backend=self.backend.kind))
                end += 1
            if not batch and end == work.next_index:
                return False  # at the cap
            failures = [r for r in await asyncio.gather(*(self._launch(spec) for spec in batch),
                                                        return_exceptions=True) if isinstance(r, BaseException)]
            if failures:
                raise failures[0]  # retried from next_index; the rollouts that were created are known now
            in_flight += len(batch)
            work.next_index = end
        self._handled[work.tp] = work.offset + 1
        self._work = None
        logger.info("launcher: task %s launched (%d rollouts)", task.task_id, task.group_size)
        return True

    async def _untrainable(self, work: _Work) -> bool:
        """Dead-letter a task whose group the learner could never train; True when it did."""
        smallest = None if self._pace is None else self._pace.min_group_size
        if smallest is None or work.task.group_size >= smallest or work.next_index > 0:
            return False
        await self._dead_letter(work.record, DeadLetterErrorType.INVALID_EVENT,
                                f"task {work.task.task_id} has group_size {work.task.group_size}, but the learner "
                                f"trains groups of at least {smallest} (OPENFORGE_LEARNER_MIN_GROUP_SIZE): its "
                                f"rollouts could never train; submit it with group_size >= {smallest}")
        self._handled[work.tp] = work.offset + 1
        self._work = None
        return True

    async def _admit(self, work: _Work, active: set[str]) -> bool:
        """Whether the task's remaining rollouts may start now, all together.

        Under the cap: the whole rest of the group at once when it fits under ``max_in_flight`` at
        all. Under pacing: the learner must be able to train all of them in time.
        """
        remaining = sum(1 for i in range(work.next_index, work.task.group_size)
                        if rollout_id_for(work.task.task_id, i) not in self._known)
        if remaining == 0:
            return True
        if self.settings.max_in_flight - len(active) < min(remaining, self.settings.max_in_flight):
            return False
        if self._pace is None:
            return True
        pace = await self._pace.room(work.task.group_size, active)
        if pace is not None and pace.room >= remaining:
            self._held_since = None
            return True
        now = time.monotonic()
        why = "no-learner" if pace is None else "engines-behind" if pace.engines_behind else "full"
        if self._held_since is None or now - self._held_since >= 60 or why != self._held_why:
            self._held_since, self._held_why = now, why
            if pace is None:
                logger.info("launcher: waiting for the learner's progress on %s before starting rollouts "
                            "(OPENFORGE_LAUNCHER_PACE=false launches without a learner)",
                            self.registry[CHECKPOINTS].name)
            elif pace.engines_behind:
                # Nothing the engines sample now could train: only a publisher loading a newer version
                # frees the launcher, so say what to look at rather than wait in silence.
                logger.warning("launcher: holding task %s: engines serve v%d but the learner published v%d, "
                               "beyond its staleness bound %d; is `openforge publisher` running and loading "
                               "its checkpoints?", work.task.task_id, pace.served, pace.published,
                               pace.max_staleness)
            else:
                logger.info("launcher: holding task %s: %d rollouts outstanding (%d of them ended, their "
                            "trajectories not yet on the topic), the learner can train %d in time (engines serve "
                            "v%d)", work.task.task_id, pace.outstanding, pace.in_transit, pace.limit, pace.served)
        return False

    async def _launch(self, spec: RolloutSpec) -> None:
        task = spec.task
        # Published before the backend creates the rollout, so ``scheduled`` precedes what its watcher
        # reports; its id is derived from the rollout, so a relaunch after a crash repeats the same
        # event (same id), which consumers drop as a duplicate.
        scheduled = RolloutEventV1(
            event_id=scheduled_event_id(spec.rollout_id), rollout_id=spec.rollout_id, task_id=task.task_id,
            run_id=task.run_id, group_index=spec.group_index, group_size=task.group_size,
            harness=task.harness.name, timeout_s=task.timeout_s,
            phase=RolloutPhase.SCHEDULED, backend=self.backend.kind,
            pod_name=spec.name if self.backend.kind is Backend.KUBERNETES else None)
        await self.producer.publish(ROLLOUTS, scheduled)
        created = await self.backend.launch(spec)
        self._known.add(spec.rollout_id)
        if created:
            self.launched += 1
            if self._pace is not None:
                self._pace.launched(task.task_id, spec.rollout_id)
        else:
            self.skipped += 1
            logger.info("launcher: rollout %s already existed", spec.rollout_id)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], kind: DeadLetterErrorType,
                           reason: str) -> None:
        letter = DeadLetterV1(
            topic=record.topic, partition=record.partition, offset=record.offset, timestamp_ms=record.timestamp,
            key=record.key, value=record.value, headers=[(k, v) for k, v in (record.headers or ())],
            error_type=kind, reason=reason, consumer_group=self.group_id)
        logger.warning("launcher: dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset,
                       reason)
        await self.producer.publish(DEAD_LETTERS, letter)
        self.dead_lettered += 1

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        pending = {tp: off for tp, off in self._handled.items()
                   if (partitions is None or tp in partitions) and self._committed.get(tp) != off}
        if not pending:
            return
        await self._consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in pending.items()})
        self._committed.update(pending)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit the revoked partitions' launched tasks and forget their unlaunched ones."""
        async with self._lock:
            try:
                await self._commit(revoked)
            except Exception:
                logger.exception("launcher: commit on revoke failed; the next owner reconciles")
            self._backlog = deque(r for r in self._backlog
                                  if TopicPartition(r.topic, r.partition) not in revoked)
            if self._work is not None and self._work.tp in revoked:
                self._work = None
            for tp in revoked:
                self._handled.pop(tp, None)
                self._committed.pop(tp, None)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: Launcher) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._owner.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        """Nothing to do: the loop resumes paused partitions once it has capacity again."""
