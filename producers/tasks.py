"""Task submission: a JSON Lines file of tasks, validated whole, published in one transaction.

A batch is all or nothing. Every line is validated before anything is sent, so one typo cannot
leave half a dataset on the topic; the valid batch then goes out in a single Kafka transaction,
so a crash mid-publish leaves nothing visible to the launcher (it reads committed records only).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from schemas import TaskV1
from stream.producer import EventProducer
from stream.settings import KafkaSettings
from stream.topics import TASKS, TopicRegistry

__all__ = ["TaskLineError", "parse_tasks", "publish_tasks"]


@dataclass(frozen=True)
class TaskLineError:
    """One invalid line of a task file."""

    line: int
    """1-based line number in the file."""
    message: str
    """What is wrong, with the field path when pydantic found it."""

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def parse_tasks(lines: Iterable[str | bytes]) -> tuple[list[TaskV1], list[TaskLineError]]:
    """Validate every line; return the tasks and every problem found (all of them, not the first).

    Blank lines are skipped. A task id used twice is an error: rollout ids derive from task ids,
    so the second task would silently count as "already launched".
    """
    tasks: list[TaskV1] = []
    errors: list[TaskLineError] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        if not text.strip():
            continue
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            errors.append(TaskLineError(number, f"not valid JSON: {exc}"))
            continue
        if not isinstance(data, dict):
            errors.append(TaskLineError(number, f"a task must be a JSON object, not {type(data).__name__}"))
            continue
        try:
            task = TaskV1.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(task)'}: {e['msg']}" for e in exc.errors())
            errors.append(TaskLineError(number, problems))
            continue
        if task.task_id in first_line:
            errors.append(TaskLineError(
                number, f"task_id {task.task_id!r} was already used on line {first_line[task.task_id]}"))
            continue
        first_line[task.task_id] = number
        tasks.append(task)
    return tasks, errors


async def publish_tasks(tasks: list[TaskV1], kafka: KafkaSettings | None = None) -> int:
    """Publish ``tasks`` to the tasks topic in one transaction; return how many were published.

    Raises:
        Exception: whatever Kafka raised; the transaction is aborted and no task is visible.
    """
    settings = kafka or KafkaSettings()
    registry = TopicRegistry.from_settings(settings)
    # A fresh transactional id per submission: concurrent submitters must not fence each other.
    producer = EventProducer(settings, registry=registry, transactional_id=f"openforge-submit-{uuid.uuid4().hex}",
                             client_id=f"{settings.client_id}-submit")
    async with producer, producer.transaction():
        for task in tasks:
            await producer.send(TASKS, task)
    return len(tasks)
