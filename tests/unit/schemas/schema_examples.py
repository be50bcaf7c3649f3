"""Realistic instances of every v1 event, shared by the schema tests."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from schemas import (
    ApiProtocol,
    Backend,
    CallChoice,
    CallStatus,
    CallTimings,
    CallUsage,
    CheckpointAppliedV1,
    CheckpointV1,
    ContainerLaunch,
    DeadLetterErrorType,
    DeadLetterV1,
    DriftReason,
    EventBase,
    FinalizeReason,
    HarnessSpec,
    LearnerProgressV1,
    LearnerStepV1,
    Logprobs,
    LossMask,
    MergeBreakRecord,
    MergeStats,
    ModelCallV1,
    NormalizedRequest,
    Resources,
    RewardV1,
    RolloutEventV1,
    RolloutPhase,
    RolloutReason,
    StepDrop,
    StepTrajectory,
    TaskV1,
    TokenIds,
    ToolErrorRecord,
    ToolErrorRule,
    ToolUse,
    TopicOffset,
    TrajectorySample,
    TrajectoryV1,
    VerifierSpec,
    WeightVersionRange,
)

T0 = datetime(2025, 3, 14, 9, 26, 53, 589_793, tzinfo=UTC)


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_936) for _ in range(n)]


def logprobs(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [math.log(rng.random()) for _ in range(n)]


def task() -> TaskV1:
    return TaskV1(
        task_id="swe-astropy-12907",
        run_id="exp42",
        instruction="Fix the separability matrix for nested CompoundModels and add a regression test.",
        harness=HarnessSpec(
            name="coding-agent",
            launch=ContainerLaunch(
                image="ghcr.io/openforge/harness-coding-agent:1.0.3",
                command=["coding-agent", "--print", "--output-format", "stream-json"],
            ),
            env={"DISABLE_TELEMETRY": "1"},
        ),
        environment_image="ghcr.io/openforge/env-astropy:12907",
        verifier=VerifierSpec(command=["python", "-m", "pytest", "-x", "astropy/modeling"], timeout_s=600),
        group_size=8,
        timeout_s=3600,
        resources=Resources(cpu="2", memory="4Gi"),
        metadata={"dataset": "swe-bench-verified", "difficulty": 0.7, "tags": ["python", "numpy"]},
    )


def model_call(prompt_tokens: int = 1200, completion_tokens: int = 90) -> ModelCallV1:
    first = completion_tokens // 3
    return ModelCallV1(
        rollout_id="rollout-7f3a",
        task_id="swe-astropy-12907",
        call_id="call-0004",
        attempt=1,
        retry_of="call-0003",
        protocol=ApiProtocol.ANTHROPIC_MESSAGES,
        model="qwen3-8b",
        request=NormalizedRequest(
            messages=[
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the separability matrix."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "toolu_01",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_01", "content": "astropy\nsetup.py\n"},
            ],
            tools=[{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            tool_choice="auto",
            sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096, "n": 2, "logprobs": True},
            extra={"chat_template_kwargs": {"enable_thinking": False}},
        ),
        response={
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look at separable.py."}],
            "stop_reason": "end_turn",
        },
        prompt_token_ids=ids(prompt_tokens, seed=1),
        choices=[
            CallChoice(
                index=0,
                completion_token_ids=ids(completion_tokens, seed=2),
                logprobs=logprobs(completion_tokens, seed=3),
                weight_versions=[
                    WeightVersionRange(version="41", start=0, end=first),
                    WeightVersionRange(version="42", start=first, end=completion_tokens),
                ],
                finish_reason="stop",
                stop_reason=151_645,
            ),
            CallChoice(
                index=1,
                completion_token_ids=ids(5, seed=4),
                logprobs=[-0.0, -1e-300, -5e-324, -math.inf, -2.5],
                weight_versions=[WeightVersionRange(version="41", start=0, end=5)],
                finish_reason="length",
            ),
        ],
        usage=CallUsage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens + 5, cached_prompt_tokens=1024
        ),
        timings=CallTimings(started_at=T0, time_to_first_token_s=0.081, total_s=2.73),
        status=CallStatus.OK,
        upstream_status_code=200,
        upstream_replica="http://vllm-0.vllm:8000",
        streamed=True,
        session_headers={"X-Agent-Session-Id": "5b1e0c2d", "user-agent": "coding-agent/1.0.3"},
    )


def failed_call() -> ModelCallV1:
    return ModelCallV1(
        rollout_id="rollout-7f3a",
        call_id="call-0003",
        protocol=ApiProtocol.OPENAI_RESPONSES,
        model="qwen3-8b",
        request=NormalizedRequest(messages=[{"role": "user", "content": "hi"}]),
        timings=CallTimings(started_at=T0, total_s=30.0),
        status=CallStatus.UPSTREAM_UNREACHABLE,
        error_message="connect to http://vllm-1.vllm:8000 refused",
        streamed=False,
    )


def rollout_event() -> RolloutEventV1:
    return RolloutEventV1(
        rollout_id="rollout-7f3a",
        task_id="swe-astropy-12907",
        run_id="exp42",
        group_index=3,
        group_size=8,
        harness="coding-agent",
        phase=RolloutPhase.FAILED,
        reason=RolloutReason.EVICTED,
        harness_exit_code=137,
        infrastructure_failure=True,
        message="The node was low on resource: memory.",
        backend=Backend.KUBERNETES,
        pod_name="rollout-7f3a-x2k9d",
        namespace="openforge",
    )


def reward() -> RewardV1:
    return RewardV1(
        rollout_id="rollout-7f3a",
        task_id="swe-astropy-12907",
        value=0.75,
        info={"passed": 3, "failed": 1, "tests": ["test_nested", "test_simple"]},
        verifier_id="verifier-exp42",
    )


def trajectory() -> TrajectoryV1:
    # Two merged calls: 6 sampled tokens, 4 tool-result tokens (masked), 5 sampled tokens.
    mask = [1] * 6 + [0] * 4 + [1] * 5
    behaviour = logprobs(6, seed=5) + [0.0] * 4 + logprobs(5, seed=6)
    return TrajectoryV1(
        trajectory_id="traj-rollout-7f3a",
        rollout_id="rollout-7f3a",
        task_id="swe-astropy-12907",
        run_id="exp42",
        group_index=3,
        group_size=8,
        harness="coding-agent",
        reward=0.75,
        phase=RolloutPhase.SUCCEEDED,
        samples=[
            TrajectorySample(
                prompt_ids=ids(300, seed=7),
                completion_ids=ids(15, seed=8),
                loss_mask=LossMask(mask),
                behavior_logprobs=Logprobs(behaviour),
                weight_versions=[
                    WeightVersionRange(version="41", start=0, end=6),
                    WeightVersionRange(version="42", start=10, end=15),
                ],
                call_ids=["call-0001", "call-0002"],
            ),
            TrajectorySample(
                prompt_ids=TokenIds(ids(40, seed=9)),
                completion_ids=TokenIds([11, 12]),
                loss_mask=LossMask([1, 1]),
                behavior_logprobs=Logprobs([-0.1, -0.2]),
                weight_versions=[WeightVersionRange(version="42", start=0, end=2)],
                call_ids=["call-0004"],
            ),
        ],
        merge_stats=MergeStats(calls=4, merged=1, breaks=1, skipped=1),
        merge_breaks=[MergeBreakRecord(call_id="call-0004", sample_index=1, context_tokens=325,
                                       common_prefix_tokens=312, reason=DriftReason.MESSAGE_MOVED)],
        tool_use=ToolUse(tool_calls=3, results=3, errors=1, recovered=1),
        tool_errors=[ToolErrorRecord(tool_call_id="toolu_01", tool_name="Bash", call_id="call-0002",
                                     rule=ToolErrorRule.EXIT_CODE, recovered=True, recovered_by="toolu_02")],
        finalize_reason=FinalizeReason.COMPLETED,
    )


def learner_step() -> LearnerStepV1:
    return LearnerStepV1(
        model="qwen3-8b",
        step=4200,
        version=4200,
        duration_s=31.5,
        trajectories=[
            StepTrajectory(trajectory_id="traj-rollout-7f3a", rollout_id="rollout-7f3a", task_id="swe-astropy-12907",
                           group_index=3, reward=0.75, advantage=0.41, trained_tokens=11, oldest_version=41),
        ],
        dropped=[StepDrop(trajectory_id="traj-rollout-7f3b", rollout_id="rollout-7f3b",
                          task_id="swe-astropy-12907", reason="infrastructure_failure")],
        metrics={"loss": 0.0132, "rollout_corr/kl": 0.0004, "is_weight_max": 1.9},
        importance_weights=[0.8, 0.97, 1.0, 1.02, 1.3],
    )


def checkpoint() -> CheckpointV1:
    return CheckpointV1(
        model="qwen3-8b",
        version=42,
        uri="s3://openforge-checkpoints/exp42/qwen3-8b/v42",
        step=4200,
        consumed_offsets=[
            TopicOffset(topic="exp42.openforge.trajectories.v1", partition=0, offset=1833),
            TopicOffset(topic="exp42.openforge.trajectories.v1", partition=1, offset=1790),
        ],
        metrics={"loss": 0.0132, "reward_mean": 0.61, "staleness_max": 2.0},
    )


def checkpoint_applied() -> CheckpointAppliedV1:
    return CheckpointAppliedV1(
        model="qwen3-8b",
        version=42,
        replica="http://vllm-0.vllm:8000",
        applied_at=T0 + timedelta(seconds=12),
        duration_s=11.4,
        ok=True,
    )


def learner_progress() -> LearnerProgressV1:
    return LearnerProgressV1(
        model="qwen3-8b", version=42, step=420, steps_since_checkpoint=3, pending=17,
        read_offsets=[TopicOffset(topic="exp42.openforge.trajectories.v1", partition=0, offset=1850)],
        max_staleness=4, checkpoint_every=10, groups_per_step=4, min_group_size=2,
    )


def dead_letter() -> DeadLetterV1:
    return DeadLetterV1(
        topic="exp42.openforge.calls.v1",
        partition=1,
        offset=99_321,
        key=b"rollout-\xff\xfe",
        value=b"{not json",
        headers=[("schema", b"model_call"), ("schema-version", b"1"), ("traceparent", None)],
        timestamp_ms=1_741_944_413_589,
        error_type=DeadLetterErrorType.UNDECODABLE,
        reason="value of model_call v1 is not valid UTF-8 JSON: key must be a string",
        consumer_group="exp42.assembler",
    )


def all_examples() -> list[EventBase]:
    """One or more instances of every registered event type."""
    return [
        task(),
        model_call(),
        failed_call(),
        rollout_event(),
        reward(),
        trajectory(),
        checkpoint(),
        checkpoint_applied(),
        learner_progress(),
        dead_letter(),
        learner_step(),
    ]
