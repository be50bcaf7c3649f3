"""``openforge ui``: serve the flight recorder."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import click

from openforge.ui.settings import UISettings, is_loopback

__all__ = ["ui_command"]

logger = logging.getLogger(__name__)


@click.command("ui")
@click.option("--host", default=None, help="Listen address [OPENFORGE_UI_HOST, default 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Listen port [OPENFORGE_UI_PORT, default 8200].")
@click.option("--index", "index_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The SQLite index file [OPENFORGE_UI_INDEX_PATH].")
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), default=None,
              help="tokenizer.json (or a model folder) to show token text [OPENFORGE_UI_TOKENIZER].")
@click.option("--no-follow", is_flag=True, help="Serve the index as it is, without reading the topics.")
def ui_command(host: str | None, port: int | None, index_path: Path | None, tokenizer: Path | None,
               no_follow: bool) -> None:
    """Serve the flight recorder: runs, rollouts, token views, learner steps, the harness report.

    It needs a credential (OPENFORGE_UI_CREDENTIAL or _FILE): on a loopback address without one it
    makes a random one and prints the link that carries it; on any other address it refuses to start.
    """
    import uvicorn

    from openforge.ui.app import build_app

    overrides: dict[str, Any] = {k: v for k, v in (("host", host), ("port", port), ("index_path", index_path),
                                   ("tokenizer", tokenizer)) if v is not None}
    try:
        settings = UISettings(**overrides)
        credential = settings.credential_value()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if credential is None:
        if not is_loopback(settings.host):
            raise click.ClickException(
                f"refusing to serve on {settings.host} without a credential: the pages show prompts and tool "
                "output; set OPENFORGE_UI_CREDENTIAL (or _FILE), or listen on 127.0.0.1")
        credential = secrets.token_urlsafe(24)
        shown = f"http://{settings.host}:{settings.port}/?token={credential}"
    else:
        shown = f"http://{settings.host}:{settings.port}/ (with the configured credential)"
    if not no_follow:
        import asyncio

        from openforge.ui.follow import FOLLOWED
        from stream.settings import KafkaSettings
        from stream.topics import refuse_missing_topics

        # Following missing topics fails inside the server's start-up, as a traceback; say it in one line.
        asyncio.run(refuse_missing_topics(KafkaSettings(), FOLLOWED))
    app = build_app(settings, credential, follow=not no_follow)
    click.echo(f"OpenForge flight recorder on {shown}\nindex: {settings.index_path}", err=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on")
