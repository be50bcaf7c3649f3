"""`openforge proxy` and `openforge token`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click
from pydantic import ValidationError

from schemas.credentials import Role, mint_token, signing_key_from

logger = logging.getLogger(__name__)

_TOPIC_CHECK_S = 10.0
"""How long the start-up check waits for Kafka before starting without it."""


@click.command("proxy")
@click.option("--host", default=None, help="Listen address (default $OPENFORGE_PROXY_HOST or 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Listen port (default $OPENFORGE_PROXY_PORT or 8100).")
@click.option("--upstream", "upstreams", multiple=True, help="vLLM base URL; repeat for several replicas.")
def proxy_command(host: str | None, port: int | None, upstreams: tuple[str, ...]) -> None:
    """Serve the harness-facing proxy in front of vLLM, capturing every call to Kafka."""
    import uvicorn

    from producers.shipper import spool_path
    from proxy.app import build_app
    from proxy.server import server_config
    from proxy.settings import ProxySettings
    from stream.otel import configure_telemetry

    updates: dict[str, object] = {}
    if host:
        updates["host"] = host
    if port is not None:
        updates["port"] = port
    if upstreams:
        updates["upstreams"] = [u.rstrip("/") for u in upstreams]
    try:
        settings = ProxySettings().model_copy(update=updates)
    except ValidationError as exc:
        raise click.ClickException(settings_error(exc)) from None
    try:
        app = build_app(settings, own_process=True)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    from stream import CALLS, DEAD_LETTERS, REWARDS
    from stream.topics import refuse_missing_topics

    # Calls would be journalled for a topic nobody creates while the proxy looked healthy; a Kafka
    # that does not answer yet is no reason not to start, as the journal holds calls until it does.
    asyncio.run(refuse_missing_topics(settings.kafka, (CALLS, REWARDS, DEAD_LETTERS), timeout_s=_TOPIC_CHECK_S))
    shutdown_telemetry = configure_telemetry("openforge-proxy")
    try:
        server = uvicorn.Server(server_config(app, settings))
        logger.info("proxy on http://%s:%d in front of %s (chat completions); journal in %s",
                    settings.host, settings.port, ", ".join(settings.upstreams) or "no engine",
                    spool_path(settings.spool_dir))
        server.run()
        if not server.started:  # as uvicorn.run: a start-up that failed (the lifespan's errors are logged)
            raise SystemExit(3)
    finally:
        shutdown_telemetry()


def settings_error(exc: ValidationError) -> str:
    """Pydantic's errors about the proxy's settings, one line each, named as the operator sets them."""
    prefix = "OPENFORGE_KAFKA_" if exc.title == "KafkaSettings" else "OPENFORGE_PROXY_"
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        name = prefix + "_".join(str(part) for part in error["loc"]).upper()
        lines.append(f"{name}: {message}" if error["loc"] else message)
    return "\n".join(lines)


@click.command("token")
@click.argument("rollout_id")
@click.option(
    "--role", type=click.Choice([r.value for r in Role]), default=Role.AGENT.value, show_default=True
)
@click.option("--ttl", "ttl_s", type=float, default=3600.0, show_default=True, help="Seconds of validity.")
@click.option("--task", "task_id", default=None, help="Task id to stamp on the rollout's events.")
@click.option(
    "--key",
    envvar="OPENFORGE_PROXY_CREDENTIAL_KEY",
    default=None,
    help="Signing key (default $OPENFORGE_PROXY_CREDENTIAL_KEY).",
)
@click.option(
    "--key-file",
    envvar="OPENFORGE_PROXY_CREDENTIAL_KEY_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File holding the signing key, as the proxy reads it (default $OPENFORGE_PROXY_CREDENTIAL_KEY_FILE).",
)
def token_command(rollout_id: str, role: str, ttl_s: float, task_id: str | None, key: str | None,
                  key_file: Path | None) -> None:
    """Mint a rollout token (what the launcher gives each rollout) for manual use."""
    try:
        secret = signing_key_from(key, key_file)
    except OSError as exc:
        raise click.ClickException(f"the key file cannot be read: {exc.strerror or exc} ({key_file})") from exc
    if not secret:
        raise click.ClickException("no signing key: pass --key or --key-file, or set OPENFORGE_PROXY_CREDENTIAL_KEY "
                                   "or OPENFORGE_PROXY_CREDENTIAL_KEY_FILE, as for the proxy")
    try:
        click.echo(mint_token(secret, rollout_id, Role(role), ttl_s, task_id=task_id))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
