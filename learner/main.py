"""``openforge learner``: run the learner until SIGTERM, under the process supervisor."""

from __future__ import annotations

import asyncio

from learner.settings import LearnerSettings
from learner.trainer import Learner
from stream.lifecycle import supervise
from stream.settings import KafkaSettings


async def serve(settings: LearnerSettings | None = None, kafka: KafkaSettings | None = None) -> None:
    """Run one learner until it ends (``max_steps``) or a signal asks it to drain."""
    await supervise([Learner(settings, kafka)])


def run(settings: LearnerSettings | None = None) -> None:
    """Blocking entry point of the CLI: telemetry (when an OTLP endpoint is set), then the learner."""
    from stream.otel import configure_telemetry

    shutdown_telemetry = configure_telemetry("openforge-learner")
    try:
        asyncio.run(serve(settings))
    finally:
        shutdown_telemetry()
