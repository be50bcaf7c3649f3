"""Kafka connection settings, read from the environment in one place.

Every process composes :class:`KafkaSettings` into its own settings class, so the
environment stays the single source of configuration (``OPENFORGE_KAFKA_*``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

Compression = Literal["zstd", "lz4", "gzip", "none"]


class KafkaSettings(BaseSettings):
    """How to reach Kafka and how to talk to it.

    Defaults match the local development broker (`openforge kafka up`), so a
    one-machine run needs no configuration at all.
    """

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_KAFKA_", frozen=True, extra="ignore")

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated ``host:port`` list of brokers to bootstrap from."""

    topic_prefix: str = ""
    """Prepended to every registry topic name (e.g. ``exp42.``) so experiments can
    share one cluster without seeing each other's events."""

    client_id: str = "openforge"
    """Reported to the brokers; shows up in their logs and quotas."""

    compression: Compression = "zstd"
    """Batch compression. zstd compresses packed token ids best; lz4 is cheaper on CPU."""

    linger_ms: int = Field(default=5, ge=0)
    """How long the producer waits to fill a batch. A few milliseconds buys large
    batches under load and costs little latency when idle."""

    batch_size_bytes: int = Field(default=256 * 1024, gt=0)
    """Upper bound of one producer batch per partition."""

    request_timeout_ms: int = Field(default=40_000, gt=0)
    """How long one broker request may take before the client gives up on it."""

    partitions: int | None = Field(default=None, ge=1)
    """Overrides every registry topic's partition count when set (small clusters, tests)."""

    replication_factor: int = Field(default=1, ge=1)
    """Replicas per partition when topics are created. 1 suits the local broker only."""


class BrokerSettings(BaseSettings):
    """The local single-node development broker (`openforge kafka up`)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_BROKER_", frozen=True, extra="ignore")

    version: str = "4.4.0"
    """Apache Kafka release to run. 4.4.0 is the newest release whose transactions
    work with aiokafka's producer; see docs/kafka.md for the evidence."""

    port: int = Field(default=9092, ge=1, le=65535)
    """Client (PLAINTEXT) listener on 127.0.0.1."""

    controller_port: int = Field(default=9093, ge=1, le=65535)
    """KRaft controller listener on 127.0.0.1."""

    data_dir: str | None = None
    """Where logs, metadata and the broker's own log file live; defaults to a folder
    under the cache (``<cache>/kafka/data``)."""

    heap: str = "512m"
    """JVM heap (-Xmx). A single-node dev broker needs little."""

    start_timeout_s: float = Field(default=90.0, gt=0)
    """How long to wait for the broker to answer before declaring the start failed."""

    cache_dir: str | None = None
    """Where the broker jars are cached; defaults to ``$OPENFORGE_CACHE`` or the
    user's cache folder (``$XDG_CACHE_HOME/openforge``, else ``~/.cache/openforge``)."""
