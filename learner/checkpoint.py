"""Checkpoints of two kinds, written atomically, and the retention policy that bounds their disk.

* **Serving weights** (``<checkpoint_dir>/serving/v00000007``): what the engines load and nothing
  else (safetensors in the served dtype, config, tokenizer files), written once per publish; a
  ``CheckpointV1`` event points at the folder.
* **Training state** (``<checkpoint_dir>/state/s00000120``): float32 master weights and optimizer
  state (one file per rank), config and tokenizer files, and the learner's position ledger
  (:data:`STATE_FILE`), written every ``state_every`` steps. A restart resumes from the newest one.

Either kind is written into a temporary folder, fsynced (every file, the folder, then its rename
into place through the parent folder) and only then renamed, so a folder that exists under its
final name is complete and durable; a serving folder's event is published after that. A folder
whose event never went out (the process died in between) is an orphan; the next save of that
version replaces it.

Retention keeps, of each kind, the newest ``keep_last`` and every number divisible by
``keep_every`` (versions for serving weights, steps for training states), and never the folder the
newest published event or the newest training state is: everything else is deleted, including
what earlier runs left behind, so a running system does not fill its disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
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
    """Trajectories trained in the steps since the previous training state (audit and tests)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Trajectories dropped since the previous training state, with the reason."""

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


SERVING_DIR = "serving"
TRAINING_DIR = "state"
_SERVING_NAME = re.compile(r"v(\d{8})")
_STATE_NAME = re.compile(r"s(\d{8})")
_LEFTOVER = (".tmp-", ".del-")


def serving_folder(root: Path, version: int) -> Path:
    """Folder of the serving weights of ``version``."""
    return root / SERVING_DIR / f"v{version:08d}"


def state_folder(root: Path, step: int) -> Path:
    """Folder of the training state saved after ``step`` steps."""
    return root / TRAINING_DIR / f"s{step:08d}"


def temporary_folder(final: Path) -> Path:
    """A fresh, empty temporary folder beside ``final`` (its parents created and made durable)."""
    created = [p for p in (final.parent.parent, final.parent) if not p.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    for path in created:
        _fsync(path.parent)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def write_checkpoint_folder(final: Path, save: Callable[[Path], None], state: LearnerState | None = None,
                            tmp: Path | None = None, *, manifest: bool = False) -> Path:
    """Write into a temporary folder, then rename it to ``final``, so readers never see half a checkpoint.

    Everything is fsynced before this returns (the caller publishes an event after): each file
    and folder written, then the rename, through the parent folder.

    Args:
        final: The folder's name once complete.
        save: ``save(folder)`` writes the content (a worker's ``save_serving`` or ``save_state``).
        state: The learner state stored beside a training state.
        tmp: A temporary folder already made with :func:`temporary_folder` (other ranks write into
            it too); made here when None.
        manifest: Record the weights' digests in it (serving weights: what replicas are verified against).
    """
    tmp = tmp or temporary_folder(final)
    try:
        save(tmp)
        if manifest:
            # The learner's own record of the weights, which the publisher checks every replica against.
            write_manifest(tmp)
        if state is not None:
            (tmp / STATE_FILE).write_text(json.dumps(state.to_json()))
        _fsync_tree(tmp)
        if final.exists():
            logger.warning("replacing %s: an earlier run wrote it but never published or used it", final)
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(final.parent)  # the rename (and any removal of an orphan) lives in the parent folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _numbered(folder: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = pattern.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def serving_versions(root: Path) -> dict[int, Path]:
    """Serving-weight folders under ``root``, by version."""
    return _numbered(root / SERVING_DIR, _SERVING_NAME)


def training_states(root: Path) -> dict[int, Path]:
    """Complete training-state folders under ``root``, by step."""
    return {step: path for step, path in _numbered(root / TRAINING_DIR, _STATE_NAME).items()
            if (path / STATE_FILE).is_file()}


def newest_training_state(root: Path) -> Path | None:
    """The training state a restart resumes from: the one of the most steps, if any."""
    states = training_states(root)
    return states[max(states)] if states else None


@dataclass(frozen=True)
class Retention:
    """Which numbered checkpoints of one kind to keep."""

    keep_last: int
    """The newest this many."""
    keep_every: int | None = None
    """And every number divisible by this."""

    def __post_init__(self) -> None:
        if self.keep_last < 1 or (self.keep_every is not None and self.keep_every < 1):
            raise ValueError(f"retention needs keep_last >= 1 and keep_every >= 1 or None, got {self}")

    def kept(self, numbers: Iterable[int], protected: Iterable[int] = ()) -> set[int]:
        """The members of ``numbers`` to keep; ``protected`` ones always are."""
        ordered = sorted(set(numbers))
        keep = set(ordered[-self.keep_last:]) | (set(protected) & set(ordered))
        if self.keep_every is not None:
            keep |= {n for n in ordered if n % self.keep_every == 0}
        return keep


def apply_retention(root: Path, serving: Retention, states: Retention, newest_version: int,
                    newest_state: int | None) -> list[Path]:
    """Delete the checkpoints under ``root`` that the policies do not keep; return what was deleted.

    Args:
        root: The checkpoint folder.
        serving: Policy of the serving weights (by version).
        states: Policy of the training states (by step).
        newest_version: The newest published version: kept, and serving folders above it (orphans
            whose event never went out) are left for their next save to replace.
        newest_state: The step of the newest training state (the resume point): kept.
    """
    deleted: list[Path] = []
    published = {v: p for v, p in serving_versions(root).items() if v <= newest_version}
    keep = serving.kept(published, [newest_version])
    deleted += [_remove(published[v]) for v in sorted(published.keys() - keep)]
    saved = training_states(root)
    keep = states.kept(saved, [] if newest_state is None else [newest_state])
    deleted += [_remove(saved[s]) for s in sorted(saved.keys() - keep)]
    if deleted:
        logger.info("retention deleted %d checkpoint folders: %s", len(deleted), ", ".join(p.name for p in deleted))
    return deleted


def remove_leftovers(root: Path) -> list[Path]:
    """Delete temporary folders of writes and deletions that a crash interrupted; return them."""
    left = [p for kind in (SERVING_DIR, TRAINING_DIR) if (root / kind).is_dir()
            for p in (root / kind).iterdir() if p.name.startswith(_LEFTOVER)]
    for path in left:
        logger.info("removing %s, left by an interrupted write or deletion", path)
        shutil.rmtree(path, ignore_errors=True)
    return left


def _remove(path: Path) -> Path:
    # Renamed first (atomic) so that a crash midway leaves a leftover, never a half-deleted folder
    # under a checkpoint's name.
    doomed = path.with_name(f".del-{path.name}")
    path.rename(doomed)
    shutil.rmtree(doomed)
    return path


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
