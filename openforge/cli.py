"""The `openforge` command: one entry point in front of every process and tool."""

from __future__ import annotations

import logging
from pathlib import Path

import click
import orjson

from consumers.assembler.cli import assembler_command
from consumers.publisher_cli import publisher_command
from consumers.rollouts.cli import launcher_command
from openforge import __version__
from openforge.watcher import watcher_command
from producers.cli import reward_command, submit_command
from proxy.cli import proxy_command, token_command
from stream.cli import kafka_group, topics_group


@click.group()
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
    from schemas import json_schemas

    out_dir.mkdir(parents=True, exist_ok=True)
    for filename, schema in sorted(json_schemas().items()):
        (out_dir / filename).write_bytes(orjson.dumps(schema, option=orjson.OPT_INDENT_2) + b"\n")
        click.echo(f"wrote {out_dir / filename}")


@main.command("demo")
@click.option("--keep-broker", is_flag=True, help="Leave the broker running afterwards.")
def demo(keep_broker: bool) -> None:
    """Run what OpenForge can show on one machine (today: the streaming foundation)."""
    from openforge.demo import run_demo

    run_demo(keep_broker)


main.add_command(kafka_group)
main.add_command(topics_group)
main.add_command(schemas_group)
main.add_command(proxy_command)
main.add_command(token_command)
main.add_command(assembler_command)
main.add_command(submit_command)
main.add_command(launcher_command)
main.add_command(reward_command)
main.add_command(publisher_command)
main.add_command(watcher_command)


@main.command("learner")
def learner_command() -> None:
    """Run the off-policy learner (configured by OPENFORGE_LEARNER_* and OPENFORGE_KAFKA_*)."""
    from learner.main import run

    run()
