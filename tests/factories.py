"""Small builders of realistic events for stream-level tests."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

from schemas import ModelCallV1, RewardV1
from schemas.call.v1 import ApiProtocol, CallChoice, CallStatus, CallTimings, NormalizedRequest


def reward(rollout_id: str | None = None, value: float = 1.0) -> RewardV1:
    return RewardV1(rollout_id=rollout_id or f"r-{uuid.uuid4().hex[:8]}", value=value,
                    verifier_id="verifier-test", info={"passed": 3, "total": 4})


def model_call(prompt_tokens: int = 32, completion_tokens: int = 8, *, rollout_id: str = "r-1",
               seed: int = 0) -> ModelCallV1:
    rng = random.Random(seed)
    return ModelCallV1(
        rollout_id=rollout_id,
        call_id=f"c-{uuid.uuid4().hex[:8]}",
        protocol=ApiProtocol.OPENAI_CHAT,
        model="tiny",
        request=NormalizedRequest(messages=[{"role": "user", "content": "word " * (prompt_tokens // 2)}]),
        prompt_token_ids=[rng.randrange(150_000) for _ in range(prompt_tokens)],
        choices=[CallChoice(
            index=0,
            completion_token_ids=[rng.randrange(150_000) for _ in range(completion_tokens)],
            logprobs=[-rng.random() * 5 for _ in range(completion_tokens)],
            finish_reason="stop",
        )],
        timings=CallTimings(started_at=datetime.now(UTC), total_s=0.01),
        status=CallStatus.OK,
    )
