"""Checkpoints: a safetensors folder written atomically, then a ``CheckpointV1`` that points at it.

Order matters for an exact resume: the folder (weights, optimizer state and the learner's position
ledger) is complete on disk before its event is published, and the event is what a restart trusts.
"On disk" means durable: every file, the folder, its rename into place and the parent folder are
fsynced before the event goes out, so a power loss after the event cannot leave the event pointing
at a folder that is missing or half written. A folder whose event never went out (the process died
in between) is an orphan; the next save of that version replaces it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from consumers.weight_digests import write_manifest
from learner.positions import TopicPartitionKey
from schemas import CheckpointV1, DecodeError, decode
from stream.admin import KafkaAdmin
from stream.settings import KafkaSettings
from stream.topics import CHECKPOINTS, MissingTopicsError, TopicRegistry

logger = logging.getLogger(__name__)

STATE_FILE = "learner_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or the one to resume from cannot be used."""


@dataclass
class LearnerState:
    """What the learner stores beside the weights so a restart continues exactly."""

    version: int
    step: int
    watermarks: dict[TopicPartitionKey, int]
    finished_above: dict[TopicPartitionKey, list[int]]
    trained_ids: list[str] = field(default_factory=list)
    """Trajectories trained in the steps since the previous checkpoint (audit and tests)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Trajectories dropped since the previous checkpoint, with the reason."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (topic-partition keys as ``"topic:partition"``)."""
        return {
            "version": self.version, "step": self.step,
            "watermarks": {f"{t}:{p}": o for (t, p), o in self.watermarks.items()},
            "finished_above": {f"{t}:{p}": o for (t, p), o in self.finished_above.items()},
            "trained_ids": self.trained_ids, "dropped": self.dropped,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        """Inverse of :meth:`to_json`."""
        def key(text: str) -> TopicPartitionKey:
            topic, _, partition = text.rpartition(":")
            return (topic, int(partition))

        return cls(
            version=int(data["version"]), step=int(data["step"]),
            watermarks={key(k): int(v) for k, v in data["watermarks"].items()},
            finished_above={key(k): [int(o) for o in v] for k, v in data["finished_above"].items()},
            trained_ids=list(data.get("trained_ids", [])), dropped=dict(data.get("dropped", {})),
        )


def checkpoint_folder(root: Path, version: int) -> Path:
    """Folder of the checkpoint with ``version``."""
    return root / f"v{version:08d}"


def write_checkpoint_folder(root: Path, version: int, save: Any, state: LearnerState) -> Path:
    """Write into a temporary folder, then rename into place, so readers never see half a checkpoint.

    Everything is fsynced before this returns (the caller publishes the event after): each file
    and folder written, then the rename, through the parent folder.

    Args:
        root: Parent folder of all checkpoints.
        version: The weight version being saved.
        save: ``save(folder)`` writes the weights (the worker's ``save``).
        state: The learner state stored beside them.
    """
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if created:
        _fsync(root.parent)
    final = checkpoint_folder(root, version)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        save(tmp)
        # The learner's own record of the weights, which the publisher checks every replica against.
        write_manifest(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state.to_json()))
        _fsync_tree(tmp)
        if final.exists():
            logger.warning("replacing %s: an earlier run wrote it but never published its event", final)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(root)  # the rename (and any removal of an orphan) lives in the parent folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fsync_tree(folder: Path) -> None:
    """Fsync every file under ``folder``, then each folder, deepest first (a folder lists its entries)."""
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            folders.append(path)
        else:
            _fsync(path)
    for path in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(folder: Path) -> LearnerState:
    """The learner state stored in a checkpoint folder.

    Raises:
        CheckpointError: the folder or its state file is missing or unreadable.
    """
    path = folder / STATE_FILE
    try:
        return LearnerState.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot resume from {folder}: {STATE_FILE} is missing or invalid ({exc})") from exc


async def latest_checkpoint(kafka: KafkaSettings, registry: TopicRegistry, model: str,
                            timeout_ms: int = 10_000) -> CheckpointV1 | None:
    """The newest ``CheckpointV1`` of ``model`` on the checkpoints topic, read to its current end."""
    topic = registry[CHECKPOINTS].name
    consumer = AIOKafkaConsumer(**kafka.client_kwargs(), client_id=f"{kafka.client_id}-resume",
                                enable_auto_commit=False, group_id=None, isolation_level="read_committed")
    best: CheckpointV1 | None = None
    try:
        await consumer.start()
        tps = await topic_partitions(kafka, registry, topic)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        remaining = {tp for tp in tps if ends[tp] > 0}
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=timeout_ms)
            if not batches:
                raise CheckpointError(f"reading {topic} to its end timed out")
            for tp, records in batches.items():
                for record in records:
                    try:
                        event = decode(tuple(record.headers or ()), record.value)
                    except DecodeError as exc:
                        logger.warning("skipping undecodable record %s[%d]@%d: %s", topic, tp.partition,
                                       record.offset, exc)
                        continue
                    if isinstance(event, CheckpointV1) and event.model == model and (
                            best is None or event.version >= best.version):
                        best = event
            remaining = {tp for tp in remaining if await consumer.position(tp) < ends[tp]}
    finally:
        await consumer.stop()
    return best


async def topic_partitions(kafka: KafkaSettings, registry: TopicRegistry, topic: str) -> list[TopicPartition]:
    """Partitions of ``topic``, asked of the cluster (a consumer's cached metadata may lag a new topic).

    Raises:
        MissingTopicsError: the topic does not exist (the command ends on its one line).
    """
    async with KafkaAdmin(kafka, registry) as admin:
        try:
            return await admin.partitions(topic)
        except KeyError:
            raise MissingTopicsError.of([topic], kafka.bootstrap_servers) from None
