"""Training samples from a rollout's recorded calls: token-exact, merged where prefixes allow.

Pure functions, no I/O. Every id, logprob and version comes from the recorded call events; nothing
is re-tokenized. A call is appended to the current sample when its ``prompt_token_ids`` start with
the current sample's prompt and completion exactly (token for token); the prompt tokens after that
prefix (tool results, user turns, template glue) join the completion with loss mask 0 and a
placeholder logprob of 0.0. Every token gets an origin (:class:`~schemas.trajectory.v1.TokenOrigin`):
the first prompt is the user's and system's, each added stretch the tools' when the messages it
adds are all tool results (the user's otherwise, the template's when it adds no message), and each
sampled stretch the policy's; the loss mask is derived from the origins alone.

A call whose prompt does not extend the sample starts a new sample and the break is counted: a
harness that rewrites history (OpenClaw's ephemeral trailing message, Claude Code's system message
inside ``messages``) shows up as a break rate, per harness, in the assembler's metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from consumers.assembler.drift import diagnose_break
from schemas import Logprobs, ModelCallV1, TokenIds, WeightVersionRange
from schemas.call.v1 import CallStatus
from schemas.drift import DriftReason
from schemas.trajectory.v1 import (
    MergeBreakRecord,
    MergeStats,
    OriginSpan,
    TokenOrigin,
    TrajectorySample,
    loss_mask_of,
)

__all__ = ["BuiltSamples", "MergeBreak", "build_samples", "order_calls", "usable_calls"]

_ID_BYTES = 4  # TokenIds are packed int32
_LOGPROB_BYTES = 8  # Logprobs are packed float64; 0.0 is eight zero bytes


@dataclass(frozen=True)
class MergeBreak:
    """A call whose prompt did not extend the previous context, for logs and metrics.

    Attributes:
        call_id: The call that started a new sample.
        context_tokens: Length of the context (previous prompt plus completion) it failed to extend.
        common_prefix_tokens: How many leading tokens of its prompt matched that context; close to
            ``context_tokens`` means the harness rewrote the tail (an ephemeral message), small
            means it rewrote or compacted history.
        sample_index: The sample it started.
        reason: Why, from the messages (:func:`~consumers.assembler.drift.diagnose_break`).
    """

    call_id: str
    context_tokens: int
    common_prefix_tokens: int
    sample_index: int = 1
    reason: DriftReason | None = None

    def record(self) -> MergeBreakRecord:
        """The break as the trajectory carries it."""
        return MergeBreakRecord(call_id=self.call_id, sample_index=self.sample_index,
                                context_tokens=self.context_tokens,
                                common_prefix_tokens=self.common_prefix_tokens, reason=self.reason)


@dataclass(frozen=True)
class BuiltSamples:
    """The samples of one rollout and how they were obtained.

    Attributes:
        samples: Training sequences in call order.
        stats: Counts of calls seen, merged, breaking and skipped (goes on the trajectory).
        breaks: One entry per break, in call order.
    """

    samples: list[TrajectorySample]
    stats: MergeStats
    breaks: list[MergeBreak]


def order_calls(calls: Iterable[ModelCallV1]) -> list[ModelCallV1]:
    """Put calls in the order the harness made them and drop repeated ``call_id``s.

    Events of one rollout share a partition, so arrival order is usually call order already; but a
    call the proxy had to spool arrives late, so calls are ordered by when the proxy received them
    (ties keep arrival order). A call id seen twice (a re-sent event with a new event id) keeps
    its first copy.
    """
    seen: set[str] = set()
    unique: list[ModelCallV1] = []
    for call in calls:
        if call.call_id not in seen:
            seen.add(call.call_id)
            unique.append(call)
    return sorted(unique, key=lambda call: call.timings.started_at)  # sorted() is stable


def usable_calls(calls: Sequence[ModelCallV1]) -> list[ModelCallV1]:
    """The calls that yield training tokens, in the given order.

    Left out: calls that did not end ``ok`` (the harness never received their tokens, so its next
    prompt cannot contain them), calls another call names in ``retry_of`` (only the last attempt of
    a retried request counts), and calls without prompt ids or without a sampled token.
    """
    superseded = {call.retry_of for call in calls if call.retry_of is not None}
    usable = []
    for call in calls:
        choice = call.first_choice
        if (
            call.status is CallStatus.OK
            and call.call_id not in superseded
            and len(call.prompt_token_ids) > 0
            and choice is not None
            and len(choice.completion_token_ids) > 0
        ):
            usable.append(call)
    return usable


class _SampleBuilder:
    """Accumulates one merged sample as packed bytes, so long contexts are never unpacked."""

    def __init__(self, call: ModelCallV1) -> None:
        self.prompt = call.prompt_token_ids
        self.context = bytearray(call.prompt_token_ids.to_bytes())
        self.completion = bytearray()
        self.origins: list[OriginSpan] = []
        self._origin(TokenOrigin.USER, len(call.prompt_token_ids))
        self.logprobs: list[Logprobs] = []
        self.versions: list[WeightVersionRange] = []
        self.versions_known = True
        self.call_ids: list[str] = []
        self.last = call
        self._append(call, gap=TokenIds())

    def extends(self, call: ModelCallV1) -> bool:
        return call.prompt_token_ids.to_bytes().startswith(self.context)

    def merge(self, call: ModelCallV1) -> None:
        gap = call.prompt_token_ids[len(self.context) // _ID_BYTES :]
        origin = _added_origin(self.last, call)
        self.last = call
        self._append(call, gap, origin)

    def _append(self, call: ModelCallV1, gap: TokenIds, origin: TokenOrigin = TokenOrigin.TEMPLATE) -> None:
        choice = call.first_choice
        assert choice is not None  # usable_calls guarantees it
        gap_bytes = gap.to_bytes()
        if gap_bytes:
            self.completion += gap_bytes
            self._origin(origin, len(gap))
            self.logprobs.append(Logprobs.from_bytes(bytes(len(gap) * _LOGPROB_BYTES)))
        offset = len(self.completion) // _ID_BYTES
        sampled = choice.completion_token_ids.to_bytes()
        self.completion += sampled
        self._origin(TokenOrigin.SAMPLED, len(choice.completion_token_ids))
        self.logprobs.append(choice.logprobs)
        self.context += gap_bytes + sampled
        self.call_ids.append(call.call_id)
        if not choice.weight_versions:
            # One call without versions makes the whole sample's versions unknown: partial
            # ranges would leave trained tokens uncovered, which the learner cannot interpret.
            self.versions_known = False
        for item in choice.weight_versions:
            start, end = item.start + offset, item.end + offset
            last = self.versions[-1] if self.versions else None
            if last is not None and last.version == item.version and last.end == start:
                self.versions[-1] = WeightVersionRange(version=item.version, start=last.start, end=end)
            else:
                self.versions.append(WeightVersionRange(version=item.version, start=start, end=end))

    def _origin(self, origin: TokenOrigin, count: int) -> None:
        start = self.origins[-1].end if self.origins else 0
        if count and self.origins and self.origins[-1].origin is origin:
            self.origins[-1] = OriginSpan(origin=origin, start=self.origins[-1].start, end=start + count)
        elif count:
            self.origins.append(OriginSpan(origin=origin, start=start, end=start + count))

    def build(self) -> TrajectorySample:
        total = (len(self.prompt.to_bytes()) + len(self.completion)) // _ID_BYTES
        return TrajectorySample(
            prompt_ids=self.prompt,
            completion_ids=TokenIds.from_bytes(self.completion),
            loss_mask=loss_mask_of(self.origins, len(self.prompt), total),
            origins=self.origins,
            behavior_logprobs=Logprobs.concat(self.logprobs),
            weight_versions=self.versions if self.versions_known else [],
            call_ids=self.call_ids,
        )


def _added_origin(before: ModelCallV1, call: ModelCallV1) -> TokenOrigin:
    """Whose tokens ``call`` added after ``before``'s context: by the roles of the messages it adds."""
    added = call.request.messages[len(before.request.messages) + 1:]  # after the repeated answer
    roles = {message.get("role") if isinstance(message, dict) else None for message in added}
    if not roles:
        return TokenOrigin.TEMPLATE
    return TokenOrigin.TOOL if roles == {"tool"} else TokenOrigin.USER


def _common_prefix_tokens(context: bytes, prompt: bytes) -> int:
    # Binary search on whole tokens: each probe is a C-level slice comparison, so a 100k-token
    # context costs ~17 comparisons rather than a Python loop over every token.
    low, high = 0, min(len(context), len(prompt)) // _ID_BYTES
    while low < high:
        middle = (low + high + 1) // 2
        if context[: middle * _ID_BYTES] == prompt[: middle * _ID_BYTES]:
            low = middle
        else:
            high = middle - 1
    return low


def build_samples(calls: Sequence[ModelCallV1]) -> BuiltSamples:
    """Turn a rollout's calls into training samples, merging calls that extend the context.

    Args:
        calls: The rollout's call events in call order (see :func:`order_calls`), any status.

    Returns:
        The samples, the merge statistics, and one :class:`MergeBreak` per call that started a
        new sample after the first. ``stats.calls == stats.skipped + stats.merged + stats.breaks``
        plus one when any sample was built.
    """
    usable = usable_calls(calls)
    builders: list[_SampleBuilder] = []
    breaks: list[MergeBreak] = []
    merged = 0
    for call in usable:
        current = builders[-1] if builders else None
        if current is not None and current.extends(call):
            current.merge(call)
            merged += 1
            continue
        if current is not None:
            breaks.append(MergeBreak(
                call_id=call.call_id,
                context_tokens=len(current.context) // _ID_BYTES,
                common_prefix_tokens=_common_prefix_tokens(bytes(current.context), call.prompt_token_ids.to_bytes()),
                sample_index=len(builders),
                reason=diagnose_break(current.last, call),
            ))
        builders.append(_SampleBuilder(call))
    stats = MergeStats(calls=len(calls), merged=merged, breaks=len(breaks), skipped=len(calls) - len(usable))
    return BuiltSamples([b.build() for b in builders], stats, breaks)
