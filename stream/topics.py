"""The topic registry: every topic OpenForge uses, declared once.

Names, partition counts, retention, compaction and size limits live here and
nowhere else; `openforge topics create` materializes them and the producer
checks event sizes and types against them before anything reaches the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from stream.settings import KafkaSettings

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_DAY_MS = 24 * 60 * 60 * 1000


@dataclass(frozen=True)
class TopicSpec:
    """One declared topic, before the experiment prefix is applied."""

    base_name: str
    """Name without prefix, e.g. ``openforge.calls.v1``."""
    partitions: int
    """Default partition count; the unit of scale-out of its consumers."""
    schemas: tuple[str, ...]
    """Event schema names allowed on the topic; anything else is refused on produce
    and dead-lettered on consume."""
    key: str
    """Which event field keys the topic (documentation; events compute it)."""
    max_message_bytes: int = 1 * _MIB
    """Largest record (after compression) the topic accepts."""
    retention_ms: int | None = 7 * _DAY_MS
    """How long records are kept; None keeps them forever."""
    compacted: bool = False
    """Keep only the latest record per key (checkpoints: latest per model)."""
    description: str = ""

    def configs(self) -> dict[str, str]:
        """Topic-level configs sent on creation."""
        configs = {
            "max.message.bytes": str(self.max_message_bytes),
            "cleanup.policy": "compact" if self.compacted else "delete",
        }
        configs["retention.ms"] = "-1" if self.retention_ms is None else str(self.retention_ms)
        return configs


TASKS = TopicSpec(
    "openforge.tasks.v1", 3, ("task",), "task_id",
    description="Tasks to run; one task becomes group_size rollouts.",
)
CALLS = TopicSpec(
    "openforge.calls.v1", 6, ("model_call",), "rollout_id",
    # A 100k-token prompt is ~0.5 MiB of packed ids plus its text; leave ample room.
    max_message_bytes=16 * _MIB,
    description="Every model call seen by the proxy, token-exact.",
)
ROLLOUTS = TopicSpec(
    "openforge.rollouts.v1", 6, ("rollout",), "rollout_id",
    description="Rollout lifecycle from the launcher and pod watcher.",
)
REWARDS = TopicSpec(
    "openforge.rewards.v1", 6, ("reward",), "rollout_id",
    description="Rewards posted by verifiers, never by agents.",
)
TRAJECTORIES = TopicSpec(
    "openforge.trajectories.v1", 3, ("trajectory",), "task_id",
    # Many calls of long prompts; merged samples keep most trajectories far smaller.
    max_message_bytes=32 * _MIB,
    description="Token-exact training samples, written transactionally by the assembler.",
)
CHECKPOINTS = TopicSpec(
    "openforge.checkpoints.v1", 1, ("checkpoint", "checkpoint_applied", "learner_progress"), "model",
    retention_ms=None, compacted=True,
    description="Checkpoints written and applied, and the learner's progress; compacted to the latest per key.",
)
STEPS = TopicSpec(
    "openforge.steps.v1", 1, ("learner_step",), "model",
    # A step of a few thousand trajectories lists each with a few hundred bytes.
    max_message_bytes=8 * _MIB, retention_ms=30 * _DAY_MS,
    description="One record per learner step: the trajectories it trained on, advantages, importance weights.",
)
DEAD_LETTERS = TopicSpec(
    "openforge.dlq.v1", 1, ("dead_letter",), "original key",
    # Holds a base64 copy of the largest record any other topic accepts.
    max_message_bytes=48 * _MIB, retention_ms=30 * _DAY_MS,
    description="Events a consumer could not decode or handle, with the reason.",
)

ALL_TOPICS: tuple[TopicSpec, ...] = (
    TASKS, CALLS, ROLLOUTS, REWARDS, TRAJECTORIES, CHECKPOINTS, STEPS, DEAD_LETTERS,
)


@dataclass(frozen=True)
class Topic:
    """A registry topic resolved for one deployment: prefixed name and partitions."""

    name: str
    partitions: int
    spec: TopicSpec

    def configs(self) -> dict[str, str]:
        """Topic-level configs sent on creation."""
        return self.spec.configs()


class TopicRegistry:
    """Resolves the declared topics under a prefix and partition override."""

    def __init__(self, prefix: str = "", partitions: int | None = None,
                 specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> None:
        self.prefix = prefix
        self._topics = {
            spec.base_name: Topic(prefix + spec.base_name, partitions or spec.partitions, spec)
            for spec in specs
        }
        self._by_name = {topic.name: topic for topic in self._topics.values()}

    @classmethod
    def from_settings(cls, settings: KafkaSettings) -> TopicRegistry:
        """The registry as configured by ``OPENFORGE_KAFKA_*``."""
        return cls(settings.topic_prefix, settings.partitions)

    def __iter__(self) -> Iterator[Topic]:
        return iter(self._topics.values())

    def __getitem__(self, spec: TopicSpec) -> Topic:
        return self._topics[spec.base_name]

    def by_name(self, name: str) -> Topic | None:
        """The registry topic with this full (prefixed) name, if any."""
        return self._by_name.get(name)

    def resolve(self, name: str) -> Topic:
        """Accept a full name, a base name or a short alias (``calls``, ``dlq``).

        Raises:
            KeyError: the name matches no registry topic; the message lists them.
        """
        if topic := self._by_name.get(name):
            return topic
        if topic := self._topics.get(name):
            return topic
        for topic in self:
            if topic.spec.base_name.split(".")[1] == name:
                return topic
        known = ", ".join(t.spec.base_name.split(".")[1] for t in self)
        raise KeyError(f"unknown topic {name!r}; registry topics: {known}")

    def __len__(self) -> int:
        return len(self._topics)


class MissingTopicsError(RuntimeError):
    """Topics a process reads do not exist on the cluster.

    Brokers here never auto-create topics (their partitions and configs come from this
    registry). aiokafka's consumer then fails its start with a bare
    ``UnknownTopicOrPartitionError`` that names nothing; this error says which topics and
    what to do.
    """

    @classmethod
    def of(cls, missing: list[str], bootstrap: str) -> MissingTopicsError:
        """The error for these topic names, with the remedy."""
        plural = len(missing) > 1
        return cls(f"topic{'s' if plural else ''} {', '.join(missing)} {'do' if plural else 'does'} not exist "
                   f"on {bootstrap}; create the registry's topics with `openforge topics create` (on a "
                   "cluster, the chart's KafkaTopic resources do)")


class NotAuthorizedError(RuntimeError):
    """The cluster's ACLs do not let this client write to some topics.

    A configuration to fix, not a record to refuse: an operator who forgot one topic's ACL (a
    topic added in a new release, a prefix mistyped) grants it, and what waited is sent then.
    aiokafka's ``TopicAuthorizationFailedError`` names the topic but neither the principal the
    broker saw nor the remedy; this error says both.
    """

    @classmethod
    def of(cls, topics: Iterable[str], kafka: KafkaSettings, *, cluster: bool = False) -> NotAuthorizedError:
        """The error for these topic names, naming this client's principal and the ACLs to grant.

        ``cluster``: the broker refused the idempotent producer itself (``ClusterAuthorizationFailed``),
        which WRITE on any topic allows from Kafka 3.0 (KIP-679), and IdempotentWrite on the cluster before.
        """
        names = sorted(set(topics))
        user = principal(kafka)
        shown = user if user.startswith("User:") else "User:<principal>"
        grant = (f"kafka-acls.sh --bootstrap-server {kafka.bootstrap_servers} --add --allow-principal {shown} "
                 "--operation Write --operation Describe")
        per_topic = "".join(f" --topic {name}" for name in names) or " --topic <topic>"
        if cluster or not names:
            return cls(f"the cluster at {kafka.bootstrap_servers} does not let {user} use an idempotent producer: "
                       f"grant it WRITE and DESCRIBE on the topics it writes, for example `{grant}{per_topic}` "
                       f"(brokers before Kafka 3.0 also want `--operation IdempotentWrite --cluster`; on Strimzi, "
                       f"the KafkaUser's acls)")
        return cls(f"the cluster at {kafka.bootstrap_servers} does not let {user} write to topic"
                   f"{'s' if len(names) > 1 else ''} {', '.join(names)}; grant it WRITE and DESCRIBE there, for "
                   f"example `{grant}{per_topic}` (on Strimzi, the KafkaUser's acls)")


def principal(kafka: KafkaSettings) -> str:
    """Who the brokers see this client as, as far as its settings tell (the name ACLs are granted to)."""
    if kafka.sasl_mechanism == "OAUTHBEARER":
        return f"the principal of OAuth client {kafka.sasl_username!r} (its token's subject)"
    if kafka.sasl_mechanism is not None:
        return f"User:{kafka.sasl_username}"
    if kafka.ssl_certfile is not None:
        return f"the principal of the certificate {kafka.ssl_certfile} (User:CN=...)"
    return "User:ANONYMOUS"


def unauthorized_topics(exc: BaseException, fallback: Iterable[str]) -> list[str] | None:
    """The topics an authorization failure names (``fallback`` where it names none); None if ``exc`` is not one.

    aiokafka raises ``TopicAuthorizationFailedError`` with the topic (a produce answer, or the
    metadata of a topic this client may not describe), and ``ClusterAuthorizationFailedError``
    at an idempotent producer's start when the principal may write nowhere at all.
    """
    from aiokafka.errors import ClusterAuthorizationFailedError, TopicAuthorizationFailedError

    if isinstance(exc, ClusterAuthorizationFailedError):
        return sorted(set(fallback))
    if not isinstance(exc, TopicAuthorizationFailedError):
        return None
    named = exc.args[0] if exc.args else None
    if isinstance(named, str):
        return [named]
    if isinstance(named, set | frozenset | list | tuple) and named and all(isinstance(n, str) for n in named):
        return sorted(named)
    return sorted(set(fallback))


async def start_consumer(consumer: Any, names: Iterable[str], kafka: KafkaSettings) -> None:
    """Start a consumer subscribed to ``names``, or raise :class:`MissingTopicsError`.

    The topics are looked up first: a group consumer started on a missing topic waits out its
    whole request timeout (40 s by default) before it fails, which reads as a hang to someone
    who forgot ``openforge topics create``. On any error (a missing topic, an unreachable
    cluster) the consumer is closed, so nothing is left open.

    Args:
        consumer: An ``AIOKafkaConsumer``, subscribed but not started.
        names: Full names of the topics it reads.
        kafka: How to reach the cluster (to ask which topics exist; its address is in the message).
    """
    from aiokafka.errors import UnknownTopicOrPartitionError

    wanted = sorted(set(names))
    bootstrap = kafka.bootstrap_servers
    try:
        missing = await _missing_topics(wanted, kafka)
        if not missing:
            try:
                await consumer.start()
                return
            except UnknownTopicOrPartitionError:
                missing = await _missing_topics(wanted, kafka)  # deleted since the lookup?
                if not missing:  # shown to the lookup by a broker the consumer did not ask
                    raise MissingTopicsError(
                        f"a broker of {bootstrap} did not yet know of {', '.join(wanted)}, which the "
                        "cluster shows: topics created a moment ago; start again") from None
        raise MissingTopicsError.of(missing, bootstrap)
    except BaseException:
        with contextlib.suppress(Exception):
            await consumer.stop()
        raise


async def _missing_topics(names: list[str], kafka: KafkaSettings) -> list[str]:
    """Those of ``names`` the cluster's metadata does not show."""
    from aiokafka import AIOKafkaConsumer

    probe = AIOKafkaConsumer(**kafka.client_kwargs())
    try:
        await probe.start()
        present = await probe.topics()
    finally:
        await probe.stop()
    return [name for name in names if name not in present]


async def refuse_missing_topics(kafka: KafkaSettings, specs: Iterable[TopicSpec], *, timeout_s: float = 10.0) -> None:
    """At start: raise :class:`MissingTopicsError` when Kafka answers and lacks one of ``specs``.

    For a process that keeps working while Kafka is away (the proxy journals calls, the flight
    recorder serves its index): a Kafka that does not answer within ``timeout_s`` is logged and no
    reason not to start, but one that answers without the topics is a deployment nobody finished,
    which would otherwise look healthy while its data waits for topics nobody creates.
    """
    registry = TopicRegistry.from_settings(kafka)
    try:
        async with asyncio.timeout(timeout_s):
            missing = await _missing_topics([registry[spec].name for spec in specs], kafka)
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, timed out: start without it
        logger.warning("Kafka at %s did not answer at start (%s); starting without it",
                       kafka.bootstrap_servers, type(exc).__name__)
        return
    if missing:
        raise MissingTopicsError.of(missing, kafka.bootstrap_servers)
