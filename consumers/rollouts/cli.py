"""`openforge launcher`: run the rollout launcher process."""

from __future__ import annotations

import asyncio

import click


@click.command("launcher")
@click.option("--backend", type=click.Choice(["local", "kubernetes"]), default=None,
              help="Where rollouts run (default $OPENFORGE_LAUNCHER_BACKEND or local).")
@click.option("--max-in-flight", type=int, default=None, help="Rollouts running at once.")
@click.option("--proxy-url", default=None,
              help="The proxy's URL as seen from rollouts; several replicas' own URLs, comma-separated, pin each "
                   "rollout to one.")
@click.option("--pace/--no-pace", default=None,
              help="Start rollouts only while the learner can train them in time (default $OPENFORGE_LAUNCHER_PACE "
                   "or on); --no-pace launches without a learner.")
def launcher_command(backend: str | None, max_in_flight: int | None, proxy_url: str | None,
                     pace: bool | None) -> None:
    """Consume tasks and launch group_size rollouts per task, until SIGTERM or SIGINT."""
    from consumers.rollouts.launcher import Launcher, LauncherSettings
    from stream.lifecycle import supervise
    from stream.otel import configure_telemetry

    updates: dict[str, object] = {}
    if backend is not None:
        updates["backend"] = backend
    if max_in_flight is not None:
        updates["max_in_flight"] = max_in_flight
    if proxy_url is not None:
        updates["proxy_url"] = proxy_url
    if pace is not None:
        updates["pace"] = pace
    settings = LauncherSettings()
    if updates:
        settings = LauncherSettings.model_validate({**settings.model_dump(), **updates})
    try:
        settings.signing_key()
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc

    async def run() -> None:
        # Kafka clients bind to the running loop, so the launcher is made inside it.
        await supervise([Launcher(settings)])

    shutdown_telemetry = configure_telemetry("openforge-launcher")
    try:
        asyncio.run(run())
    except ValueError as exc:  # configuration problems found while building the backend
        raise click.ClickException(str(exc)) from exc
    finally:
        shutdown_telemetry()
