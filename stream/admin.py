"""Cluster administration for the registry topics: create, list, describe, lag."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError
from aiokafka.structs import TopicPartition

from stream.settings import KafkaSettings
from stream.topics import Topic, TopicRegistry

logger = logging.getLogger(__name__)

VISIBLE_TIMEOUT_S = 30.0
"""How long ``create_topics`` waits for the brokers to show what the controller created."""

_VISIBLE_POLL_S = 0.1

_VISIBLE_ASK_S = 5.0
"""How long one broker may take to answer the visibility wait's metadata request.

The brokers are asked at once, each under this bound: one that stopped answering (a paused
process, a dropped network) is passed over after it instead of holding the wait for the
client's whole request timeout (40 s by default) on every poll. When none answers, the wait
polls on until its own deadline: one slow answer is not a failure."""


@dataclass(frozen=True)
class CreateResult:
    """What `topics create` did to one topic."""

    name: str
    created: bool
    drift: tuple[str, ...] = ()
    """Differences between an existing topic and the registry (never changed silently)."""


@dataclass(frozen=True)
class PartitionInfo:
    """One partition's placement and offsets."""

    partition: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class TopicDescription:
    """A topic as the cluster sees it."""

    name: str
    partitions: tuple[PartitionInfo, ...]
    configs: dict[str, str] = field(default_factory=dict)
    registry: Topic | None = None

    @property
    def records(self) -> int:
        """Records currently retained (end minus begin, summed over partitions)."""
        return sum(p.end - p.begin for p in self.partitions)


@dataclass(frozen=True)
class LagRow:
    """One consumer group's position on one partition."""

    group: str
    topic: str
    partition: int
    committed: int | None
    end: int

    @property
    def lag(self) -> int:
        """Records not yet committed by the group (everything if it never committed)."""
        return self.end - (self.committed or 0)


async def bootstrap_refusal(settings: KafkaSettings, timeout_s: float = 10.0) -> str | None:
    """Why the bootstrap brokers turn a client away, or None when one of them lets it in.

    aiokafka only logs why each bootstrap address failed and then raises "Unable to bootstrap",
    which reads as a network fault also when the cluster refused the credentials or the TLS
    handshake. This asks each address once with the same settings and returns the first reason.
    """
    from aiokafka.conn import create_conn

    reasons: list[str] = []
    provider = settings.oauth_token_provider()
    if provider is not None:  # after a refused token: wait to ask for a new one, so the broker can say why
        await asyncio.sleep(min(provider.pause_after_refusal_s(), timeout_s))
    for address in filter(None, (part.strip() for part in settings.bootstrap_servers.split(","))):
        host, colon, port = address.rpartition(":")
        if not colon or host.endswith(":") or not port.isdigit():  # no port (IPv6 needs brackets): aiokafka's default
            host, port = address, "9092"
        try:
            async with asyncio.timeout(timeout_s):
                conn = await create_conn(host.strip("[]"), int(port), client_id=f"{settings.client_id}-probe",
                                         request_timeout_ms=int(timeout_s * 1000), **settings.client_options())
        except Exception as exc:  # noqa: BLE001 - every reason is worth reporting
            reasons.append(f"{address}: {exc!r}")
            continue
        conn.close()
        return None
    return "; ".join(reasons) or None


def _usable(meta: dict[str, Any] | None) -> bool:
    """A topic's metadata shows it, with partitions that each have a leader."""
    if meta is None or meta["error_code"] != 0 or not meta["partitions"]:
        return False
    return all(p["error_code"] == 0 and p["leader"] >= 0 for p in meta["partitions"])


class KafkaAdmin:
    """Admin client plus an offset reader, started and stopped together."""

    def __init__(self, settings: KafkaSettings | None = None, registry: TopicRegistry | None = None) -> None:
        self.settings = settings or KafkaSettings()
        self.registry = registry or TopicRegistry.from_settings(self.settings)
        self._admin, self._offsets = self._clients()
        self._started = False
        self._spent = False  # closed by a failed start; aiokafka's clients do not start again

    def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        kwargs = {**self.settings.client_kwargs(), "client_id": f"{self.settings.client_id}-admin",
                  "request_timeout_ms": self.settings.request_timeout_ms}
        return AIOKafkaAdminClient(**kwargs), AIOKafkaConsumer(**kwargs, enable_auto_commit=False)

    async def start(self) -> None:
        """Connect both clients; after a start that failed (a cluster not up yet), try again."""
        if not self._started:
            if self._spent:  # made now, not at the failure: a client never started warns when collected
                self._admin, self._offsets = self._clients()
                self._spent = False
            try:
                await self._admin.start()
                await self._offsets.start()
                # aiokafka's group-less consumer raises CancelledError when stopped before
                # its background task first ran; one loop turn lets it start.
                await asyncio.sleep(0)
            except BaseException:  # an unreachable cluster: close what did connect
                with contextlib.suppress(Exception):
                    await self._offsets.stop()
                with contextlib.suppress(Exception):
                    await self._admin.close()
                self._spent = True
                raise
            self._started = True

    async def stop(self) -> None:
        """Disconnect; safe to call twice, and :meth:`start` may follow."""
        if self._started:
            self._started, self._spent = False, True
            with contextlib.suppress(Exception):
                await self._offsets.stop()
            await self._admin.close()

    async def __aenter__(self) -> KafkaAdmin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def create_topics(self, topics: list[Topic] | None = None) -> list[CreateResult]:
        """Create the registry's topics; existing ones are left alone and checked for drift."""
        wanted = topics if topics is not None else list(self.registry)
        existing = set(await self._admin.list_topics())
        to_create = [t for t in wanted if t.name not in existing]
        results: dict[str, CreateResult] = {}
        if to_create:
            new = [
                NewTopic(t.name, t.partitions, self.settings.replication_factor, topic_configs=t.configs())
                for t in to_create
            ]
            try:
                response = await self._admin.create_topics(new)
            except TopicAlreadyExistsError:
                response = None  # raced with another creator; treated as existing below
            for name, code, message in getattr(response, "topic_errors", []):
                if code == 0:
                    results[name] = CreateResult(name, created=True)
                elif code != TopicAlreadyExistsError.errno:
                    raise RuntimeError(f"creating {name} failed: error {code} {message}")
            await self.await_visible([t.name for t in to_create])
        for topic in wanted:
            if topic.name not in results:
                results[topic.name] = CreateResult(topic.name, created=False,
                                                   drift=tuple(await self._drift(topic)))
        return [results[t.name] for t in wanted]

    async def await_visible(self, names: list[str], timeout_s: float = VISIBLE_TIMEOUT_S) -> None:
        """Return once the cluster's metadata shows each of ``names`` with a leader on every partition.

        CreateTopics answers once the controller holds the topics; the brokers learn of them a
        moment later (Kafka's own admin client warns of "several seconds"). A client started in
        that moment is told the topic does not exist, so ``topics create`` followed at once by a
        service start would fail now and then. Waiting here makes "created" mean "usable".

        Raises:
            TimeoutError: a topic is still not shown, or has a partition without a leader, after
                ``timeout_s`` (the message names them), or no broker answered in that time.
            KafkaError: no broker could be reached at all.
        """
        from aiokafka.conn import AIOKafkaConnection

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(names)
        conns: dict[int, AIOKafkaConnection] = {}
        try:
            while True:
                still = await self._not_usable_everywhere(pending, conns)
                if still is not None:  # None: no broker answered this time, so nothing changed
                    if not still:
                        return
                    pending = still
                if loop.time() >= deadline:
                    silent = "" if still is not None else (
                        f" (no broker answered a metadata request within {_VISIBLE_ASK_S:g} s)")
                    raise TimeoutError(
                        f"the cluster did not show {', '.join(pending)} with a leader on every "
                        f"partition within {timeout_s:g} s{silent}"
                    )
                await asyncio.sleep(_VISIBLE_POLL_S)
        finally:
            for conn in conns.values():
                conn.close()

    async def _not_usable_everywhere(self, names: list[str], conns: dict[int, Any],
                                     ask_s: float | None = None) -> list[str] | None:
        """Those of ``names`` that some broker does not yet show with a leader on every partition.

        Every broker the client knows of is asked, not one: a client may take its metadata from
        any of them. They are asked at once, each on a connection of its own (kept in ``conns``
        between polls) and given ``ask_s`` (default 5 s) to answer. The admin client's own
        connections are not used: it opens them one at a time under one lock, so a broker that
        accepts a connection and then says nothing would hold every other broker's request. One
        that cannot be reached or does not answer in time is passed over (it serves no client
        either), unless none answers. Never a request that could create a topic on a cluster that
        auto-creates.

        Returns:
            The names still pending, or None when brokers were reached but none answered in time.

        Raises:
            KafkaError: no broker could be reached (the last one's error).
        """
        from aiokafka.conn import create_conn
        from aiokafka.errors import KafkaConnectionError, KafkaError
        from aiokafka.protocol.metadata import MetadataRequest

        ask_s = _VISIBLE_ASK_S if ask_s is None else ask_s
        security = self.settings.client_options()  # what the admin client's own connections use
        client = self._admin._client
        if not client.cluster.brokers():
            await client.force_metadata_update()
        nodes = sorted(broker.nodeId for broker in client.cluster.brokers())
        if not nodes:
            return list(names)  # no broker known yet: nothing is shown anywhere

        def drop(node: int) -> None:
            conn = conns.pop(node, None)
            if conn is not None:
                conn.close()  # a request left unanswered would pin it open

        async def ask(node: int) -> Any:
            try:
                async with asyncio.timeout(ask_s):
                    conn = conns.get(node)
                    if conn is None or not conn.connected():
                        drop(node)
                        broker = client.cluster.broker_metadata(node)
                        if broker is None:
                            raise KafkaConnectionError(f"broker {node} left the cluster's metadata")
                        conn = conns[node] = await create_conn(
                            broker.host, broker.port, client_id=f"{self.settings.client_id}-admin",
                            request_timeout_ms=self.settings.request_timeout_ms, **security)
                    return await conn.send(MetadataRequest(names, allow_auto_topic_creation=False))
            except TimeoutError:
                logger.debug("broker %s did not answer a metadata request within %g s", node, ask_s)
                drop(node)
                return None
            except (KafkaError, OSError) as exc:
                logger.debug("broker %s could not be asked for metadata: %r", node, exc)
                drop(node)
                return exc if isinstance(exc, KafkaError) else KafkaConnectionError(f"broker {node}: {exc!r}")

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(ask(node)) for node in nodes]
        answers = [task.result() for task in tasks]
        responses = [a for a in answers if a is not None and not isinstance(a, KafkaError)]
        if not responses:
            if any(a is None for a in answers):
                return None
            raise answers[-1]
        pending: set[str] = set()
        for response in responses:
            shown = {meta["topic"]: meta for meta in response.to_object()["topics"]}
            pending.update(name for name in names if not _usable(shown.get(name)))
        return [name for name in names if name in pending]

    async def _drift(self, topic: Topic) -> list[str]:
        described = (await self.describe([topic.name]))[0]
        drift = []
        if len(described.partitions) != topic.partitions:
            drift.append(
                f"partitions: cluster has {len(described.partitions)}, registry wants {topic.partitions}"
            )
        for key, want in topic.configs().items():
            have = described.configs.get(key)
            if have != want:
                drift.append(f"{key}: cluster has {have}, registry wants {want}")
        return drift

    async def list_topics(self, include_internal: bool = False) -> list[str]:
        """Topic names, sorted; internal ``__*`` topics only on request."""
        names = await self._admin.list_topics()
        return sorted(n for n in names if include_internal or not n.startswith("__"))

    async def describe(self, names: list[str]) -> list[TopicDescription]:
        """Partitions (leader, replicas, ISR, begin/end offsets) and configs of each topic.

        Raises:
            KeyError: a named topic does not exist.
        """
        metadata = await self._admin.describe_topics(names)
        by_name = {m["topic"]: m for m in metadata}
        configs = await self.configs(names)
        out = []
        for name in names:
            meta = by_name.get(name)
            if meta is None or meta["error_code"] != 0:
                raise KeyError(f"topic {name!r} does not exist")
            tps = [TopicPartition(name, p["partition"]) for p in meta["partitions"]]
            begins = await self._offsets.beginning_offsets(tps) if tps else {}
            ends = await self._offsets.end_offsets(tps) if tps else {}
            parts = tuple(
                PartitionInfo(
                    p["partition"], p["leader"], tuple(p["replicas"]), tuple(p["isr"]),
                    begins[TopicPartition(name, p["partition"])], ends[TopicPartition(name, p["partition"])],
                )
                for p in sorted(meta["partitions"], key=lambda p: p["partition"])
            )
            out.append(TopicDescription(name, parts, configs.get(name, {}), self.registry.by_name(name)))
        return out

    async def configs(self, names: list[str]) -> dict[str, dict[str, str]]:
        """Effective configs per topic."""
        responses = await self._admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
        )
        out: dict[str, dict[str, str]] = {}
        for response in responses:
            for resource in response.resources:
                _, _, _, name, entries = resource[:5]
                out[name] = {e[0]: e[1] for e in entries}
        return out

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """High watermarks of ``partitions``."""
        return dict(await self._offsets.end_offsets(partitions)) if partitions else {}

    async def partitions(self, name: str) -> list[TopicPartition]:
        """All partitions of one topic.

        Raises:
            KeyError: the topic does not exist.
        """
        metadata = await self._admin.describe_topics([name])
        if not metadata or metadata[0]["error_code"] != 0:
            raise KeyError(f"topic {name!r} does not exist")
        return sorted(TopicPartition(name, p["partition"]) for p in metadata[0]["partitions"])

    async def groups(self) -> list[str]:
        """Consumer groups the cluster knows."""
        return sorted(g[0] for g in await self._admin.list_consumer_groups())

    async def lag(self, group: str | None = None) -> list[LagRow]:
        """Each group's committed offset, end offset and lag per partition it committed on."""
        groups = [group] if group else await self.groups()
        rows: list[LagRow] = []
        for g in groups:
            committed: dict[TopicPartition, Any] = await self._admin.list_consumer_group_offsets(g)
            ends = await self.end_offsets(list(committed))
            for tp in sorted(committed):
                offset = committed[tp].offset
                rows.append(LagRow(g, tp.topic, tp.partition, offset if offset >= 0 else None, ends[tp]))
        return rows
