"""`openforge submit` (tasks in) and `openforge reward` (the verifier's score out)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson


@click.command("submit")
@click.argument("task_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--bootstrap", "-b", default=None, metavar="HOST:PORT",
              help="Brokers to use (default: $OPENFORGE_KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092).")
@click.option("--dry-run", is_flag=True, help="Validate only; publish nothing.")
def submit_command(task_file: Path, bootstrap: str | None, dry_run: bool) -> None:
    """Validate a JSON Lines file of tasks and publish them all in one transaction.

    Every invalid line is reported with its number; if any line is invalid, nothing is published.
    """
    import asyncio

    from producers.tasks import parse_tasks, publish_tasks
    from stream.settings import KafkaSettings

    with task_file.open("rb") as handle:
        tasks, errors = parse_tasks(handle)
    for error in errors:
        click.echo(f"{task_file}:{error}", err=True)
    if errors:
        raise click.ClickException(f"{len(errors)} invalid line(s) in {task_file}; nothing was published")
    if not tasks:
        raise click.ClickException(f"{task_file} holds no tasks")
    if dry_run:
        click.echo(f"{len(tasks)} valid task(s); nothing published (--dry-run)")
        return
    kafka = KafkaSettings()
    if bootstrap:
        kafka = kafka.model_copy(update={"bootstrap_servers": bootstrap})
    count = asyncio.run(publish_tasks(tasks, kafka))
    rollouts = sum(t.group_size for t in tasks)
    click.echo(f"published {count} task(s) ({rollouts} rollouts) to {kafka.topic_prefix}openforge.tasks.v1")


@click.command("reward")
@click.option("--value", type=float, required=True, help="The reward (a finite number).")
@click.option("--info", "info_json", default=None, metavar="JSON", help="Details as a JSON object.")
def reward_command(value: float, info_json: str | None) -> None:
    """Report this rollout's reward to the proxy (run by the verifier, inside the rollout).

    Reads OPENFORGE_REWARD_URL (or OPENFORGE_PROXY_URL and OPENFORGE_ROLLOUT_ID) and
    OPENFORGE_VERIFIER_TOKEN from the environment; retries connection errors and 5xx with backoff.
    """
    from producers.reward_client import RewardError, post_reward

    info: object = {}
    if info_json is not None:
        try:
            info = orjson.loads(info_json)
        except orjson.JSONDecodeError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--info") from exc
        if not isinstance(info, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--info")
    try:
        answer = post_reward(value, info if isinstance(info, dict) else {})
    except RewardError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.stdout.write(orjson.dumps(answer).decode() + "\n")
