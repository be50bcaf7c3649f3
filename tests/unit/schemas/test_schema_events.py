"""Event models: round trips, immutability, keys and the validation rules of each schema."""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from schema_examples import (
    all_examples,
    checkpoint,
    checkpoint_applied,
    dead_letter,
    failed_call,
    model_call,
    reward,
    rollout_event,
    task,
    trajectory,
)

from schemas import (
    CallChoice,
    CallStatus,
    CheckpointAppliedV1,
    CheckpointV1,
    EventBase,
    FinalizeReason,
    FrozenModel,
    ModelCallV1,
    RewardV1,
    RolloutEventV1,
    RolloutPhase,
    TaskV1,
    TrajectorySample,
    TrajectoryV1,
    WeightVersionRange,
    all_events,
    decode,
    encode,
)
from schemas.reward.v1 import REWARD_LIMIT

EXAMPLES = all_examples()


def replace(event: EventBase, **changes: Any) -> dict[str, Any]:
    """The event's fields with some changed, for building invalid variants."""
    return {**dict(event), **changes}


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip_through_kafka_encoding(event: EventBase) -> None:
    value, headers = encode(event)
    back = decode(headers, value)
    assert type(back) is type(event)
    assert back == event
    # Encoding is deterministic, so re-encoding the decoded event gives the same bytes.
    assert encode(back)[0] == value


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_values_are_plain_json(event: EventBase) -> None:
    value, _ = encode(event)
    data = json.loads(value.decode("utf-8"))
    assert isinstance(data, dict)
    assert data["event_id"] == event.event_id
    assert data["created_at"].endswith("Z")


def test_every_example_type_is_covered() -> None:
    assert {type(e) for e in EXAMPLES} == set(all_events())


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_events_are_frozen(event: EventBase) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        event.event_id = "other"


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_extra_fields_are_forbidden(event: EventBase) -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        type(event)(**replace(event, surprise=1))


def test_nested_models_are_frozen_and_closed() -> None:
    choice = model_call().choices[0]
    with pytest.raises(ValidationError, match="frozen"):
        choice.index = 3
    with pytest.raises(ValidationError, match="Extra inputs"):
        CallChoice(**{**dict(choice), "tokens": []})


def _documented_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    pending: list[type[BaseModel]] = list(all_events())
    while pending:
        model = pending.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            pending.extend(
                arg
                for arg in _type_args(field.annotation)
                if isinstance(arg, type) and issubclass(arg, FrozenModel)
            )
    return seen


def _type_args(annotation: Any) -> list[Any]:
    found = [annotation]
    for arg in getattr(annotation, "__args__", ()) or ():
        found.extend(_type_args(arg))
    return found


@pytest.mark.parametrize("model", _documented_models(), ids=lambda m: m.__name__)
def test_every_field_is_documented(model: type[BaseModel]) -> None:
    missing = [name for name, field in model.model_fields.items() if not field.description]
    assert not missing, f"{model.__name__} fields without a docstring: {missing}"


def test_common_fields() -> None:
    first, second = reward(), reward()
    assert first.event_id != second.event_id
    assert len(first.event_id) == 32
    assert first.created_at.tzinfo is not None
    assert first.created_at.utcoffset() == timedelta(0)


def test_created_at_is_normalised_to_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    event = RewardV1(**replace(reward(), created_at=datetime(2025, 1, 1, 12, tzinfo=plus_two)))
    assert event.created_at.utcoffset() == timedelta(0)
    assert event.created_at.hour == 10
    assert json.loads(encode(event)[0])["created_at"] == "2025-01-01T10:00:00Z"


def test_naive_datetimes_are_rejected() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        RewardV1(**replace(reward(), created_at=datetime(2025, 1, 1)))  # noqa: DTZ001
    applied = checkpoint_applied()
    with pytest.raises(ValidationError, match="timezone"):
        CheckpointAppliedV1(**replace(applied, applied_at=datetime(2025, 1, 1)))  # noqa: DTZ001


def test_partition_keys_follow_the_topic_table() -> None:
    assert task().partition_key() == "swe-astropy-12907"
    assert model_call().partition_key() == "rollout-7f3a"
    assert rollout_event().partition_key() == "rollout-7f3a"
    assert reward().partition_key() == "rollout-7f3a"
    assert trajectory().partition_key() == "swe-astropy-12907"
    assert checkpoint().partition_key() == "qwen3-8b"
    # Applied notices get their own compacted slot per replica (see the checkpoint module).
    assert checkpoint_applied().partition_key() == "qwen3-8b@http://vllm-0.vllm:8000"
    assert model_call().kafka_key() == b"rollout-7f3a"


def test_dead_letter_keeps_the_original_key_bytes() -> None:
    letter = dead_letter()
    assert letter.kafka_key() == b"rollout-\xff\xfe"
    assert letter.partition_key() == "rollout-\ufffd\ufffd"
    keyless = type(letter)(**replace(letter, key=None))
    assert keyless.kafka_key() is None
    assert keyless.partition_key() == ""
    data = json.loads(encode(letter)[0])
    assert data["headers"][2] == ["traceparent", None]
    assert data["error_type"] == "undecodable"


# -- model calls --------------------------------------------------------------------------------


def test_logprob_length_mismatch_names_both_lengths() -> None:
    with pytest.raises(ValidationError, match="logprobs has 2 values but completion_token_ids has 3 tokens"):
        CallChoice(index=0, completion_token_ids=[1, 2, 3], logprobs=[-0.1, -0.2])


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(0, 2), (3, 4)], "ranges must cover every token without gaps"),
        ([(0, 3)], "end at token 3 but there are 4 tokens"),
        ([(0, 5)], "reach token 5 but there are only 4 tokens"),
        ([(0, 3), (2, 4)], "overlaps or precedes the previous range ending at 3"),
        ([(1, 4)], "starts at 1"),
    ],
)
def test_call_weight_versions_must_cover_the_completion(ranges: list[tuple[int, int]], message: str) -> None:
    versions = [WeightVersionRange(version="1", start=a, end=b) for a, b in ranges]
    with pytest.raises(ValidationError, match=message):
        CallChoice(index=0, completion_token_ids=[1, 2, 3, 4], logprobs=[0.0] * 4, weight_versions=versions)


def test_weight_version_range_must_be_non_empty() -> None:
    with pytest.raises(ValidationError, match="non-empty"):
        WeightVersionRange(version="1", start=3, end=3)
    assert WeightVersionRange(version="12", start=0, end=1).version_number == 12
    assert WeightVersionRange(version="base", start=0, end=1).version_number is None


def test_unknown_versions_may_be_empty() -> None:
    choice = CallChoice(index=0, completion_token_ids=[1], logprobs=[-1.0])
    assert choice.weight_versions == []


def test_retry_fields_are_consistent() -> None:
    call = model_call()
    with pytest.raises(ValidationError, match="retry_of must be set exactly when attempt > 0"):
        ModelCallV1(**replace(call, retry_of=None))
    with pytest.raises(ValidationError, match="retry_of must be set exactly when attempt > 0"):
        ModelCallV1(**replace(call, attempt=0))
    with pytest.raises(ValidationError, match="cannot be a retry of itself"):
        ModelCallV1(**replace(call, retry_of=call.call_id))


def test_ok_calls_have_choices_and_no_error() -> None:
    call = model_call()
    with pytest.raises(ValidationError, match="at least one choice"):
        ModelCallV1(**replace(call, choices=[]))
    with pytest.raises(ValidationError, match="must not have an error_message"):
        ModelCallV1(**replace(call, error_message="boom"))
    assert failed_call().status is CallStatus.UPSTREAM_UNREACHABLE
    assert failed_call().first_choice is None


def test_choice_indexes_are_unique() -> None:
    call = model_call()
    with pytest.raises(ValidationError, match="choice indexes must be unique"):
        ModelCallV1(**replace(call, choices=[call.choices[0], call.choices[0]]))
    assert call.first_choice == call.choices[0]


def test_session_headers_are_lowercased_and_never_credentials() -> None:
    call = model_call()
    assert call.session_headers["x-agent-session-id"] == "5b1e0c2d"
    with pytest.raises(ValidationError, match="must not carry credentials; found authorization"):
        ModelCallV1(**replace(call, session_headers={"Authorization": "Bearer sk-secret"}))
    with pytest.raises(ValidationError, match="x-api-key"):
        ModelCallV1(**replace(call, session_headers={"X-Api-Key": "sk-secret"}))


def test_prompt_token_ids_reject_negative_ids_with_location() -> None:
    with pytest.raises(ValidationError) as info:
        ModelCallV1(**replace(model_call(), prompt_token_ids=[1, -5]))
    error = info.value.errors()[0]
    assert error["loc"] == ("prompt_token_ids",)
    assert "token id -5 at index 1 is negative" in error["msg"]


# -- rollouts, rewards, tasks ---------------------------------------------------------------------


def test_rollout_terminal_phases() -> None:
    assert {p for p in RolloutPhase if p.is_terminal} == {
        RolloutPhase.SUCCEEDED,
        RolloutPhase.FAILED,
        RolloutPhase.TIMED_OUT,
        RolloutPhase.CANCELLED,
    }
    assert rollout_event().is_terminal
    running = RolloutEventV1(
        **replace(rollout_event(), phase=RolloutPhase.RUNNING, infrastructure_failure=False, reason=None)
    )
    assert not running.is_terminal


def test_infrastructure_failure_only_on_failed_rollouts() -> None:
    with pytest.raises(ValidationError, match="infrastructure_failure applies only"):
        RolloutEventV1(**replace(rollout_event(), phase=RolloutPhase.SUCCEEDED))


def test_group_index_within_group() -> None:
    with pytest.raises(ValidationError, match="group_index 8 is outside a group of size 8"):
        RolloutEventV1(**replace(rollout_event(), group_index=8))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_rewards_must_be_finite(value: float) -> None:
    with pytest.raises(ValidationError, match="finite"):
        RewardV1(**replace(reward(), value=value))


@pytest.mark.parametrize("value", [1e39, -1e39, 1.5e9, sys.float_info.max])
def test_rewards_past_the_limit_are_refused(value: float) -> None:
    """Finite in float64, infinite (or past squaring) in the learner's float32: NaN advantages."""
    with pytest.raises(ValidationError, match="less than or equal|greater than or equal"):
        RewardV1(**replace(reward(), value=value))
    assert RewardV1(**replace(reward(), value=math.copysign(REWARD_LIMIT, value))).value == math.copysign(1e9, value)


def test_reward_from_json_rejects_non_finite_spellings() -> None:
    data = json.loads(encode(reward())[0])
    data["value"] = "NaN"
    with pytest.raises(ValidationError, match="finite"):
        RewardV1.model_validate_json(json.dumps(data))


def test_task_validation() -> None:
    base = task()
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        TaskV1(**replace(base, group_size=0))
    with pytest.raises(ValidationError, match="pattern"):
        TaskV1(**replace(base, resources={"memory": "4 GB"}))
    with pytest.raises(ValidationError):
        TaskV1(**replace(base, harness={"name": "x", "launch": {"kind": "vm", "command": ["a"]}}))
    local = TaskV1(
        **replace(base, harness={"name": "toy", "launch": {"kind": "local", "command": ["toy-agent"]}})
    )
    assert local.harness.launch.kind == "local"


# -- trajectories -----------------------------------------------------------------------------------


def test_trajectory_sample_alignment() -> None:
    sample = trajectory().samples[0]
    assert sample.trained_tokens == 11
    with pytest.raises(ValidationError, match="loss_mask has 14 values but completion_ids has 15 tokens"):
        TrajectorySample(**{**dict(sample), "loss_mask": sample.loss_mask[:-1]})
    with pytest.raises(
        ValidationError, match="behavior_logprobs has 16 values but completion_ids has 15 tokens"
    ):
        TrajectorySample(**{**dict(sample), "behavior_logprobs": [*sample.behavior_logprobs, 0.0]})


def test_trained_tokens_need_a_weight_version() -> None:
    sample = trajectory().samples[0]
    only_first = [WeightVersionRange(version="41", start=0, end=6)]
    with pytest.raises(ValidationError, match=r"trained tokens in \[6, 15\) have no weight version"):
        TrajectorySample(**{**dict(sample), "weight_versions": only_first})
    # Without any version information the sample is still valid (versions unknown).
    assert TrajectorySample(**{**dict(sample), "weight_versions": []}).weight_versions == []


def test_completed_trajectory_needs_a_reward() -> None:
    with pytest.raises(ValidationError, match="must have a reward"):
        TrajectoryV1(**replace(trajectory(), reward=None))
    no_reward = TrajectoryV1(
        **replace(trajectory(), reward=None, finalize_reason=FinalizeReason.REWARD_TIMEOUT, samples=[])
    )
    assert no_reward.reward is None


# -- checkpoints ------------------------------------------------------------------------------------


def test_checkpoint_offsets_are_unique_per_partition() -> None:
    base = checkpoint()
    twice = [*base.consumed_offsets, base.consumed_offsets[0]]
    with pytest.raises(ValidationError, match=r"lists exp42.openforge.trajectories.v1\[0\] more than once"):
        CheckpointV1(**replace(base, consumed_offsets=twice))


def test_checkpoint_metrics_must_be_finite() -> None:
    with pytest.raises(ValidationError, match="finite"):
        CheckpointV1(**replace(checkpoint(), metrics={"loss": math.nan}))


def test_applied_error_iff_not_ok() -> None:
    base = checkpoint_applied()
    with pytest.raises(ValidationError, match="error must be set exactly when ok is false"):
        CheckpointAppliedV1(**replace(base, ok=False))
    with pytest.raises(ValidationError, match="error must be set exactly when ok is false"):
        CheckpointAppliedV1(**replace(base, error="oops"))
    failed = CheckpointAppliedV1(**replace(base, ok=False, error="safetensors header mismatch"))
    assert not failed.ok
