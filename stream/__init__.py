"""Kafka plumbing for every OpenForge process.

Settings, the topic registry, producer and consumer wrappers, administration and
topic tooling, and the local development broker.

Depends on ``schemas`` only; never imports web frameworks or torch.
"""

from stream.admin import KafkaAdmin
from stream.broker import BrokerError, LocalBroker, ensure_kafka_jars
from stream.consumer import ConsumerSettings, EventConsumer, Handler, Received
from stream.lifecycle import Component, supervise
from stream.producer import EventProducer, EventTooLargeError, WrongTopicError
from stream.settings import BrokerSettings, KafkaSettings
from stream.topics import (
    ALL_TOPICS,
    CALLS,
    CHECKPOINTS,
    DEAD_LETTERS,
    REWARDS,
    ROLLOUTS,
    STEPS,
    TASKS,
    TRAJECTORIES,
    MissingTopicsError,
    NotAuthorizedError,
    Topic,
    TopicRegistry,
    TopicSpec,
    start_consumer,
)

__all__ = [
    "ALL_TOPICS",
    "CALLS",
    "CHECKPOINTS",
    "DEAD_LETTERS",
    "REWARDS",
    "ROLLOUTS",
    "STEPS",
    "TASKS",
    "TRAJECTORIES",
    "BrokerError",
    "BrokerSettings",
    "Component",
    "ConsumerSettings",
    "EventConsumer",
    "EventProducer",
    "EventTooLargeError",
    "Handler",
    "KafkaAdmin",
    "KafkaSettings",
    "LocalBroker",
    "MissingTopicsError",
    "NotAuthorizedError",
    "Received",
    "Topic",
    "TopicRegistry",
    "TopicSpec",
    "WrongTopicError",
    "ensure_kafka_jars",
    "start_consumer",
    "supervise",
]
