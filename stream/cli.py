"""`openforge kafka …` and `openforge topics …`: the broker and topic tooling commands."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from schemas._errors import DeadLetterErrorType
from schemas.call.linear import WholeCalls
from stream.admin import KafkaAdmin, bootstrap_refusal
from stream.broker import BrokerError, LocalBroker, ensure_kafka_jars
from stream.settings import BrokerSettings, KafkaSettings
from stream.tooling import (
    REDRIVEN_BY_DEFAULT,
    Range,
    Redriven,
    format_record,
    read_jsonl,
    read_topic,
    record_matches,
    redrive,
    replay_to_topic,
    whole_calls,
    write_jsonl,
)
from stream.topics import DEAD_LETTERS, TopicRegistry

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T], settings: KafkaSettings) -> T:
    """Run a command; a cluster that cannot be reached or is slow to answer is one line, not a traceback.

    When the client could not bootstrap, the line says why each address turned it away (refused
    credentials, a failed TLS handshake), which aiokafka's own error leaves out.
    """
    from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, RequestTimedOutError

    unreachable = (KafkaConnectionError, NodeNotReadyError, KafkaTimeoutError, RequestTimedOutError, TimeoutError)
    try:
        return asyncio.run(coro)
    except unreachable as exc:  # NodeNotReady: the bootstrap answered, a broker's advertised address did not
        text, name = str(exc) or "timed out", type(exc).__name__
        message = text if text.startswith(name) else f"{name}: {text}"
        if isinstance(exc, KafkaConnectionError) and "bootstrap" in text:
            reason = asyncio.run(bootstrap_refusal(settings))
            message += f" ({reason})" if reason else ""
        raise click.ClickException(message) from exc


def _kafka(bootstrap: str | None) -> KafkaSettings:
    settings = KafkaSettings()
    return settings.model_copy(update={"bootstrap_servers": bootstrap}) if bootstrap else settings


bootstrap_option = click.option(
    "--bootstrap", "-b", default=None, metavar="HOST:PORT",
    help="Brokers to use (default: $OPENFORGE_KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092).",
)


@click.group("kafka")
def kafka_group() -> None:
    """Run a real single-node Kafka broker on this machine (development and tests)."""


def _broker(port: int | None, data_dir: str | None) -> LocalBroker:
    given: dict[str, Any] = {}
    if port is not None:
        given["port"] = port  # the controller takes PORT+1 unless OPENFORGE_BROKER_CONTROLLER_PORT says
    if data_dir is not None:
        given["data_dir"] = data_dir
    return LocalBroker(BrokerSettings(**given))


port_option = click.option("--port", type=int, default=None,
                           help="Client port (controller uses PORT+1). Default 9092.")
data_option = click.option("--data-dir", default=None, help="Broker data folder.")


@kafka_group.command("fetch")
def kafka_fetch() -> None:
    """Fetch the broker jars into the cache now (done once; later runs are instant)."""
    settings = BrokerSettings()
    try:
        libs = ensure_kafka_jars(settings.version, settings.cache_dir)
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"Kafka {settings.version} jars are in {libs}")


@kafka_group.command("up")
@port_option
@data_option
def kafka_up(port: int | None, data_dir: str | None) -> None:
    """Fetch the jars once, format storage once, start the broker, wait until it answers."""
    broker = _broker(port, data_dir)
    try:
        status = broker.start()
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"Kafka {status.version} is up on {status.bootstrap} (pid {status.pid}); "
               f"data in {status.data_dir}, log in {status.log_file}")


@kafka_group.command("down")
@port_option
@data_option
def kafka_down(port: int | None, data_dir: str | None) -> None:
    """Stop the broker cleanly (SIGTERM, then SIGKILL after 30 s)."""
    if _broker(port, data_dir).stop():
        click.echo("Kafka stopped")
    else:
        click.echo("no broker was running")


@kafka_group.command("status")
@port_option
@data_option
def kafka_status(port: int | None, data_dir: str | None) -> None:
    """Say whether the broker runs and answers; exit 1 when it does not."""
    status = _broker(port, data_dir).status()
    state = "running" if status.running else "not running"
    click.echo(f"Kafka {status.version}: {state} on {status.bootstrap}"
               + (f" (pid {status.pid})" if status.pid else "") + f"; data in {status.data_dir}")
    if not status.running:
        sys.exit(1)


@click.group("topics")
def topics_group() -> None:
    """Create, list, describe, tail, replay, re-drive dead letters and measure the lag of OpenForge topics."""


@topics_group.command("create")
@bootstrap_option
def topics_create(bootstrap: str | None) -> None:
    """Create every registry topic; existing topics are kept and checked for drift."""
    settings = _kafka(bootstrap)

    async def go() -> None:
        async with KafkaAdmin(settings) as admin:
            try:
                results = await admin.create_topics()
            except RuntimeError as exc:  # the cluster refused a topic (a policy, a bad setting), or failed
                raise click.ClickException(str(exc)) from exc
            for result in results:
                topic = admin.registry.by_name(result.name)
                parts = topic.partitions if topic else "?"
                state = "created" if result.created else "exists"
                click.echo(f"{state:8} {result.name}  ({parts} partitions)")
                for line in result.drift:
                    click.echo(f"         drift: {line}", err=True)

    _run(go(), settings)


@topics_group.command("list")
@bootstrap_option
@click.option("--all", "show_all", is_flag=True, help="Include internal topics.")
def topics_list(bootstrap: str | None, show_all: bool) -> None:
    """List topics; registry topics are marked with their role."""
    settings = _kafka(bootstrap)

    async def go() -> None:
        async with KafkaAdmin(settings) as admin:
            for name in await admin.list_topics(include_internal=show_all):
                topic = admin.registry.by_name(name)
                click.echo(f"{name}" + (f"  — {topic.spec.description}" if topic else ""))

    _run(go(), settings)


@topics_group.command("describe")
@bootstrap_option
@click.argument("names", nargs=-1)
def topics_describe(bootstrap: str | None, names: tuple[str, ...]) -> None:
    """Partitions, leaders, offsets and configs (all registry topics by default)."""
    settings = _kafka(bootstrap)
    registry = TopicRegistry.from_settings(settings)

    async def go() -> None:
        wanted = [_topic_name(registry, n) for n in names] or [t.name for t in registry]
        async with KafkaAdmin(settings, registry) as admin:
            try:
                descriptions = await admin.describe(wanted)
            except KeyError as exc:
                raise click.ClickException(str(exc.args[0])) from exc
        for d in descriptions:
            click.echo(f"{d.name}: {len(d.partitions)} partitions, {d.records:,} records retained")
            if d.registry:
                click.echo(f"  schemas: {', '.join(d.registry.spec.schemas)}; key: {d.registry.spec.key}")
            click.echo("  partition  leader  replicas  isr    begin        end")
            for p in d.partitions:
                click.echo(f"  {p.partition:9d}  {p.leader:6d}  {_ids(p.replicas):8}  {_ids(p.isr):5}"
                           f"  {p.begin:9d}  {p.end:9d}")
            for key in ("cleanup.policy", "retention.ms", "max.message.bytes", "compression.type"):
                if key in d.configs:
                    click.echo(f"  {key}={d.configs[key]}")

    _run(go(), settings)


def _ids(ids: tuple[int, ...]) -> str:
    return ",".join(map(str, ids))


def _topic_name(registry: TopicRegistry, name: str) -> str:
    """A registry alias (``calls``) or base name resolves; anything else is taken literally."""
    try:
        return registry.resolve(name).name
    except KeyError:
        return name


def _when(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time") from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@topics_group.command("tail")
@bootstrap_option
@click.argument("topic")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records until Ctrl-C.")
@click.option("--last", "-n", type=int, default=10, show_default=True,
              help="Start this many records before the end of each partition.")
@click.option("--from-beginning", is_flag=True, help="Start at the oldest retained record.")
@click.option("--key", default=None, help="Only records with this key (e.g. a rollout id).")
@click.option("--type", "schema", default=None, help="Only events of this schema (e.g. model_call).")
@click.option("--full", is_flag=True, help="Print packed token arrays and long text in full.")
@click.option("--raw", is_flag=True, help="Print each record as a replay JSONL line instead.")
def topics_tail(bootstrap: str | None, topic: str, follow: bool, last: int, from_beginning: bool,
                key: str | None, schema: str | None, full: bool, raw: bool) -> None:
    """Decode and pretty-print the newest events of TOPIC (name or alias like `calls`)."""
    settings = _kafka(bootstrap)
    name = _topic_name(TopicRegistry.from_settings(settings), topic)
    rng = Range(last=None if from_beginning else last)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        calls = WholeCalls()  # calls shown whole, their prompts stored by reference rebuilt
        try:
            async for record in read_topic(settings, name, rng, follow=follow, stop=stop):
                if record_matches(record, key=key, schema=schema):
                    if raw:
                        click.echo(record.to_json_line().decode(), nl=False)
                    else:
                        click.echo(format_record(record, full=full, calls=calls))
        except KeyError as exc:
            raise click.ClickException(str(exc.args[0])) from exc

    _run(go(), settings)


def range_options(records: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``--partition``, ``--from-offset``, ``--to-offset``, ``--since``, ``--until``, given to the command as ``rng``.

    One place for what a range of a topic's ``records`` means to every command that reads one.
    """
    options = [
        click.option("--partition", "partitions", type=int, multiple=True, help="Only these partitions."),
        click.option("--from-offset", type=int, default=None, help="First offset (inclusive), per partition."),
        click.option("--to-offset", type=int, default=None, help="Last offset (exclusive), per partition."),
        click.option("--since", default=None, help=f"Only {records} at or after this ISO 8601 time."),
        click.option("--until", default=None, help=f"Only {records} before this ISO 8601 time."),
    ]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(command)
        def with_range(*args: Any, partitions: tuple[int, ...], from_offset: int | None, to_offset: int | None,
                       since: str | None, until: str | None, **kwargs: Any) -> None:
            rng = Range(partitions=partitions or None, from_offset=from_offset, to_offset=to_offset,
                        since=_when(since), until=_when(until))
            command(*args, rng=rng, **kwargs)

        for option in reversed(options):
            with_range = option(with_range)
        return with_range

    return decorate


@topics_group.command("replay")
@bootstrap_option
@click.option("--from-topic", default=None, help="Source topic (name or alias).")
@click.option("--from-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Source JSONL file written by an earlier replay.")
@click.option("--to-topic", default=None, help="Destination topic (must exist).")
@click.option("--to-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Destination JSONL file ('-' for stdout).")
@range_options("records")
@click.option("--keep-partition", is_flag=True, help="Write each record to its source partition number.")
def topics_replay(bootstrap: str | None, from_topic: str | None, from_file: Path | None,
                  to_topic: str | None, to_file: Path | None, rng: Range, keep_partition: bool) -> None:
    """Copy an offset or time range of records, byte-exact, between topics and JSONL files.

    Into a file, call events go whole: a prompt stored by reference to an earlier call is rebuilt.
    """
    if (from_topic is None) == (from_file is None):
        raise click.UsageError("give exactly one of --from-topic and --from-file")
    if (to_topic is None) == (to_file is None):
        raise click.UsageError("give exactly one of --to-topic and --to-file")
    settings = _kafka(bootstrap)
    registry = TopicRegistry.from_settings(settings)

    def progress(count: int) -> None:
        click.echo(f"\r{count:,} records", nl=False, err=True)

    async def go() -> int:
        if from_topic is not None:
            source: Any = read_topic(settings, _topic_name(registry, from_topic), rng)
        else:
            assert from_file is not None
            source = read_jsonl(from_file)
        if to_topic is not None:
            return await replay_to_topic(settings, source, _topic_name(registry, to_topic),
                                         keep_partition=keep_partition, progress=progress)
        assert to_file is not None
        if from_file is not None:
            raise click.UsageError("file to file needs no broker: copy the file")
        source = whole_calls(source)  # a file is read by people and tools: calls whole
        if str(to_file) == "-":
            return await write_jsonl(source, sys.stdout.buffer)
        with to_file.open("wb") as out:
            return await write_jsonl(source, out, progress=progress)

    try:
        count = _run(go(), settings)
    except (KeyError, ValueError) as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from exc
    click.echo(f"\rreplayed {count:,} records", err=True)


@topics_group.command("redrive")
@bootstrap_option
@click.option("--error-type", "error_types", multiple=True,
              type=click.Choice([t.value for t in DeadLetterErrorType]),
              help="Only letters of this error type (repeatable; default: "
                   f"{' and '.join(sorted(REDRIVEN_BY_DEFAULT))}).")
@click.option("--topic", "topics", multiple=True,
              help="Only letters of records headed for this topic (name or alias; repeatable).")
@click.option("--to-topic", default=None, help="Send every record here instead of its own topic (must exist).")
@range_options("letters written")
@click.option("--dry-run", is_flag=True, help="Count what would be sent and check where; send nothing.")
def topics_redrive(bootstrap: str | None, error_types: tuple[str, ...], topics: tuple[str, ...],
                   to_topic: str | None, rng: Range, dry_run: bool) -> None:
    """Send the records held by dead letters back where they were headed, byte for byte.

    Once a letter's cause is gone (a topic's max.message.bytes raised, a consumer fixed or
    upgraded), its record can go to its topic again. By default only letters of records the
    broker refused or a handler failed on: an undecodable or invalid record would only be
    dead-lettered again (name those error types to send them anyway). Letters whose value was
    cut short, and raw journal records that made no valid event, are skipped and counted. A
    record whose topic is missing, or does not take its schema, is refused and the rest go on.
    Consumers drop an event they already have by its id, but one that comes after its rollout
    closed is dead-lettered again as late, so re-drive a range once: the command prints, per
    partition, where the next run starts (at the first record not taken, if any).
    """
    settings = _kafka(bootstrap)
    registry = TopicRegistry.from_settings(settings)
    letters = registry[DEAD_LETTERS].name

    def progress(done: Redriven) -> None:
        click.echo(f"\r{done.read:,} letters", nl=False, err=True)

    async def go() -> Redriven:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await redrive(settings, read_topic(settings, letters, rng),
                             error_types=frozenset(error_types) or REDRIVEN_BY_DEFAULT,
                             topics={_topic_name(registry, t) for t in topics} or None,
                             to_topic=_topic_name(registry, to_topic) if to_topic else None, dry_run=dry_run,
                             progress=progress, stop=stop)

    try:
        done = _run(go(), settings)
    except KeyError as exc:  # the dead-letter topic does not exist
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from exc
    verb = "would send" if dry_run else "sent"
    click.echo("", err=True)
    for topic, count in sorted(done.sent.items()):
        click.echo(f"{verb} {count:,} to {topic}")
    for reason, count in sorted(done.skipped.items()):
        click.echo(f"skipped {count:,}: {reason}")
    for failure in done.failed[:20]:
        click.echo(f"{'would be refused' if dry_run else 'not taken'}: {failure}", err=True)
    if len(done.failed) > 20:
        click.echo(f"… and {len(done.failed) - 20:,} more", err=True)
    for partition, offset in sorted(done.resume.items()):
        click.echo(f"next run, partition {partition}: --partition {partition} --from-offset {offset}")
    if done.interrupted:
        raise click.ClickException("stopped before the end of the range (the counts above are what was done)")
    if done.failed:
        records = f"{len(done.failed):,} record{'s' if len(done.failed) > 1 else ''}"
        if dry_run:
            raise click.ClickException(f"{records} would be refused (above)")
        raise click.ClickException(f"{records} not taken (above); the rest went on")


@topics_group.command("lag")
@bootstrap_option
@click.option("--group", "-g", default=None, help="Only this consumer group.")
def topics_lag(bootstrap: str | None, group: str | None) -> None:
    """Each consumer group's committed offset, end offset and lag per partition."""
    settings = _kafka(bootstrap)

    async def go() -> None:
        async with KafkaAdmin(settings) as admin:
            rows = await admin.lag(group)
        if not rows:
            click.echo("no committed offsets" + (f" for group {group}" if group else ""))
            return
        click.echo(f"{'group':24} {'topic':32} {'part':>4} {'committed':>10} {'end':>10} {'lag':>8}")
        for r in rows:
            committed = "-" if r.committed is None else str(r.committed)
            click.echo(f"{r.group:24} {r.topic:32} {r.partition:4d} {committed:>10} {r.end:10d} {r.lag:8d}")
        totals: dict[str, int] = {}
        for r in rows:
            totals[r.group] = totals.get(r.group, 0) + r.lag
        for g, lag in totals.items():
            click.echo(f"{g}: total lag {lag:,}")

    with contextlib.suppress(KeyboardInterrupt):
        _run(go(), settings)
