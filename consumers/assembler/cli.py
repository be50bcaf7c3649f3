"""`openforge assembler`."""

from __future__ import annotations

import click


@click.command("assembler")
@click.option("--instance-id", default=None,
              help="Stable instance name (default $OPENFORGE_ASSEMBLER_INSTANCE_ID or 0).")
def assembler_command(instance_id: str | None) -> None:
    """Join calls, lifecycle and rewards into trajectories, published exactly once.

    Settings come from OPENFORGE_ASSEMBLER_* and OPENFORGE_KAFKA_*.
    """
    import asyncio

    from consumers.assembler.service import AssemblerService
    from consumers.assembler.settings import AssemblerSettings
    from stream.lifecycle import supervise
    from stream.otel import configure_telemetry

    settings = AssemblerSettings()
    if instance_id:
        settings = settings.model_copy(update={"instance_id": instance_id})

    async def run() -> None:
        await supervise([AssemblerService(settings)])

    shutdown_telemetry = configure_telemetry("openforge-assembler")
    try:
        asyncio.run(run())
    finally:
        shutdown_telemetry()
