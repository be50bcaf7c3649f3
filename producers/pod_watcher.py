"""The pod watcher: rollout lifecycle events from Kubernetes pods.

It lists the rollout pods (by label), then watches them from the list's resource version with
bookmarks, so a reconnect resumes where it left off. When the server answers 410 Gone (the
resource version was compacted away or is older than the watch cache), it lists again and
carries on from the fresh state.

Nothing lost: each pod event is turned into the *full* sequence of phases the pod has reached
(scheduled, running, a terminal phase), derived from its status rather than from the event, so
a transition that happened while the watch was down is still seen on the next list.

Nothing repeated: the phases already acknowledged by Kafka are written back onto the pod
(annotation ``openforge.dev/published-phases``), which survives re-lists, watcher restarts and
API-server restarts. Between the Kafka acknowledgement and that patch a crash could repeat a
phase; the repeat carries the same deterministic ``event_id`` (pod uid + phase), so consumers
drop it like any other duplicate.

Time-based outcomes (unschedulable past a timeout, image pulls failing past a timeout) and the
deletion of finished pods after a TTL are decided by a periodic sweep over the watched pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import orjson
from aiokafka.errors import KafkaError
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.backoff import Backoff
from schemas.failures import classify
from schemas.rollout.pod import (
    ANNOTATION_FINISHED_AT,
    ANNOTATION_GROUP_INDEX,
    ANNOTATION_GROUP_SIZE,
    ANNOTATION_HARNESS,
    ANNOTATION_PUBLISHED,
    ANNOTATION_ROLLOUT_ID,
    ANNOTATION_RUN_ID,
    ANNOTATION_TASK_ID,
    FINALIZER,
    HARNESS_CONTAINER,
    MANAGED_SELECTOR,
    VERIFIER_CONTAINER,
    scheduled_event_id,
)
from schemas.rollout.v1 import Backend, RolloutEventV1, RolloutPhase, RolloutReason
from stream import ROLLOUTS, EventProducer
from stream.telemetry import count_rollout_outcome

__all__ = ["PodOutcome", "PodWatcher", "PodWatcherSettings", "WatcherStats", "derive_phases"]

logger = logging.getLogger(__name__)

Pod = dict[str, Any]

_IMAGE_PULL_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
_IMAGE_PULL_FINAL = frozenset({"InvalidImageName", "ErrImageNeverPull"})
"""Waiting reasons the kubelet never recovers from; the others are retried until the timeout."""
_TERMINAL_VALUES = frozenset(p.value for p in RolloutPhase if p.is_terminal)
_EVICTION_REASONS = frozenset({"Evicted", "Preempting"})
"""Pod status reasons of a kubelet that evicted (node pressure) or preempted the pod."""
_NODE_LOSS_REASONS = frozenset({"NodeLost", "NodeShutdown", "Terminated"})
"""Pod status reasons of a node that went away: lost, or shut down (graceful node shutdown)."""
_NODE_LOSS_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})
"""``DisruptionTarget`` reasons of pods deleted because their node is unreachable or gone; the
other disruptions (eviction API, scheduler preemption, kubelet) are evictions."""


class PodWatcherSettings(BaseSettings):
    """The pod watcher process (``OPENFORGE_WATCHER_*``); connection comes from ``OPENFORGE_KUBE_*``."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_WATCHER_", frozen=True, extra="ignore")

    namespace: str = Field(default="openforge-rollouts", min_length=1, max_length=63)
    """Namespace of the rollout pods (the launcher's namespace)."""

    label_selector: str = MANAGED_SELECTOR
    """Which pods are rollouts; narrow it (``,openforge.dev/run=...``) to split watchers per run."""

    watch_timeout_s: int = Field(default=300, ge=1)
    """Server-side lifetime of one watch request; the watcher then resumes from its last resource
    version. Bounded so a silently dead connection cannot stall the watcher for long."""

    unschedulable_timeout_s: float = Field(default=600.0, ge=0)
    """A pod no node can take for this long is failed as ``unschedulable`` (infrastructure) and
    deleted, so it cannot start later for a rollout already written off."""

    image_pull_timeout_s: float = Field(default=180.0, ge=0)
    """A pod whose image cannot be pulled for this long after creation is failed as
    ``image_pull`` (infrastructure) and deleted. Unrecoverable reasons (invalid name) fail at once."""

    finished_ttl_s: float | None = Field(default=600.0, ge=0)
    """Finished pods are deleted this long after their terminal event was published (time to read
    logs); None keeps them."""

    sweep_interval_s: float = Field(default=5.0, gt=0)
    """How often timeouts and TTLs are checked."""

    retry_backoff_s: float = Field(default=1.0, gt=0)
    """First pause after a failed list or watch; doubles up to ``retry_backoff_max_s``."""

    retry_backoff_max_s: float = Field(default=30.0, gt=0)
    """Longest pause between reconnection attempts."""

    request_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of list, patch and delete requests (watches add their own lifetime to it)."""

    max_concurrent_pods: int = Field(default=32, ge=1)
    """Pods handled at once (publish, then patch). Each pod's changes are handled in order, one at a
    time; different pods overlap, because each waits for Kafka and the API server, not the CPU."""


@dataclass
class WatcherStats:
    """Counters for logs, metrics and tests."""

    lists: int = 0
    """Full lists, the first one included."""
    expired: int = 0
    """410 Gone answers (watch from a compacted or too old resource version)."""
    reconnects: int = 0
    """Watches resumed after a connection failure or server restart."""
    published: int = 0
    """Lifecycle events acknowledged by Kafka."""
    deleted: int = 0
    """Pods deleted by the watcher (TTL, unschedulable, image pull)."""
    skipped: int = 0
    """Pods ignored because their annotations are missing or malformed."""
    retries: int = 0
    """Pod changes handled again after a failed publish or API request."""


@dataclass(frozen=True)
class PodOutcome:
    """One phase a pod has reached, with what the status says about it."""

    phase: RolloutPhase
    reason: RolloutReason | None = None
    harness_exit_code: int | None = None
    verifier_exit_code: int | None = None
    message: str | None = None
    delete_pod: bool = False
    """The pod is still alive but written off (unschedulable, image pull): delete it."""

    @property
    def infrastructure_failure(self) -> bool:
        """Whether the failure taxonomy blames the infrastructure, not the policy (terminal phases only)."""
        failure = classify(self.phase, self.reason) if self.phase.is_terminal else None
        return failure is not None and failure.is_infrastructure


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _state(status: Pod | None, key: str) -> Pod | None:
    if status is None:
        return None
    value = (status.get("state") or {}).get(key)
    return value if isinstance(value, dict) else None


def _exit(status: Pod | None) -> int | None:
    terminated = _state(status, "terminated")
    code = terminated.get("exitCode") if terminated else None
    return code if isinstance(code, int) else None


def _container(statuses: list[Pod] | None, name: str) -> Pod | None:
    return next((c for c in statuses or [] if c.get("name") == name), None)


def derive_phases(pod: Pod, now: datetime, settings: PodWatcherSettings) -> list[PodOutcome]:
    """Every phase ``pod`` has reached, in order, judged from its status alone.

    Deriving the whole sequence (not the latest change) is what lets a re-list after a watch gap
    publish the phases it missed.
    """
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    harness = _container(status.get("initContainerStatuses"), HARNESS_CONTAINER)
    verifier = _container(status.get("containerStatuses"), VERIFIER_CONTAINER)
    h_exit, v_exit = _exit(harness), _exit(verifier)
    started = phase == "Running" or any(
        _state(c, "running") is not None or _state(c, "terminated") is not None for c in (harness, verifier)
    )
    out = [PodOutcome(RolloutPhase.SCHEDULED)]
    if started:
        out.append(PodOutcome(RolloutPhase.RUNNING))
    codes: dict[str, Any] = {"harness_exit_code": h_exit, "verifier_exit_code": v_exit}
    message = status.get("message") or None

    if phase == "Succeeded":
        out.append(PodOutcome(RolloutPhase.SUCCEEDED, **codes))
        return out
    if phase == "Failed":
        out.append(_failure(status, harness, verifier, h_exit, v_exit, message))
        return out

    created = _time((pod.get("metadata") or {}).get("creationTimestamp")) or now
    age_s = (now - created).total_seconds()
    for container in (harness, verifier):
        waiting = _state(container, "waiting")
        reason = (waiting or {}).get("reason")
        if reason in _IMAGE_PULL_WAITING and (
            reason in _IMAGE_PULL_FINAL or age_s >= settings.image_pull_timeout_s
        ):
            out.append(PodOutcome(
                RolloutPhase.FAILED, RolloutReason.IMAGE_PULL,
                message=f"{container.get('name') if container else '?'}: {reason}: {(waiting or {}).get('message', '')}"
                .rstrip(": "),
                delete_pod=True, **codes,
            ))
            return out
    if phase == "Pending" and not started:
        for condition in status.get("conditions") or []:
            if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                    and condition.get("reason") == "Unschedulable"
                    and age_s >= settings.unschedulable_timeout_s):
                out.append(PodOutcome(
                    RolloutPhase.FAILED, RolloutReason.UNSCHEDULABLE,
                    message=f"unschedulable for {age_s:.0f} s: {condition.get('message', '')}".rstrip(": "),
                    delete_pod=True,
                ))
                return out
    return out


def _disruption(status: Pod) -> RolloutReason | None:
    """Whether the cluster took the pod away (eviction, node loss), from its status and conditions."""
    reason = status.get("reason")
    if reason in _NODE_LOSS_REASONS:
        return RolloutReason.NODE_LOST
    if reason in _EVICTION_REASONS:
        return RolloutReason.EVICTED
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            lost = condition.get("reason") in _NODE_LOSS_DISRUPTIONS
            return RolloutReason.NODE_LOST if lost else RolloutReason.EVICTED
    return None


def _failure(status: Pod, harness: Pod | None, verifier: Pod | None, h_exit: int | None, v_exit: int | None,
             message: str | None) -> PodOutcome:
    """Why a pod in phase Failed failed (the taxonomy in ``schemas.failures`` says whose fault it is)."""
    codes: dict[str, Any] = {"harness_exit_code": h_exit, "verifier_exit_code": v_exit, "message": message}
    if status.get("reason") == "DeadlineExceeded":
        return PodOutcome(RolloutPhase.TIMED_OUT, RolloutReason.DEADLINE_EXCEEDED, **codes)
    disruption = _disruption(status)
    if disruption is not None:
        return PodOutcome(RolloutPhase.FAILED, disruption, **codes)
    if "OOMKilled" in ((_state(c, "terminated") or {}).get("reason") for c in (harness, verifier)):
        return PodOutcome(RolloutPhase.FAILED, RolloutReason.OOM_KILLED, **codes)
    if h_exit not in (None, 0):
        return PodOutcome(RolloutPhase.FAILED, RolloutReason.EXIT_CODE, **codes)
    if v_exit not in (None, 0):
        return PodOutcome(RolloutPhase.FAILED, RolloutReason.VERIFIER_FAILED, **codes)
    return PodOutcome(RolloutPhase.FAILED, RolloutReason.OTHER, **codes)


def _published(pod: Pod) -> set[str]:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_PUBLISHED, "")
    return {p for p in text.split(",") if p}


def _event_id(uid: str, phase: RolloutPhase) -> str:
    return hashlib.sha256(f"{uid}/{phase.value}".encode()).hexdigest()[:32]


class _Expired(Exception):
    """The server answered 410 Gone: list again."""


async def _checked(response: aiohttp.ClientResponse) -> aiohttp.ClientResponse:
    """Raise ``ApiException`` for a non-2xx raw response (``_preload_content=False`` does not)."""
    if 200 <= response.status <= 299:
        return response
    try:
        body = await response.read()
    finally:
        response.release()
    try:
        detail = str(orjson.loads(body).get("message"))
    except (orjson.JSONDecodeError, AttributeError):
        detail = body[:200].decode(errors="replace")
    raise ApiException(status=response.status, reason=detail)


class PodWatcher:
    """Publish rollout lifecycle events for the pods of one namespace.

    The API client and the producer belong to the caller (started before, stopped after).
    """

    def __init__(self, api_client: k8s.ApiClient, producer: EventProducer,
                 settings: PodWatcherSettings | None = None) -> None:
        """Create a watcher; nothing runs before :meth:`start`."""
        self.settings = settings or PodWatcherSettings()
        self.stats = WatcherStats()
        self._api: Any = k8s.CoreV1Api(api_client)
        self._producer = producer
        self._pods: dict[str, Pod] = {}
        """Last seen object per pod name."""
        self._done: dict[str, set[str]] = {}
        """Published phases per pod uid, for the moments before our own patch is visible."""
        self._noted: dict[str, set[str]] = {}
        """Phases per pod uid that our last successful patch wrote onto the pod."""
        self._bad: set[str] = set()
        """Uids of pods whose annotations cannot be read (reported once)."""
        self._deleted: set[str] = set()
        """Uids of pods this watcher deleted past their TTL whose deletion its watch has not shown
        yet: the sweep does not delete them again."""
        self._queued: dict[str, tuple[Pod, bool]] = {}
        """Per pod uid, its latest change not yet handled (object, deleted); a newer one replaces it."""
        self._workers: dict[str, asyncio.Task[None]] = {}
        """Per pod uid with queued or running work, the task handling its changes in order."""
        self._slots = asyncio.Semaphore(self.settings.max_concurrent_pods)
        self._failure: BaseException | None = None
        """What made a pod's worker fail beyond retrying (a bug): the watcher stops and :meth:`wait` raises it."""
        self._stopping = asyncio.Event()
        self._stop_called = False
        self._listed = asyncio.Event()
        self._response: aiohttp.ClientResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def listed(self) -> asyncio.Event:
        """Set once the first list has been processed."""
        return self._listed

    async def start(self) -> None:
        """Start the watch loop and the sweep; returns at once."""
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._watch_loop(), name="pod-watch"),
                       asyncio.create_task(self._sweep_loop(), name="pod-sweep")]

    async def wait(self) -> None:
        """Return when the watcher stopped; raise what made it fail."""
        if self._tasks:
            await asyncio.gather(*self._tasks)
        if self._failure is not None:
            raise self._failure

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the pods being handled (publish and patch) are done. Idempotent.

        Changes queued but not started are left: the next watcher's list finds them again (the
        pods' annotations say what was published).
        """
        if self._stop_called:
            return
        self._stop_called = True
        self._stopping.set()  # also set by a worker's failure; the workers still in flight are drained here
        if self._response is not None:
            self._response.close()  # ends the pending read of the watch stream
        tasks = [*self._tasks, *self._workers.values()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> PodWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- list and watch -------------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        version: str | None = None
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        while not self._stopping.is_set():
            try:
                if version is None:
                    version = await self._relist()
                version = await self._watch(version)
                backoff.reset()
            except _Expired:
                self.stats.expired += 1
                logger.info("watch expired (410 Gone); listing again")
                version = None
            except ApiException as exc:
                if exc.status in (400, 404, 422):
                    raise  # bad selector, no such namespace: a configuration error, not a blip
                # 401/403 are retried too: a restarting API server denies requests until its
                # authorizer caches are filled, and a missing RoleBinding can be added later.
                await self._pause(exc, backoff.next_s())
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                if self._stopping.is_set():
                    return
                await self._pause(exc, backoff.next_s())

    async def _pause(self, exc: BaseException, backoff: float) -> None:
        self.stats.reconnects += 1
        logger.warning("pod watch interrupted (%s: %s); retrying in %.1f s", type(exc).__name__, exc, backoff)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), backoff)

    async def _relist(self) -> str:
        response = await _checked(await self._api.list_namespaced_pod(
            self.settings.namespace, label_selector=self.settings.label_selector,
            _preload_content=False, _request_timeout=self.settings.request_timeout_s,
        ))
        try:
            body = orjson.loads(await response.read())
        finally:
            response.release()
        self.stats.lists += 1
        items: list[Pod] = body.get("items") or []
        current = {p["metadata"]["name"]: p for p in items}
        # Pods that vanished while we were not watching: their deletion is an event we missed.
        vanished = [self._submit(last, deleted=True) for name, last in list(self._pods.items()) if name not in current]
        await self._settle([*vanished, *(self._submit(pod) for pod in items)])
        self._listed.set()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        try:
            response = await _checked(await self._api.list_namespaced_pod(
                self.settings.namespace, label_selector=self.settings.label_selector, watch=True,
                allow_watch_bookmarks=True, resource_version=version, timeout_seconds=self.settings.watch_timeout_s,
                _preload_content=False,
                _request_timeout=self.settings.watch_timeout_s + self.settings.request_timeout_s,
            ))
        except ApiException as exc:
            if exc.status == 410:
                raise _Expired(str(exc)) from exc
            raise
        self._response = response
        try:
            while not self._stopping.is_set():
                line = await response.content.readline()
                if not line:
                    return version  # the server ended this watch (its timeout); resume from here
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired(obj.get("message"))
                    raise ApiException(status=obj.get("code"), reason=f"{obj.get('reason')}: {obj.get('message')}")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._submit(obj, deleted=kind == "DELETED")
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)  # BOOKMARK too
            return version
        finally:
            self._response = None
            response.release()

    # --- per pod --------------------------------------------------------------------------------------

    def _submit(self, pod: Pod, *, deleted: bool = False, replace: bool = True) -> str | None:
        """Queue a pod's change for its worker (started if none runs); returns the pod's uid.

        A change not yet handled is replaced by a newer one (``replace``), because every outcome is
        derived from the pod's latest state; the sweep passes ``replace=False`` so that its copy never
        replaces a newer one from the watch.
        """
        meta = pod.get("metadata") or {}
        name, uid = meta.get("name"), meta.get("uid")
        if not name or not uid:
            return None
        if deleted:
            self._pods.pop(name, None)
        elif replace:
            self._pods[name] = pod
        if replace or uid not in self._queued:
            self._queued[uid] = (pod, deleted or (uid in self._queued and self._queued[uid][1]))  # a deletion sticks
        if uid not in self._workers:
            self._workers[uid] = asyncio.create_task(self._work(uid), name=f"pod-{name}")
        return str(uid)

    async def _work(self, uid: str) -> None:
        """Handle one pod's queued changes in order until none is left; retry a failed one."""
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        try:
            while uid in self._queued and not self._stopping.is_set():
                pod, deleted = self._queued.pop(uid)
                try:
                    async with self._slots:
                        if self._stopping.is_set():
                            break  # stopped while it waited for a slot: the next watcher's list finds it
                        await self._handle(pod, deleted=deleted)
                    backoff.reset()
                except (ApiException, aiohttp.ClientError, OSError, TimeoutError, KafkaError) as exc:
                    # Kafka or the API server failed us: try again (a newer change, if one came, instead).
                    self.stats.retries += 1
                    pause = backoff.next_s()
                    logger.warning("pod %s: %s: %s; retrying in %.1f s", (pod.get("metadata") or {}).get("name"),
                                   type(exc).__name__, exc, pause)
                    if uid not in self._queued:
                        self._queued[uid] = (pod, deleted)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), pause)
        except Exception as exc:
            logger.exception("handling pod uid %s failed; stopping the watcher", uid)
            self._failure = self._failure or exc
            self._stopping.set()
            if self._response is not None:
                self._response.close()
        finally:
            self._workers.pop(uid, None)

    async def _settle(self, uids: list[str | None]) -> None:
        """Wait until the given pods' queued changes are handled (or the watcher stops)."""
        while not self._stopping.is_set():
            tasks = {self._workers[uid] for uid in uids if uid is not None and uid in self._workers}
            if not tasks:
                return
            await asyncio.wait(tasks)

    async def _handle(self, pod: Pod, *, deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        name, uid = meta.get("name"), meta.get("uid")
        if not name or not uid:
            return
        annotations = meta.get("annotations") or {}
        try:
            base = self._base_fields(annotations, pod)
            RolloutEventV1(phase=RolloutPhase.SCHEDULED, **base)  # ids and group fields valid?
        except (KeyError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            if uid not in self._bad:  # once per pod, not on every event and sweep
                self._bad.add(uid)
                self.stats.skipped += 1
                logger.error("pod %s/%s has no usable rollout annotations (%s: %s); ignoring it",
                             self.settings.namespace, name, type(exc).__name__, exc)
            return
        done = _published(pod) | self._done.get(uid, set())
        outcomes = derive_phases(pod, datetime.now(UTC), self.settings)
        finished = bool(done & _TERMINAL_VALUES)
        deleting = bool(meta.get("deletionTimestamp"))
        if (deleted or deleting) and not outcomes[-1].phase.is_terminal and not finished:
            # Deleted before it ended: written off now (the finalizer keeps a pod deleted while no watcher
            # watched until the next list). The node controller marks the pods of a lost node before it
            # deletes them.
            outcomes.append(PodOutcome(RolloutPhase.FAILED, _disruption(pod.get("status") or {}) or RolloutReason.OTHER,
                                       message="pod deleted before it finished"))
        last = outcomes[-1]
        if finished:
            outcomes = [o for o in outcomes if not o.phase.is_terminal]  # one terminal phase, ever
        todo = [o for o in outcomes if o.phase.value not in done]
        for outcome in todo:
            event = RolloutEventV1(
                event_id=(scheduled_event_id(base["rollout_id"]) if outcome.phase is RolloutPhase.SCHEDULED
                          else _event_id(uid, outcome.phase)), phase=outcome.phase, reason=outcome.reason,
                infrastructure_failure=outcome.infrastructure_failure,
                harness_exit_code=outcome.harness_exit_code, verifier_exit_code=outcome.verifier_exit_code,
                message=outcome.message, **base,
            )
            await self._producer.publish(ROLLOUTS, event)
            self.stats.published += 1
            if outcome.phase.is_terminal:
                count_rollout_outcome(outcome.phase.value, outcome.reason.value if outcome.reason else None,
                                      outcome.infrastructure_failure)
            done.add(outcome.phase.value)
            self._done[uid] = set(done)
            logger.info("rollout %s: %s%s", base["rollout_id"], outcome.phase.value,
                        f" ({outcome.reason.value})" if outcome.reason else "")
        if deleted:
            self._done.pop(uid, None)
            self._noted.pop(uid, None)
            return
        # What Kafka has but the pod's note lacks: new phases, or a patch that failed before.
        behind = done - _published(pod) - self._noted.get(uid, set())
        if behind:
            await self._record(name, uid, done, pod, terminal=bool(behind & _TERMINAL_VALUES))
        # Written off (image pull, unschedulable): deleted once its event is out, retried until it is.
        if last.delete_pod and last.phase.value in done and not deleting and uid not in self._deleted:
            await self._delete(name, uid, why=last.reason.value if last.reason else "written off")
        if deleting and done & _TERMINAL_VALUES:
            await self._release(name, uid)

    def _base_fields(self, annotations: dict[str, str], pod: Pod) -> dict[str, Any]:
        return {
            "rollout_id": annotations[ANNOTATION_ROLLOUT_ID],
            "task_id": annotations[ANNOTATION_TASK_ID],
            "run_id": annotations.get(ANNOTATION_RUN_ID),
            "group_index": int(annotations[ANNOTATION_GROUP_INDEX]),
            "group_size": int(annotations[ANNOTATION_GROUP_SIZE]) if ANNOTATION_GROUP_SIZE in annotations else None,
            "harness": annotations.get(ANNOTATION_HARNESS),
            "backend": Backend.KUBERNETES,
            "pod_name": pod["metadata"]["name"],
            "namespace": pod["metadata"].get("namespace") or self.settings.namespace,
        }

    async def _record(self, name: str, uid: str, done: set[str], handled: Pod, *, terminal: bool) -> None:
        """Write the published phases onto the pod (after Kafka acknowledged them)."""
        order = [p.value for p in RolloutPhase if p.value in done]
        annotations = {ANNOTATION_PUBLISHED: ",".join(order)}
        if terminal:
            annotations[ANNOTATION_FINISHED_AT] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        # The uid precondition keeps a patch from landing on a new pod that reuses the name.
        body = {"metadata": {"uid": uid, "annotations": annotations}}
        try:
            patched = await _checked(await self._api.patch_namespaced_pod(
                name, self.settings.namespace, body, _content_type="application/merge-patch+json",
                _preload_content=False, _request_timeout=self.settings.request_timeout_s,
            ))
            try:
                pod = orjson.loads(await patched.read())
            finally:
                patched.release()
            if self._pods.get(name) is handled:  # else the watch brought a newer state meanwhile
                self._pods[name] = pod
            self._noted[uid] = set(done)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            self._noted[uid] = set(done)
            # Gone (or replaced) before we could note it: nothing left to repeat the phase for.

    async def _release(self, name: str, uid: str) -> None:
        """Remove the finalizer of a pod being deleted whose terminal event is published."""
        pod = self._pods.get(name) or {}
        finalizers = list((pod.get("metadata") or {}).get("finalizers") or [])
        if FINALIZER not in finalizers:
            return
        at = f"/metadata/finalizers/{finalizers.index(FINALIZER)}"
        # The tests make the patch fail (and a later event retry) if the pod or its finalizers changed.
        body = [{"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": at, "value": FINALIZER}, {"op": "remove", "path": at}]
        try:
            await self._api.patch_namespaced_pod(name, self.settings.namespace, body,
                                                 _content_type="application/json-patch+json",
                                                 _request_timeout=self.settings.request_timeout_s)
        except ApiException as exc:
            if exc.status not in (404, 409, 422):
                raise

    async def _delete(self, name: str, uid: str, *, why: str) -> None:
        try:
            await self._api.delete_namespaced_pod(
                name, self.settings.namespace, body={"preconditions": {"uid": uid}},
                _request_timeout=self.settings.request_timeout_s,
            )
            self.stats.deleted += 1
            self._deleted.add(uid)
            logger.info("deleted pod %s/%s (%s)", self.settings.namespace, name, why)
        except ApiException as exc:
            if exc.status not in (404, 409):  # 409: another pod has the name now, so this one is gone
                raise
            self._deleted.add(uid)

    # --- timeouts and TTL -----------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.sweep_interval_s)
            if self._stopping.is_set() or not self._listed.is_set():
                continue
            try:
                await self.sweep()
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                logger.warning("sweep failed (%s: %s); next one in %.0f s", type(exc).__name__, exc,
                               self.settings.sweep_interval_s)

    async def sweep(self) -> None:
        """Apply time-based outcomes and delete finished pods past their TTL (also run periodically)."""
        now = datetime.now(UTC)
        ttl = self.settings.finished_ttl_s
        handled: list[str | None] = []
        expired: list[tuple[str, str]] = []
        for name, pod in list(self._pods.items()):
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                if FINALIZER in (meta.get("finalizers") or []):
                    handled.append(self._submit(pod, replace=False))  # publish what is left and release it
                continue
            finished = _time((meta.get("annotations") or {}).get(ANNOTATION_FINISHED_AT))
            if finished is None:
                handled.append(self._submit(pod, replace=False))  # time may have turned a waiting pod into a failure
            elif ttl is not None and now - finished >= timedelta(seconds=ttl) and meta["uid"] not in self._deleted:
                expired.append((name, meta["uid"]))

        async def delete(name: str, uid: str) -> None:
            async with self._slots:
                await self._delete(name, uid, why=f"finished more than {ttl:.0f} s ago")

        results = await asyncio.gather(*(delete(name, uid) for name, uid in expired), return_exceptions=True)
        await self._settle(handled)
        self._deleted &= {(pod.get("metadata") or {}).get("uid") for pod in self._pods.values()}
        for result in results:
            if isinstance(result, BaseException):
                raise result
