"""`openforge publisher`: the checkpoint publisher as a process."""

from __future__ import annotations

import asyncio

import click


@click.command("publisher")
@click.option("--replica", "replicas", multiple=True,
              help="vLLM base URL; repeat for every replica (default $OPENFORGE_PUBLISHER_REPLICAS).")
@click.option("--model", default=None, help="Model whose checkpoints to publish (default $OPENFORGE_PUBLISHER_MODEL).")
def publisher_command(replicas: tuple[str, ...], model: str | None) -> None:
    """Load every new checkpoint into every vLLM replica and report each outcome on Kafka."""
    from pydantic import ValidationError

    from consumers.publisher import CheckpointPublisher, PublisherSettings
    from stream.lifecycle import supervise
    from stream.otel import configure_telemetry

    updates: dict[str, object] = {}
    if replicas:
        updates["replicas"] = list(replicas)
    if model:
        updates["model"] = model
    try:
        settings = PublisherSettings(**updates)  # type: ignore[arg-type]
    except (ValidationError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc

    async def run() -> None:
        # The Kafka clients bind to the running loop, so the publisher is built inside it.
        await supervise([CheckpointPublisher(settings)])

    shutdown_telemetry = configure_telemetry("openforge-publisher")
    try:
        asyncio.run(run())
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        shutdown_telemetry()
