"""The learner's control loop: read, group, bound staleness, build a batch, step, checkpoint.

Torch work runs in a worker thread (``asyncio.to_thread``) so the event loop keeps fetching and
decoding the next trajectories while a step runs. Nothing here touches a tensor: the trainer
decides what trains with which advantage and hands a :class:`~learner.protocol.TrainBatch` to the
worker.

Under ``torchrun`` with several ranks (``fsdp`` engine) rank 0 runs this loop and alone reads
Kafka, writes checkpoint folders and publishes their events; before each collective (load, step,
publish, save a training state) it sends the other ranks an order, and they follow (see :mod:`learner.ranks`). With one
process none of that exists: the loop is exactly the one-process loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from aiokafka.errors import KafkaError
from opentelemetry import trace

from learner import metrics as m
from learner.checkpoint import (
    CheckpointError,
    LearnerState,
    Retention,
    apply_retention,
    latest_checkpoint,
    newest_training_state,
    read_state,
    remove_leftovers,
    serving_folder,
    state_folder,
    temporary_folder,
    training_states,
    write_checkpoint_folder,
)
from learner.grouping import Group, GroupBuffer
from learner.positions import Position, PositionLedger
from learner.protocol import Row, TrainBatch
from learner.ranks import Order, Ranks, launched_world_size
from learner.settings import LearnerSettings
from learner.sources import Incoming, KafkaTrajectorySource, TrajectorySource
from learner.staleness import StalenessPolicy
from learner.step_event import publish_step
from learner.workers import PolicyWorker, make_worker
from schemas import CheckpointV1, LearnerProgressV1, TopicOffset, TrajectoryV1
from stream.lifecycle import Managed
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, TopicRegistry

logger = logging.getLogger(__name__)

_SEEN_IDS = 1_000_000  # trajectory ids remembered for deduplication
_MAX_LINKS = 128  # span links per step: the SDK's default limit, which drops the rest anyway

_T = TypeVar("_T")


@dataclass
class LearnerStats:
    """Running totals of this process, for logs, tests and the benchmark."""

    steps: int = 0
    trained_trajectories: int = 0
    trained_tokens: int = 0
    processed_tokens: int = 0
    step_seconds: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    first_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of this process's first step (engine comparisons; that step also carries warm-up)."""
    first_step_seconds: float = 0.0
    first_step_tokens: int = 0
    checkpoints: list[CheckpointV1 | Path] = field(default_factory=list)
    """Published versions: their events, or their folders when no events are published."""
    states: list[Path] = field(default_factory=list)
    """Training-state folders written."""
    stale_tokens: int = 0
    """Sampled tokens masked for staleness in trained trajectories."""
    skipped_steps: int = 0
    """Steps the worker skipped (non-finite loss or gradient)."""
    short_groups: dict[str, int] = field(default_factory=dict)
    """Groups released at their deadline with members missing, by outcome (trained, dropped)."""


def skipped(values: dict[str, float]) -> bool:
    """Whether the worker reported that it skipped the step (non-finite loss or gradient)."""
    return values.get("nonfinite", 0.0) > 0


@dataclass
class _Ready:
    group: Group[Position]
    since: float


class Learner(Managed):
    """The off-policy learner process: ``start()``, ``wait()``, idempotent ``stop()``.

    With ``source=None`` it reads the trajectories topic and resumes from the newest training state
    in its checkpoint folder, continuing the version lineage of its newest published checkpoint;
    with a source given (benchmarks) it starts from ``model_dir`` and writes checkpoint folders
    without publishing events. Launched as several ranks, rank 0 does
    all of that and the others only follow its orders (see the module docstring).
    """

    def __init__(self, settings: LearnerSettings | None = None, kafka: KafkaSettings | None = None, *,
                 source: TrajectorySource | None = None, clock: Callable[[], float] = time.monotonic,
                 worker: Callable[[LearnerSettings, Path], PolicyWorker] | None = None) -> None:
        """Create the learner.

        Args:
            settings: What it trains and how (``OPENFORGE_LEARNER_*`` when None).
            kafka: Where it reads trajectories and publishes checkpoints.
            source: Trajectories from elsewhere than Kafka (benchmarks); see the class docstring.
            clock: Seconds, monotonic; times group deadlines and batch waits (tests drive it).
            worker: Makes the policy worker from the settings and the model folder to load; the
                engine the settings name by default. ``bench.loop`` passes one that sleeps for a
                measured step time instead of training, to run this loop's scheduling at speed.
        """
        self.settings = settings or LearnerSettings()
        self._clock = clock
        self._make_worker = worker if worker is not None else make_worker
        self.kafka = kafka or KafkaSettings()
        self.registry = TopicRegistry.from_settings(self.kafka)
        self._given_source = source
        self._source: TrajectorySource | None = source
        self._producer: EventProducer | None = None
        self._worker: PolicyWorker | None = None
        self._ledger = PositionLedger()
        self._groups: GroupBuffer[Position] = GroupBuffer(self.settings.group_timeout_s, clock,
                                                          self.settings.group_grace_s)
        self._ready: deque[_Ready] = deque()
        self._policy = StalenessPolicy(self.settings.max_staleness, self.settings.unversioned_as)
        self._unversioned_said: float | None = None  # when the last unversioned-and-stale error was logged
        self._metrics = m.LearnerMetrics()
        self._seen: OrderedDict[str, None] = OrderedDict()
        # The assembler span of each waiting trajectory, by trajectory id: the step span links to them.
        self._spans: dict[str, trace.SpanContext] = {}
        self._trained_since: list[str] = []
        self._dropped_since: dict[str, str] = {}
        self._since_checkpoint = 0
        """Steps since the last publish (serving weights and event)."""
        self._since_state = 0
        """Steps since the last training state."""
        self.step = 0
        self.version = 0
        """The newest weight version published: 0 for the initial weights, then one per checkpoint."""
        self.stats = LearnerStats()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        self._ranks: Ranks | None = None
        """Set when several ranks were launched; None in the one-process learner."""
        self._sent_at = 0.0
        self._ranks_desynced = False
        """A collective failed or was abandoned midway: orders would no longer line up."""
        self._reported_at = 0.0
        self._unreported = False
        self._progress_sent: asyncio.Future[Any] | None = None
        """The last progress notice's delivery, checked when the next one is sent or on stop."""

    @property
    def open_groups(self) -> int:
        """Groups still waiting for members (logs and tests)."""
        return len(self._groups)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resume (or start fresh), load the model, begin the loop in a task owned by this object.

        Raises:
            CheckpointError: the checkpoint to resume from is unusable, or a fresh start has no model_dir.
        """
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop()  # a failed start still holds connections
            raise

    async def _start(self) -> None:
        if launched_world_size() > 1:
            self._ranks = await asyncio.to_thread(Ranks.join, self.settings)
            if not self._ranks.leader:
                await self._start_follower()
                return
        model_dir = self.settings.model_dir
        if self._given_source is None:
            self._producer = EventProducer(self.kafka, registry=self.registry,
                                           client_id=f"{self.kafka.client_id}-learner")
            await self._producer.start()
            model_dir = await self._resume(model_dir)
            self._source = KafkaTrajectorySource(self.kafka, self.registry, self._producer,
                                                 start_offsets=self._ledger.watermarks(),
                                                 prefetch=self.settings.prefetch_records)
        if model_dir is None:
            raise CheckpointError("no checkpoint to resume from and no OPENFORGE_LEARNER_MODEL_DIR to start with")
        # Every rank loads the same folder: the one this rank resumes from.
        self._worker = await self._on_all_ranks(Order("start", model_dir=str(model_dir), version=self.version),
                                                partial(self._make_worker, self.settings, model_dir))
        if self._ranks is not None:
            logger.info("all %d ranks loaded %s", self._ranks.world_size, model_dir)
        assert self._source is not None
        await self._source.start()
        await self._report_progress()  # the launcher starts rollouts once it has heard from the learner
        self._task = asyncio.create_task(self._run(), name="learner")

    async def _resume(self, model_dir: Path | None) -> Path | None:
        """Pick up the newest training state (weights, optimizer, offsets) and the version lineage.

        The version continues from the newest published checkpoint even when it is newer than the
        training state (the steps between are trained again, from the same trajectories): a
        version number is never reused for other weights. Returns the folder to load.
        """
        root = self.settings.resolved_checkpoint_dir()
        remove_leftovers(root)
        latest = await latest_checkpoint(self.kafka, self.registry, self.settings.model_name)
        self.version = latest.version if latest is not None else 0
        folder = newest_training_state(root)
        if folder is None:
            if latest is not None:
                logger.warning("%s has published v%d but %s holds no training state: starting again from %s",
                               self.settings.model_name, latest.version, root, model_dir)
            return model_dir
        state = read_state(folder)
        self.step, self.version = state.step, max(self.version, state.version)
        self._ledger = PositionLedger.resume(state.watermarks, state.finished_above)
        logger.info("resuming %s from %s (step %d; next version v%d) at %s", self.settings.model_name, folder,
                    state.step, self.version + 1, state.watermarks)
        self._retain()  # what an earlier run left beyond the policy
        return folder

    async def wait(self) -> None:
        """Return when the loop ended (``max_steps``, exhausted source, stop); re-raise its failure."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Let the running step finish, checkpoint unsaved steps, close connections. Idempotent.

        With several ranks, rank 0 then tells the others to leave (``stop``, or ``abort`` when it
        failed); the other ranks' ``stop`` waits for that order rather than leaving on their own,
        because rank 0's final checkpoint still needs them.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._ranks is not None and not self._ranks.leader:
            await self._stop_follower()
            return
        ended_cleanly = False
        try:
            if self._task is not None:
                done, _ = await asyncio.wait({self._task}, timeout=self.settings.drain_timeout_s)
                if not done:
                    logger.warning("drain deadline passed; abandoning the running step (redone after restart)")
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                elif not self._task.cancelled() and self._task.exception() is None:
                    if self._since_checkpoint:
                        await self._publish()
                    if self._since_state:
                        await self._save_state()
                    ended_cleanly = True
        finally:
            if self._ranks is not None:
                await self._dismiss_followers(ended_cleanly)
            if self._source is not None:
                await self._source.stop()
            if self._progress_sent is not None:
                try:
                    await self._progress_sent
                except KafkaError as exc:  # the launcher reads the next learner's notice instead
                    logger.warning("the last progress notice was not delivered: %s", exc)
            if self._producer is not None:
                await self._producer.stop()

    # -- several ranks ---------------------------------------------------------------------------

    async def _on_all_ranks(self, order: Order, work: Callable[[], _T]) -> _T:
        """Run ``work`` in a thread; with several ranks, first order the others to do their part of it.

        The order and the work share one thread so that this rank's collectives keep one order.
        """
        if self._ranks is None:
            return await asyncio.to_thread(work)
        ranks = self._ranks

        def lead() -> _T:
            ranks.send(order)
            self._sent_at = time.monotonic()
            return work()

        try:
            return await asyncio.to_thread(lead)
        except BaseException:
            # Cancelled or failed midway: the others may sit in a collective this rank never finishes.
            self._ranks_desynced = True
            raise

    async def _dismiss_followers(self, ended_cleanly: bool) -> None:
        assert self._ranks is not None
        try:
            if self._ranks_desynced:
                logger.error("a collective failed or was abandoned midway; the other ranks fail when this "
                             "process exits or after OPENFORGE_LEARNER_RANK_TIMEOUT_S")
                return
            reason = "" if ended_cleanly else "rank 0 stopped on an error (see its log)"
            order = Order("stop") if ended_cleanly else Order("abort", reason=reason)
            try:
                await asyncio.to_thread(self._ranks.send, order)
            except Exception:
                logger.exception("telling the other ranks to %s failed", order.kind)
        finally:
            self._ranks.close()

    async def _start_follower(self) -> None:
        assert self._ranks is not None
        order = await asyncio.to_thread(self._ranks.receive)
        if order.kind == "abort":
            raise RuntimeError(f"rank 0 failed to start: {order.reason}")
        if order.kind != "start" or order.model_dir is None:
            raise RuntimeError(f"rank 0 sent {order.kind!r} before 'start'")
        self.version = order.version
        self._worker = await asyncio.to_thread(self._make_worker, self.settings, Path(order.model_dir))
        self._task = asyncio.create_task(asyncio.to_thread(self._follow), name="learner-follower")

    def _follow(self) -> None:
        """The other ranks' loop (in a thread): do rank 0's orders until it says stop."""
        assert self._ranks is not None
        assert self._worker is not None
        while True:
            order = self._ranks.receive()
            if order.kind == "step" and order.batch is not None:
                values = self._worker.train_step(order.batch)
                if not skipped(values):  # every rank sees the same reduced loss and gradient norm
                    self.step += 1
                    self.stats.steps += 1
            elif order.kind == "publish":
                # Takes part in gathering each tensor; only rank 0 writes, so the folder is a name only.
                self._worker.save_serving(serving_folder(self.settings.resolved_checkpoint_dir(), order.version))
                self.version = order.version
            elif order.kind == "save_state" and order.folder is not None:
                self._worker.save_state(Path(order.folder))  # each rank writes its own shards there
            elif order.kind == "stop":
                return
            elif order.kind == "abort":
                raise RuntimeError(f"rank 0 stopped: {order.reason}")
            elif order.kind != "idle":
                raise RuntimeError(f"unexpected order {order.kind!r} from rank 0")

    async def _stop_follower(self) -> None:
        assert self._ranks is not None
        try:
            if self._task is not None:
                # No deadline of its own: rank 0's stop order ends it, or the group's timeout does.
                await asyncio.wait({self._task})
        finally:
            self._ranks.close()

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._source is not None
        steps_here = 0
        while not self._stopping.is_set():
            item = await self._source.get(timeout_s=0.05 if self._ready else 0.2)
            if item is not None:
                self._accept(item)
                self._unreported = True
            if self._unreported and time.monotonic() - self._reported_at >= self.settings.progress_interval_s:
                await self._report_progress()
            now = self._clock()
            if self._ranks is not None and time.monotonic() - self._sent_at >= self._ranks.keepalive_s:
                await self._on_all_ranks(Order("idle"), lambda: None)
            for group in self._groups.expired():
                logger.info("group %s passed its deadline with %d of %s members", group.task_id,
                            len(group.members), group.expected or "?")
                self._ready.append(_Ready(group, now))
            finishing = self._source.exhausted and item is None
            if finishing:
                for group in self._groups.expired_all():
                    self._ready.append(_Ready(group, now))
            if self._batch_due(now, finishing):
                groups = [self._ready.popleft().group
                          for _ in range(min(self.settings.groups_per_step, len(self._ready)))]
                if await self._train(groups):
                    steps_here += 1
                await self._report_progress()
                if self.settings.max_steps is not None and steps_here >= self.settings.max_steps:
                    return
            elif finishing and not self._ready:
                return

    def _accept(self, item: Incoming) -> None:
        position, trajectory = item.position, item.trajectory
        if self._ledger.already_finished(position):
            return  # included in the checkpoint this run resumed from
        self._ledger.read(position)
        if trajectory is None:  # dead-lettered by the source
            self._ledger.finish(position)
            return
        if trajectory.trajectory_id in self._seen:
            self._drop(trajectory, m.DROP_DUPLICATE)
            self._ledger.finish(position)
            return
        group, added = self._groups.add(trajectory, position)
        if added != "added":
            if added == "late":
                logger.warning("trajectory %s of task %s arrived after its group was released; dropped",
                               trajectory.trajectory_id, trajectory.task_id)
            self._drop(trajectory, m.DROP_LATE if added == "late" else m.DROP_DUPLICATE)
            self._ledger.finish(position)
            return
        self._seen[trajectory.trajectory_id] = None
        if item.span_context is not None:
            self._spans[trajectory.trajectory_id] = item.span_context
        if len(self._seen) > _SEEN_IDS:
            self._seen.popitem(last=False)
        if group is not None:
            self._ready.append(_Ready(group, self._clock()))

    def _batch_due(self, now: float, finishing: bool) -> bool:
        if not self._ready:
            return False
        return (len(self._ready) >= self.settings.groups_per_step or finishing
                or now - self._ready[0].since >= self.settings.batch_wait_s)

    def _drop(self, trajectory: TrajectoryV1, reason: str) -> None:
        if reason != m.DROP_DUPLICATE:  # a duplicate's id belongs to the copy that is kept
            self._spans.pop(trajectory.trajectory_id, None)
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        self._dropped_since[trajectory.trajectory_id] = reason
        self._metrics.dropped.add(1, {"reason": reason})

    def _unversioned_stale(self, trajectory: TrajectoryV1) -> None:
        """Say, at most once a minute, why trajectories without weight versions are all dropped.

        Engines that report no versions make every token count as ``unversioned_as``: once more
        than ``max_staleness`` versions are published, all data is stale, no step is taken, and
        the run stops learning with nothing but a drop counter to show for it.
        """
        now = time.monotonic()
        if self._unversioned_said is not None and now - self._unversioned_said < 60:
            return
        self._unversioned_said = now
        logger.error("learner: trajectory %s carries no weight version, so it counts as version %d, %d versions "
                     "old, and is dropped as stale, as will every one like it: serve with weight versions "
                     "(vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out, the publisher loading each "
                     "checkpoint; docs/learner.md, Versions and staleness)", trajectory.trajectory_id,
                     self.settings.unversioned_as, self.version - self.settings.unversioned_as)

    def build_batch(self, groups: list[Group[Position]]) -> tuple[TrainBatch, list[TrajectoryV1]]:
        """Filter the groups (infrastructure failures, staleness, size), compute advantages, make rows.

        Tokens older than the staleness bound are masked; a trajectory leaves the step (``stale``)
        only when none of its trained tokens is left. A group released short at its deadline
        follows the same rule as a complete one: it trains if at least ``min_group_size`` usable
        members remain, else its members are dropped (``small_group``); either way it is counted.
        """
        from learner.algos import compute_advantages

        members: list[TrajectoryV1] = []
        masks: dict[str, list[list[int]]] = {}
        stuck: set[str] = set()
        staleness: list[int] = []
        stale_tokens = 0
        for group in groups:
            for trajectory, _ in group.infrastructure_failures:
                self._drop(trajectory, m.DROP_INFRA)
            fresh: list[tuple[TrajectoryV1, list[list[int]], int, int]] = []
            for trajectory, _ in group.usable:
                self._metrics.staleness.record(self._policy.staleness(trajectory, self.version))
                kept = [self._policy.fresh(sample, self.version) for sample in trajectory.samples]
                masked = sum(k.masked for k in kept)
                if masked and not any(k.kept for k in kept):
                    if not any(sample.weight_versions for sample in trajectory.samples):
                        self._unversioned_stale(trajectory)
                    self._drop(trajectory, m.DROP_STALE)
                    continue
                ages = [k.oldest_kept_age for k in kept if k.oldest_kept_age is not None]
                fresh.append((trajectory, [k.loss_mask for k in kept], max(ages, default=0), masked))
            if len(fresh) < self.settings.min_group_size:
                reason: str | None = m.DROP_SMALL_GROUP
            elif self.settings.filter_alike_groups and len({self._reward(t) for t, *_ in fresh}) == 1:
                reason = None if self._is_stuck(self._reward(fresh[0][0])) else m.DROP_ALIKE
                if reason is None:
                    stuck.update(t.trajectory_id for t, *_ in fresh)
            else:
                reason = None
            if group.short:
                outcome = m.SHORT_DROPPED if reason == m.DROP_SMALL_GROUP else m.SHORT_TRAINED
                self._metrics.short_groups.add(1, {"outcome": outcome})
                self.stats.short_groups[outcome] = self.stats.short_groups.get(outcome, 0) + 1
            for trajectory, trajectory_masks, age, masked in fresh:
                if reason is None:
                    members.append(trajectory)
                    masks[trajectory.trajectory_id] = trajectory_masks
                    staleness.append(age)
                    stale_tokens += masked
                else:
                    self._drop(trajectory, reason)
        rewards = [self._reward(t) for t in members]
        advantages = compute_advantages(rewards, [t.task_id for t in members],
                                        estimator=self.settings.advantage_estimator,
                                        norm_adv_by_std=self.settings.norm_adv_by_std)
        everywhere = self.settings.entropy_bonus_scope == "all"
        rows: list[Row] = []
        for trajectory, advantage in zip(members, advantages, strict=True):
            for sample, loss_mask in zip(trajectory.samples, masks[trajectory.trajectory_id], strict=True):
                if not any(loss_mask) or not sample.prompt_ids:
                    continue
                rows.append(Row(
                    input_ids=[*sample.prompt_ids, *sample.completion_ids], prompt_len=len(sample.prompt_ids),
                    loss_mask=loss_mask, behavior_logprobs=list(sample.behavior_logprobs),
                    advantage=advantage, entropy_bonus=everywhere or trajectory.trajectory_id in stuck,
                ))
        info = {"trajectories": float(len(members)), "stale_tokens": float(stale_tokens)}
        if not everywhere:
            info["stuck_trajectories"] = float(len(stuck))
        if rewards:
            info["reward_mean"] = sum(rewards) / len(rewards)
        if staleness:
            info["staleness_mean"] = sum(staleness) / len(staleness)
            info["staleness_max"] = float(max(staleness))
        return TrainBatch(rows, info), members

    def _is_stuck(self, reward: float) -> bool:
        """Whether a group that all scored ``reward`` is stuck below the best (kept for the bonus)."""
        best = self.settings.max_reward
        return self.settings.entropy_bonus_scope == "stuck" and best is not None and reward < best

    def _reward(self, trajectory: TrajectoryV1) -> float:
        return self.settings.missing_reward if trajectory.reward is None else trajectory.reward

    async def _train(self, groups: list[Group[Position]]) -> bool:
        """Train one step on ``groups``; return whether an optimizer step was taken."""
        assert self._worker is not None
        batch, members = self.build_batch(groups)
        took_step = bool(batch.rows) and batch.trained_tokens > 0
        if took_step:
            # One span per step, linked to the assembler span of every trajectory it trains on, so a
            # model call's trace leads (proxy -> assembler -> learner) to the step that used it.
            links = [trace.Link(c) for c in (self._spans.pop(t.trajectory_id, None) for t in members) if c]
            with m.tracer.start_as_current_span(
                    "learner step", links=links[:_MAX_LINKS],
                    attributes={"openforge.step": self.step + 1, "openforge.trajectories": len(members),
                                "openforge.tokens": batch.trained_tokens}):
                started = time.perf_counter()
                values = await self._on_all_ranks(Order("step", batch=batch),
                                                  partial(self._worker.train_step, batch))
                elapsed = time.perf_counter() - started
            if skipped(values):
                self._skip(values, members, groups)
                return False
            self.step += 1
            self._since_checkpoint += 1
            self._since_state += 1
            values = {**values, **batch.info, "step": float(self.step), "version": float(self.version)}
            self.stats.steps += 1
            self.stats.trained_trajectories += len(members)
            self.stats.trained_tokens += batch.trained_tokens
            self.stats.processed_tokens += batch.total_tokens
            self.stats.step_seconds += elapsed
            self.stats.last_metrics = values
            if self.stats.steps == 1:
                self.stats.first_metrics = values
                self.stats.first_step_seconds, self.stats.first_step_tokens = elapsed, batch.total_tokens
            self._trained_since.extend(t.trajectory_id for t in members)
            self._metrics.steps.add(1)
            self._metrics.tokens.add(batch.trained_tokens)
            stale_tokens = int(batch.info.get("stale_tokens", 0))
            self.stats.stale_tokens += stale_tokens
            if stale_tokens:
                self._metrics.stale_tokens.add(stale_tokens)
            self._metrics.trajectories.add(len(members))
            self._metrics.step_seconds.record(elapsed)
            self._metrics.record_step(values, self._worker.importance_weights())
            logger.info("step %d: loss %.4f, reward %.3f, entropy %.3f, %d trajectories, %d tokens, %.2fs",
                        self.step, values.get("loss", math.nan), values.get("reward_mean", math.nan),
                        values.get("entropy", math.nan), len(members), batch.trained_tokens, elapsed)
            await publish_step(self._producer, self.settings, step=self.step, version=self.version, duration_s=elapsed,
                               trained=members, considered=[t for g in groups for t, _ in g.members],
                               dropped=self._dropped_since, metrics=values,
                               importance_weights=self._worker.importance_weights())
        else:
            for trajectory in members:
                self._drop(trajectory, m.DROP_NO_TOKENS)
        for group in groups:
            for _, position in group.members:
                self._ledger.finish(position)
        if took_step and self._since_checkpoint >= self.settings.checkpoint_every:
            await self._publish()
        if took_step and self._since_state >= self.settings.state_every:
            await self._save_state()
        return took_step

    def _skip(self, values: dict[str, float], members: list[TrajectoryV1], groups: list[Group[Position]]) -> None:
        """The worker left the weights untouched (non-finite loss or gradient): nothing advances.

        No step, no version, no checkpoint; the trajectories are consumed and counted as dropped
        with their own reason, so a restart does not feed the same poison again.
        """
        self.stats.skipped_steps += 1
        self._metrics.skipped_steps.add(1)
        logger.warning("step skipped: non-finite loss %s or gradient norm %s on %d trajectories; weights, "
                       "version (v%d) and checkpoints unchanged", values.get("loss"), values.get("grad_norm"),
                       len(members), self.version)
        for trajectory in members:
            self._drop(trajectory, m.DROP_NONFINITE)
        for group in groups:
            for _, position in group.members:
                self._ledger.finish(position)

    def _totals(self) -> dict[str, float]:
        """What this process left out so far, for the checkpoint's metrics (dashboards without a collector)."""
        totals = {f"dropped_{reason}": float(n) for reason, n in self.stats.dropped.items()}
        totals |= {"stale_tokens_total": float(self.stats.stale_tokens),
                   "skipped_steps_total": float(self.stats.skipped_steps)}
        return totals | {f"short_groups_{outcome}": float(n) for outcome, n in self.stats.short_groups.items()}

    async def _report_progress(self) -> None:
        """Publish where the learner is (version, steps, trajectories waiting) for the launcher's pacing."""
        self._reported_at, self._unreported = time.monotonic(), False
        source = self._source
        if self._producer is None or not isinstance(source, KafkaTrajectorySource):
            return
        s = self.settings
        read = await source.read_offsets()
        if self._progress_sent is not None:
            await self._progress_sent  # the previous notice's delivery: a failure surfaces here
        # Queued, not awaited: the next step need not wait for the broker's acknowledgement of a
        # notice only the launcher reads (on a busy broker that wait was a tenth of a second a step).
        self._progress_sent = await self._producer.send(CHECKPOINTS, LearnerProgressV1(
            model=s.model_name, version=self.version, step=self.step, steps_since_checkpoint=self._since_checkpoint,
            pending=source.in_hand + self._ledger.pending_count(),
            read_offsets=[TopicOffset(topic=t, partition=p, offset=o) for (t, p), o in sorted(read.items())],
            max_staleness=s.max_staleness, checkpoint_every=s.checkpoint_every, groups_per_step=s.groups_per_step,
            min_group_size=s.min_group_size))

    async def _publish(self) -> None:
        """Write the serving weights of the next version and publish its event.

        Versions count publishes, so engines serve every one. The event goes out only once the
        folder is complete and durable.
        """
        assert self._worker is not None
        version = self.version + 1
        final = serving_folder(self.settings.resolved_checkpoint_dir(), version)
        write = partial(write_checkpoint_folder, final, self._worker.save_serving, manifest=True)
        folder = await self._on_all_ranks(Order("publish", version=version), write)
        self.version = version
        self._since_checkpoint = 0
        if self._producer is None:
            self.stats.checkpoints.append(folder)
        else:
            event = CheckpointV1(
                model=self.settings.model_name, version=self.version, uri=str(folder), step=self.step,
                consumed_offsets=[TopicOffset(topic=t, partition=p, offset=o)
                                  for (t, p), o in sorted(self._ledger.watermarks().items())],
                metrics={**{k: v for k, v in self.stats.last_metrics.items() if math.isfinite(v)},
                         **self._totals(),
                         "version": float(self.version)},  # this checkpoint's, not the one its last step trained under
            )
            await self._producer.publish(CHECKPOINTS, event)
            self.stats.checkpoints.append(event)
            logger.info("published v%d at %s (step %d)", self.version, folder, self.step)
        self._retain()

    async def _save_state(self) -> None:
        """Write a training state (master weights, optimizer, consumed offsets): what a restart resumes from."""
        assert self._worker is not None
        state = LearnerState(self.version, self.step, self._ledger.watermarks(), self._ledger.finished_above(),
                             list(self._trained_since), dict(self._dropped_since))
        final = state_folder(self.settings.resolved_checkpoint_dir(), self.step)
        # Made before the order goes out: every rank writes its shards into this very folder.
        tmp = temporary_folder(final)
        folder = await self._on_all_ranks(
            Order("save_state", folder=str(tmp)),
            partial(write_checkpoint_folder, final, self._worker.save_state, state, tmp))
        self._trained_since.clear()
        self._dropped_since.clear()
        self._since_state = 0
        self.stats.states.append(folder)
        logger.info("training state of step %d at %s (offsets %s)", self.step, folder, state.watermarks)
        self._retain()

    def _retain(self) -> None:
        s = self.settings
        root = s.resolved_checkpoint_dir()
        apply_retention(root, Retention(s.serving_keep_last, s.serving_keep_every),
                        Retention(s.state_keep_last, s.state_keep_every), self.version,
                        max(training_states(root), default=None))
