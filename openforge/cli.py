"""The `openforge` command: one entry point in front of every process and tool.

Each subcommand's module is imported only when that subcommand runs, so a short-lived one
(``openforge reward``, run by the verifier in every rollout; ``openforge token``) does not pay
for the Kafka client, the proxy, the learner or the demo.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import click

from openforge import __version__

_COMMANDS = {
    "kafka": ("stream.cli", "kafka_group"),
    "topics": ("stream.cli", "topics_group"),
    "schemas": ("openforge.cli", "schemas_group"),
    "proxy": ("proxy.cli", "proxy_command"),
    "token": ("proxy.cli", "token_command"),
    "assembler": ("consumers.assembler.cli", "assembler_command"),
    "submit": ("producers.cli", "submit_command"),
    "launcher": ("consumers.rollouts.cli", "launcher_command"),
    "reward": ("producers.cli", "reward_command"),
    "publisher": ("consumers.publisher_cli", "publisher_command"),
    "watcher": ("openforge.watcher", "watcher_command"),
    "learner": ("openforge.cli", "learner_command"),
    "demo": ("openforge.demo_cli", "demo"),
    "observe": ("openforge.observe_cli", "observe"),
    "ui": ("openforge.ui.cli", "ui_command"),
    "report": ("openforge.report", "report_group"),
}
"""Every subcommand: the module that defines it, and its name there."""


class _Main(click.Group):
    """The command group: subcommands are loaded when used.

    Errors that are the operator's to fix (topics not created) end in one line, not a traceback.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = _COMMANDS.get(cmd_name)
        if where is None:
            return None
        command = getattr(importlib.import_module(where[0]), where[1])
        assert isinstance(command, click.Command)
        return command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            # Only a command that loaded the Kafka client can have raised its error.
            topics = sys.modules.get("stream.topics")
            if topics is not None and isinstance(exc, topics.MissingTopicsError):
                raise click.ClickException(str(exc)) from None
            raise


@click.group(cls=_Main)
@click.version_option(__version__, prog_name="openforge")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """OpenForge: train LLM agents with RL inside the harnesses they really run in."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))


@click.group("schemas")
def schemas_group() -> None:
    """Event schemas: export them as JSON Schema for other languages and tools."""


@schemas_group.command("export")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("schemas-json"), show_default=True, help="Folder to write into.")
def schemas_export(out_dir: Path) -> None:
    """Write one JSON Schema file per registered event type."""
    import orjson

    from schemas import json_schemas

    out_dir.mkdir(parents=True, exist_ok=True)
    for filename, schema in sorted(json_schemas().items()):
        (out_dir / filename).write_bytes(orjson.dumps(schema, option=orjson.OPT_INDENT_2) + b"\n")
        click.echo(f"wrote {out_dir / filename}")


@click.command("learner")
def learner_command() -> None:
    """Run the off-policy learner (configured by OPENFORGE_LEARNER_* and OPENFORGE_KAFKA_*)."""
    from learner.main import run

    run()
