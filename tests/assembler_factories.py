"""Builders of call, lifecycle and reward events for the assembler's tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from schemas import ModelCallV1, RewardV1, RolloutEventV1, WeightVersionRange
from schemas.call.v1 import ApiProtocol, CallChoice, CallStatus, CallTimings, NormalizedRequest
from schemas.rollout.v1 import Backend, RolloutPhase, RolloutReason

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def call(
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    call_id: str,
    rollout_id: str = "r-1",
    logprobs: Sequence[float] | None = None,
    versions: Sequence[tuple[str, int, int]] | None = None,
    status: CallStatus = CallStatus.OK,
    retry_of: str | None = None,
    attempt: int = 0,
    at: float = 0.0,
) -> ModelCallV1:
    """A call event; ``versions`` as (version, start, end), default one version over everything."""
    if logprobs is None:
        logprobs = [-0.5 - 0.01 * i for i in range(len(completion))]
    if versions is None:
        versions = [("1", 0, len(completion))] if completion else []
    ok = status is CallStatus.OK
    return ModelCallV1(
        rollout_id=rollout_id,
        call_id=call_id,
        attempt=attempt,
        retry_of=retry_of,
        protocol=ApiProtocol.OPENAI_CHAT,
        model="tiny",
        request=NormalizedRequest(messages=[{"role": "user", "content": "hi"}]),
        prompt_token_ids=list(prompt),
        choices=[CallChoice(
            index=0,
            completion_token_ids=list(completion),
            logprobs=list(logprobs),
            weight_versions=[WeightVersionRange(version=v, start=s, end=e) for v, s, e in versions],
            finish_reason="stop",
        )] if (completion or ok) else [],
        timings=CallTimings(started_at=T0 + timedelta(seconds=at), total_s=0.01),
        status=status,
        error_message=None if ok else "upstream failed",
    )


def lifecycle(rollout_id: str, phase: RolloutPhase, *, task_id: str = "task-1", group_index: int = 0,
              group_size: int | None = 4, harness: str | None = "codex", infrastructure_failure: bool = False,
              reason: RolloutReason | None = None) -> RolloutEventV1:
    return RolloutEventV1(rollout_id=rollout_id, task_id=task_id, group_index=group_index,
                          group_size=group_size, harness=harness, phase=phase, reason=reason,
                          infrastructure_failure=infrastructure_failure, backend=Backend.LOCAL)


def reward(rollout_id: str, value: float = 1.0) -> RewardV1:
    return RewardV1(rollout_id=rollout_id, value=value, verifier_id="verifier-test")


def conversation(rollout_id: str, turns: int, *, seed: int = 0, break_at: int | None = None) -> list[ModelCallV1]:
    """A multi-turn rollout whose every prompt extends the previous context, except at ``break_at``."""
    rng = random.Random(seed)
    context = [rng.randrange(1000) for _ in range(rng.randrange(3, 12))]
    calls = []
    for turn in range(turns):
        if turn == break_at:
            context = [*context[:-1], 999_999]  # the harness rewrote the last token
        completion = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        calls.append(call(context, completion, call_id=f"{rollout_id}-c{turn}", rollout_id=rollout_id, at=turn))
        context = context + completion + [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
    return calls
