"""Checkpoints, version 1: new weights and where they were applied, on ``openforge.checkpoints.v1``.

The topic is compacted (latest record per key). A checkpoint is keyed by model name, so
compaction keeps the newest checkpoint of each model. The learner's progress notices are keyed
``"<model>@learner"``, so the latest one survives compaction too. An "applied" notice is keyed by model name
and replica instead: sharing the model-name key would let compaction replace the checkpoint, with
its path and offsets, by a mere notice, and keying per replica keeps the current version of every
replica readable from the compacted topic.
"""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import Field, model_validator

from schemas._base import EventBase, FrozenModel, UtcDatetime
from schemas._common import Identifier

__all__ = ["CheckpointAppliedV1", "CheckpointV1", "LearnerProgressV1", "TopicOffset"]


class TopicOffset(FrozenModel):
    """A consumer position in one partition."""

    topic: str = Field(min_length=1, max_length=249)
    """Topic name, prefix included."""

    partition: int = Field(ge=0)
    """Partition number."""

    offset: int = Field(ge=0)
    """The next offset to read (Kafka's committed-offset convention), not the last one read."""


class CheckpointV1(EventBase):
    """Weights saved by the learner, ready to load.

    ``consumed_offsets`` are stored with the weights so a restarted learner resumes reading
    trajectories exactly after the last one these weights include: nothing lost, nothing twice.
    """

    SCHEMA: ClassVar[str] = "checkpoint"
    VERSION: ClassVar[int] = 1

    model: str = Field(min_length=1, max_length=256)
    """Model name as served by the engine; the Kafka key."""

    version: int = Field(ge=0)
    """Weight version, strictly increasing per model. Engines report it as its decimal string in
    the weight version ranges of calls."""

    uri: str = Field(min_length=1)
    """Folder holding the safetensors files and config: a local path or a URI the publisher and
    the engines can read."""

    step: int = Field(ge=0)
    """Optimizer steps taken when the weights were saved."""

    consumed_offsets: list[TopicOffset] = Field(default_factory=list)
    """Next offset to read per trajectory-topic partition, for an exact resume."""

    metrics: dict[str, float] = Field(default_factory=dict)
    """Training metrics at save time (loss, reward mean, staleness, ...). Finite values only:
    plain JSON cannot carry NaN or infinity, so report those as absent."""

    @model_validator(mode="after")
    def _unique_partitions(self) -> Self:
        seen: set[tuple[str, int]] = set()
        for item in self.consumed_offsets:
            key = (item.topic, item.partition)
            if key in seen:
                raise ValueError(f"consumed_offsets lists {item.topic}[{item.partition}] more than once")
            seen.add(key)
        return self

    def partition_key(self) -> str:
        """Return the model name."""
        return self.model


class CheckpointAppliedV1(EventBase):
    """A checkpoint was loaded (or failed to load) on one engine replica."""

    SCHEMA: ClassVar[str] = "checkpoint_applied"
    VERSION: ClassVar[int] = 1

    model: str = Field(min_length=1, max_length=256)
    """Model name, as in the checkpoint."""

    version: int = Field(ge=0)
    """Version that was applied (or attempted)."""

    replica: Identifier
    """Engine replica: its base URL or a stable id."""

    applied_at: UtcDatetime
    """When the replica finished loading (or gave up)."""

    duration_s: float = Field(ge=0)
    """Seconds the load took, pause included."""

    ok: bool
    """Whether the replica now serves this version."""

    error: str | None = None
    """What went wrong; set exactly when ``ok`` is false."""

    verified_parameters: int | None = Field(default=None, ge=0)
    """Parameters whose digests the replica reported equal to the checkpoint's after loading it
    (None: not verified, e.g. a replica found already serving the version)."""

    @model_validator(mode="after")
    def _error_iff_failed(self) -> Self:
        if self.ok == (self.error is not None):
            raise ValueError("error must be set exactly when ok is false")
        return self

    def partition_key(self) -> str:
        """Return ``"<model>@<replica>"``: one compacted record per replica (see module doc)."""
        return f"{self.model}@{self.replica}"


class LearnerProgressV1(EventBase):
    """Where the learner is: newest published version, steps, and trajectories it has not trained yet.

    Published after every step (taken or skipped) and, while trajectories arrive, at most once per
    ``OPENFORGE_LEARNER_PROGRESS_INTERVAL_S``. The launcher paces rollouts by it: what it adds to
    ``pending``, plus the trajectory records beyond ``read_offsets``, is what the learner still has
    to train before a newly launched rollout's turn comes. It also carries the learner settings
    that pacing derives from, so the launcher does not repeat them.
    """

    SCHEMA: ClassVar[str] = "learner_progress"
    VERSION: ClassVar[int] = 1

    model: str = Field(min_length=1, max_length=256)
    """Model name, as in the checkpoints."""

    version: int = Field(ge=0)
    """Newest weight version published (0: the initial weights, no checkpoint yet)."""

    step: int = Field(ge=0)
    """Optimizer steps taken."""

    steps_since_checkpoint: int = Field(ge=0)
    """Steps taken since the newest version was published."""

    pending: int = Field(ge=0)
    """Trajectories read from the topic and neither trained nor dropped yet (decoded ahead,
    waiting in an incomplete group, or ready for the next step)."""

    read_offsets: list[TopicOffset] = Field(default_factory=list)
    """Next offset the learner reads per trajectory-topic partition: records from there on are
    not in ``pending`` yet."""

    max_staleness: int = Field(ge=0)
    """The learner's staleness bound, in published versions."""

    checkpoint_every: int = Field(ge=1)
    """Steps per published version."""

    groups_per_step: int = Field(ge=1)
    """Task groups per step."""

    min_group_size: int = Field(ge=1)
    """Usable members a group needs to train."""

    def partition_key(self) -> str:
        """Return ``"<model>@learner"``: its own compacted record beside the model's checkpoint."""
        return f"{self.model}@learner"
