"""Trajectories, version 1: token-exact training data on ``openforge.trajectories.v1``.

The assembler joins a rollout's calls, lifecycle and reward into one trajectory. Consecutive calls
whose prompt extends the previous call's prompt and completion are merged into one sample, with
the tokens the model did not sample (tool results, user turns, template glue) masked out, so a
multi-turn episode trains as one sequence. When a prompt does not extend the previous context
(the harness compacted or rewrote history), a new sample starts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, model_validator

from schemas._arrays import Logprobs, LossMask, TokenIds
from schemas._base import EventBase, FrozenModel
from schemas._common import Identifier, WeightVersionRange, check_version_ranges, uncovered_spans
from schemas.drift import DriftReason
from schemas.failures import FailureReason
from schemas.rollout.v1 import RolloutPhase, RolloutReason

__all__ = [
    "FinalizeReason",
    "MergeBreakRecord",
    "MergeStats",
    "OriginSpan",
    "TokenOrigin",
    "ToolErrorRecord",
    "ToolErrorRule",
    "ToolUse",
    "TrajectorySample",
    "TrajectoryV1",
    "loss_mask_of",
]


class FinalizeReason(StrEnum):
    """Why the assembler closed the trajectory when it did."""

    COMPLETED = "completed"
    """The terminal lifecycle event and the reward both arrived."""
    NO_REWARD_EXPECTED = "no_reward_expected"
    """The rollout ended without success, so no reward will come."""
    REWARD_TIMEOUT = "reward_timeout"
    """The rollout succeeded but no reward arrived within the assembler's wait."""
    LIFECYCLE_TIMEOUT = "lifecycle_timeout"
    """No terminal lifecycle event arrived within the assembler's wait."""
    EVICTED = "evicted"
    """The assembler had to drop open state (memory bound) and flushed what it had."""


class TokenOrigin(StrEnum):
    """Where a token of a sample came from; only ``sampled`` tokens are trained."""

    SAMPLED = "sampled"
    """Sampled by the policy; its behaviour logprob and weight version are recorded with it."""
    TEMPLATE = "template"
    """Written by the chat template: a turn's closing or opening the model did not sample (bridge)."""
    TOOL = "tool"
    """A tool's or the environment's output, as the harness sent it back."""
    USER = "user"
    """A user or system message (with the template's markup around it), or the tools offered."""


class OriginSpan(FrozenModel):
    """Tokens ``[start, end)`` of a sample's sequence (its prompt, then its completion) of one origin."""

    origin: TokenOrigin
    """Where these tokens came from."""

    start: int = Field(ge=0)
    """Index of the first token, counted from the first prompt id."""

    end: int = Field(ge=1)
    """Index one past the last token."""

    @model_validator(mode="after")
    def _non_empty(self) -> Self:
        if self.end <= self.start:
            raise ValueError(f"origin span must be non-empty: start={self.start} end={self.end}")
        return self


def loss_mask_of(origins: list[OriginSpan], prompt_tokens: int, total: int) -> LossMask:
    """The loss mask over the completion that ``origins`` imply: 1 exactly where a token was sampled.

    Raises:
        ValueError: the spans do not cover ``[0, total)`` in order without gaps or overlaps, or
            a prompt token is marked sampled (a prompt is never trained).
    """
    mask = bytearray(max(total - prompt_tokens, 0))
    position = 0
    for span in origins:
        if span.start != position:
            raise ValueError(f"origin spans must cover the sequence in order without gaps; a span starts at "
                             f"{span.start}, expected {position}")
        if span.end > total:
            raise ValueError(f"origin span [{span.start}, {span.end}) runs past the end of the sequence ({total} "
                             "tokens)")
        if span.origin is TokenOrigin.SAMPLED:
            if span.start < prompt_tokens:
                raise ValueError(f"origin span [{span.start}, {span.end}) marks prompt tokens sampled; the prompt "
                                 f"ends at {prompt_tokens}")
            mask[span.start - prompt_tokens:span.end - prompt_tokens] = b"\x01" * (span.end - span.start)
        position = span.end
    if position != total:
        raise ValueError(f"origin spans cover {position} tokens but the sequence has {total}")
    return LossMask.from_bytes(mask)


class TrajectorySample(FrozenModel):
    """One training sequence: a prompt and the completion that follows it.

    ``completion_ids``, ``loss_mask`` and ``behavior_logprobs`` are aligned token by token. The
    completion holds the sampled tokens of every merged call plus the context tokens in between,
    which carry mask 0 and a placeholder logprob of 0.0.
    """

    prompt_ids: TokenIds
    """Prompt of the first merged call, exactly as the engine tokenized it."""

    completion_ids: TokenIds
    """Everything after the prompt: sampled tokens and the context added between calls."""

    loss_mask: LossMask
    """1 for tokens the model sampled (trained), 0 for context tokens; aligned with
    ``completion_ids``. One byte per token (see :class:`~schemas.LossMask`). Where ``origins`` is
    given, exactly the mask they imply (:func:`loss_mask_of`)."""

    behavior_logprobs: Logprobs
    """Logprob under the sampling weights for each completion token (0.0 where masked)."""

    weight_versions: list[WeightVersionRange] = Field(default_factory=list)
    """Weight version ranges over ``completion_ids``; every trained token is covered, context
    tokens need not be. Empty when the engine reported no versions."""

    call_ids: list[Identifier] = Field(min_length=1)
    """Calls merged into this sample, in order."""

    origins: list[OriginSpan] = Field(default_factory=list)
    """The origin of every token, as runs over the prompt followed by the completion; empty from
    assemblers that predate origins."""

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        ids = len(self.completion_ids)
        mask, logprobs = len(self.loss_mask), len(self.behavior_logprobs)
        if mask != ids:
            raise ValueError(
                f"loss_mask has {mask} values but completion_ids has {ids} tokens; "
                "they must be aligned one to one"
            )
        if logprobs != ids:
            raise ValueError(
                f"behavior_logprobs has {logprobs} values but completion_ids has {ids} tokens; "
                "they must be aligned one to one"
            )
        check_version_ranges(self.weight_versions, ids, what="weight_versions", require_cover=False)
        if self.weight_versions:
            mask_bytes = self.loss_mask.to_bytes()
            for span in uncovered_spans(self.weight_versions, ids):
                if mask_bytes.find(1, span.start, span.stop) >= 0:
                    raise ValueError(
                        f"trained tokens in [{span.start}, {span.stop}) have no weight version; "
                        "every token with loss_mask 1 must be covered by weight_versions"
                    )
        if self.origins:
            implied = loss_mask_of(self.origins, len(self.prompt_ids), len(self.prompt_ids) + ids)
            if implied != self.loss_mask:
                raise ValueError("loss_mask differs from the mask the origins imply (1 exactly on sampled tokens)")
        return self

    @property
    def trained_tokens(self) -> int:
        """Number of completion tokens with loss mask 1."""
        return self.loss_mask.count_trained()


class MergeStats(FrozenModel):
    """How the assembler turned the rollout's calls into samples, for monitoring the merge."""

    calls: int = Field(ge=0)
    """Call events seen for the rollout."""

    merged: int = Field(ge=0)
    """Calls appended to the previous sample because their prompt extended its context."""

    breaks: int = Field(ge=0)
    """Calls whose prompt did not extend the previous context and started a new sample."""

    skipped: int = Field(default=0, ge=0)
    """Calls left out: failed, superseded by a retry, or without token ids."""


class MergeBreakRecord(FrozenModel):
    """One call that did not extend the context before it, and so started a new sample."""

    call_id: Identifier
    """The call that started the new sample."""

    sample_index: int = Field(ge=1)
    """Index in ``samples`` of the sample it started (a trajectory published without its samples,
    too large for the topic, keeps its breaks)."""

    context_tokens: int = Field(ge=0)
    """Length of the context (previous prompt plus completion) it failed to extend."""

    common_prefix_tokens: int = Field(ge=0)
    """Leading tokens of its prompt that matched that context: close to ``context_tokens`` means
    the tail was rewritten, small means the history was."""

    reason: DriftReason | None = None
    """Why, as far as the calls' messages tell; absent when they cannot (no request recorded)."""


class ToolErrorRule(StrEnum):
    """Which rule marked a tool result as an error."""

    IS_ERROR = "is_error"
    """The protocol said so: an Anthropic ``tool_result`` with ``is_error`` set."""
    EXIT_CODE = "exit_code"
    """The result reports a non-zero exit code (the assembler's exit-code pattern)."""
    ERROR_TEXT = "error_text"
    """The result's text matches one of the assembler's error patterns."""


class ToolErrorRecord(FrozenModel):
    """A tool call whose result was an error, and whether the agent recovered from it."""

    tool_call_id: str = Field(min_length=1, max_length=256)
    """Id of the failed tool call, as the harness sent it."""

    tool_name: str = Field(max_length=256)
    """Name of the tool (empty when the call that made it is not in the recorded history)."""

    call_id: Identifier
    """The model call whose request first carried the failing result."""

    rule: ToolErrorRule
    """Which rule marked the result as an error."""

    recovered: bool
    """A later call of the same tool succeeded."""

    recovered_by: str | None = Field(default=None, max_length=256)
    """Id of that later successful tool call; set exactly when ``recovered``."""

    @model_validator(mode="after")
    def _recovered_by(self) -> Self:
        if self.recovered != (self.recovered_by is not None):
            raise ValueError("recovered_by must be set exactly when recovered is true")
        return self


class ToolUse(FrozenModel):
    """How the agent used its tools in the rollout, from the recorded calls (metadata: not in the loss)."""

    tool_calls: int = Field(ge=0)
    """Tool calls the model made (parsed tool calls in its answers)."""

    results: int = Field(ge=0)
    """Tool results the harness sent back."""

    errors: int = Field(ge=0)
    """Of those, results marked as errors."""

    recovered: int = Field(ge=0)
    """Of those errors, ones followed by a successful call of the same tool."""

    parse_failures: int = Field(default=0, ge=0)
    """Answers in which the model tried to call a tool but no valid call came out: tool-call
    markup left in the text, or arguments that are not a JSON object."""


class TrajectoryV1(EventBase):
    """A finished rollout as training data, with its reward and group context.

    Keyed by ``task_id`` so every rollout of a group lands on one partition and the learner sees
    whole groups in order.
    """

    SCHEMA: ClassVar[str] = "trajectory"
    VERSION: ClassVar[int] = 1

    trajectory_id: Identifier
    """Unique id of the trajectory; the learner's dedup key across assembler restarts."""

    rollout_id: Identifier
    """The rollout this trajectory was built from."""

    task_id: Identifier
    """Task of the rollout; the Kafka key."""

    run_id: Identifier | None = None
    """Experiment run, copied from the lifecycle events."""

    group_index: int = Field(ge=0)
    """Position of the rollout within its task's group."""

    group_size: int | None = Field(default=None, ge=1)
    """Rollouts in the group, so the learner knows when a group is complete."""

    harness: str | None = Field(default=None, min_length=1)
    """Harness that ran the rollout."""

    timeout_s: float | None = Field(default=None, gt=0)
    """The task's time limit of one rollout in seconds, from the ``scheduled`` lifecycle event;
    the learner waits this long (plus a grace) after a group's first trajectory for the rest."""

    reward: float | None = Field(default=None, allow_inf_nan=False)
    """The verifier's reward; absent when none arrived."""

    phase: RolloutPhase | None = None
    """Last lifecycle phase seen; absent when no lifecycle event arrived."""

    reason: RolloutReason | None = None
    """Reason of the last lifecycle event, if any."""

    infrastructure_failure: bool = False
    """The rollout failed for reasons unrelated to the policy; the learner leaves it out of group
    statistics."""

    failure_reason: FailureReason | None = None
    """Why the rollout gave no scored result, by the failure taxonomy (:mod:`schemas.failures`);
    absent when the verifier's score stands. When set, ``infrastructure_failure`` is its
    ``is_infrastructure``."""

    samples: list[TrajectorySample] = Field(default_factory=list)
    """Training sequences, in call order. Empty for rollouts that made no usable call; such a
    trajectory still counts in its group's statistics unless it is an infrastructure failure."""

    merge_stats: MergeStats
    """How the calls were merged into samples."""

    merge_breaks: list[MergeBreakRecord] = Field(default_factory=list)
    """One record per merge break, in call order (``merge_stats.breaks`` of them when present)."""

    tool_use: ToolUse | None = None
    """Tool calls, results, errors and recoveries; absent from assemblers that predate it."""

    tool_errors: list[ToolErrorRecord] = Field(default_factory=list)
    """Each tool result marked as an error, in the order the harness sent them."""

    finalize_reason: FinalizeReason
    """Why the assembler closed the trajectory."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.finalize_reason is FinalizeReason.COMPLETED and self.reward is None:
            raise ValueError("a trajectory finalized as 'completed' must have a reward")
        failure = self.failure_reason
        if failure is not None and self.infrastructure_failure != failure.is_infrastructure:
            kind = "an infrastructure" if failure.is_infrastructure else "a policy"
            raise ValueError(f"infrastructure_failure={self.infrastructure_failure} contradicts failure_reason "
                             f"{failure.value!r}, which is {kind} failure")
        if self.group_size is not None and self.group_index >= self.group_size:
            raise ValueError(f"group_index {self.group_index} is outside a group of size {self.group_size}")
        return self

    def packed_items(self) -> int:
        """Every sample's prompt, completion, mask and logprob items."""
        return sum(len(x.prompt_ids) + 3 * len(x.completion_ids) for x in self.samples)

    def partition_key(self) -> str:
        """Return ``task_id``."""
        return self.task_id
