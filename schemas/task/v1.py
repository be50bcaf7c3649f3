"""Tasks, version 1: what to run, published to ``openforge.tasks.v1`` by ``openforge submit``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints

from schemas._base import EventBase, FrozenModel
from schemas._common import Identifier, JsonObject

__all__ = ["ContainerLaunch", "HarnessSpec", "LocalLaunch", "Resources", "TaskV1", "VerifierSpec"]

Command = Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1)]
"""An argv list (program first). Never a shell string: quoting differs between the local
backend and a pod's entrypoint, and argv removes the ambiguity."""

Quantity = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"),
]
"""A Kubernetes resource quantity such as ``"500m"``, ``"2"`` or ``"4Gi"``, checked at submit
time so a typo fails there rather than as an unschedulable pod."""


class ContainerLaunch(FrozenModel):
    """Run the harness from its own container image (Kubernetes backend)."""

    kind: Literal["container"] = "container"
    """Discriminator of the launch variant."""

    image: str = Field(min_length=1)
    """Image reference holding the harness CLI (e.g. ``ghcr.io/org/coding-agent:1.2``)."""

    command: Command
    """Argv run in the container; the proxy's base URL and key arrive as environment variables."""


class LocalLaunch(FrozenModel):
    """Run the harness as a local process (local backend, the embedded demo)."""

    kind: Literal["local"] = "local"
    """Discriminator of the launch variant."""

    command: Command
    """Argv of the harness process; the proxy's base URL and key arrive as environment variables."""

    workdir: str | None = None
    """Working directory for the process; a fresh temporary directory when absent."""


class HarnessSpec(FrozenModel):
    """The unchanged agent program that the rollout runs, and how to start it."""

    name: str = Field(min_length=1, max_length=128)
    """Harness name (e.g. ``"coding-agent"``); copied onto trajectories so the learner
    and dashboards can split results by harness."""

    launch: ContainerLaunch | LocalLaunch = Field(discriminator="kind")
    """How to start the harness: a container image or a local command."""

    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for the harness. Tasks are stored on Kafka in the clear: never put
    secrets here; the launcher injects credentials itself."""


class VerifierSpec(FrozenModel):
    """The command that scores a finished rollout and reports its reward."""

    command: Command
    """Argv run in the rollout's environment after the harness exits; it reports the reward
    with the verifier credential, which the agent never sees."""

    timeout_s: float | None = Field(default=None, gt=0)
    """Time limit for the verifier alone, in seconds; absent means it shares the task deadline."""


class Resources(FrozenModel):
    """Compute requested for one rollout as Kubernetes quantities; the local backend ignores it."""

    cpu: Quantity | None = None
    """CPU request, e.g. ``"2"`` or ``"500m"``."""

    memory: Quantity | None = None
    """Memory request, e.g. ``"4Gi"``."""

    gpu: Quantity | None = None
    """Number of GPUs, e.g. ``"1"``. Usually absent: the policy runs on the vLLM servers."""


class TaskV1(EventBase):
    """A task: one instruction run ``group_size`` times as independent rollouts.

    The launcher turns each task into ``group_size`` rollouts; their rewards are compared within
    the group (GRPO-style advantages), which is why trajectories are keyed by ``task_id``.
    """

    SCHEMA: ClassVar[str] = "task"
    VERSION: ClassVar[int] = 1

    task_id: Identifier
    """Unique id of the task; the Kafka key, and the group id of its rollouts."""

    run_id: Identifier | None = None
    """Experiment run this task belongs to, copied onto its rollouts and trajectories."""

    instruction: str = Field(min_length=1)
    """What the agent is asked to do, handed to the harness as its prompt."""

    harness: HarnessSpec
    """The agent program and how to start it."""

    environment_image: str | None = Field(default=None, min_length=1)
    """Container image of the environment the agent works in (repository checkout, tools).
    Absent for the local backend, which uses the host."""

    verifier: VerifierSpec
    """The command that computes the reward."""

    group_size: int = Field(ge=1, le=4096)
    """How many rollouts to run for this task."""

    timeout_s: float = Field(gt=0)
    """Wall-clock limit of one rollout in seconds, harness and verifier together."""

    resources: Resources = Field(default_factory=Resources)
    """Compute requested for each rollout."""

    metadata: JsonObject = Field(default_factory=dict)
    """Free-form data (dataset name, split, difficulty, ...); carried through, never interpreted."""

    def partition_key(self) -> str:
        """Return ``task_id``."""
        return self.task_id
