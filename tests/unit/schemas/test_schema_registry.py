"""The event registry, and decoding failures with their dead-letter kinds."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from schema_examples import model_call, reward, task

from schemas import (
    CONTENT_TYPE_HEADER,
    SCHEMA_HEADER,
    VERSION_HEADER,
    CheckpointAppliedV1,
    CheckpointV1,
    DeadLetterErrorType,
    DeadLetterV1,
    DecodeError,
    DuplicateSchemaError,
    EventBase,
    EventRegistry,
    InvalidEventError,
    LearnerProgressV1,
    LearnerStepV1,
    MissingSchemaHeaderError,
    ModelCallV1,
    RewardV1,
    RolloutEventV1,
    TaskV1,
    TrajectoryV1,
    UndecodableEventError,
    UnknownSchemaError,
    UnregisteredEventError,
    all_events,
    decode,
    encode,
    register,
    resolve,
)


class PingV1(EventBase):
    """A throwaway event for registry tests."""

    SCHEMA: ClassVar[str] = "ping"
    VERSION: ClassVar[int] = 1

    target: str
    """Who is pinged."""

    def partition_key(self) -> str:
        return self.target


class OtherPingV1(PingV1):
    """A different class claiming the same schema key."""


class PingV2(PingV1):
    """Version 2 of the throwaway event."""

    VERSION: ClassVar[int] = 2


def test_builtin_events_are_registered() -> None:
    assert set(all_events()) == {
        TaskV1,
        ModelCallV1,
        RolloutEventV1,
        RewardV1,
        TrajectoryV1,
        CheckpointV1,
        CheckpointAppliedV1,
        LearnerProgressV1,
        DeadLetterV1,
        LearnerStepV1,
    }
    assert resolve("model_call", 1) is ModelCallV1
    names = [(cls.SCHEMA, cls.VERSION) for cls in all_events()]
    assert names == sorted(names)


def test_register_same_class_twice_is_a_no_op() -> None:
    registry = EventRegistry()
    assert registry.register(PingV1) is PingV1
    assert registry.register(PingV1) is PingV1
    assert registry.all_events() == (PingV1,)


def test_register_different_class_under_taken_key_raises() -> None:
    registry = EventRegistry()
    registry.register(PingV1)
    with pytest.raises(DuplicateSchemaError, match=r"'ping' version 1 is already registered to .*PingV1"):
        registry.register(OtherPingV1)
    assert registry.resolve("ping", 1) is PingV1


def test_default_registry_refuses_to_replace_a_builtin() -> None:
    class FakeRewardV1(RewardV1):
        """Impostor."""

    with pytest.raises(DuplicateSchemaError):
        register(FakeRewardV1)
    assert resolve("reward", 1) is RewardV1


def test_register_rejects_incomplete_classes() -> None:
    registry = EventRegistry()

    class NoKeyV1(EventBase):
        """No partition key."""

        SCHEMA: ClassVar[str] = "no_key"
        VERSION: ClassVar[int] = 1

    class BadNameV1(PingV1):
        """Bad schema name."""

        SCHEMA: ClassVar[str] = "Bad Name"

    with pytest.raises(TypeError, match="must implement partition_key"):
        registry.register(NoKeyV1)
    with pytest.raises(TypeError, match="snake_case"):
        registry.register(BadNameV1)
    with pytest.raises(TypeError, match="not an EventBase subclass"):
        registry.register(dict)  # type: ignore[type-var]


def test_unknown_schema_lists_known_versions() -> None:
    registry = EventRegistry()
    registry.register(PingV1)
    registry.register(PingV2)
    with pytest.raises(
        UnknownSchemaError, match="unknown schema 'ping' version 3; known versions of 'ping': 1, 2"
    ):
        registry.resolve("ping", 3)
    with pytest.raises(UnknownSchemaError, match="no version of 'pong' is registered") as info:
        registry.resolve("pong", 1)
    assert info.value.kind is DeadLetterErrorType.UNKNOWN_SCHEMA


def test_separate_registries_decode_only_what_they_know() -> None:
    registry = EventRegistry()
    registry.register(PingV1)
    value, headers = registry.encode(PingV1(target="a"))
    assert registry.decode(headers, value) == PingV1.model_validate_json(value)
    with pytest.raises(UnknownSchemaError):
        decode(headers, value)  # the default registry never heard of "ping"
    with pytest.raises(UnregisteredEventError, match="PingV1 is not registered"):
        encode(PingV1(target="a"))


def test_encode_headers() -> None:
    value, headers = encode(reward())
    assert headers == [
        (SCHEMA_HEADER, b"reward"),
        (VERSION_HEADER, b"1"),
        (CONTENT_TYPE_HEADER, b"application/json"),
    ]
    assert (SCHEMA_HEADER, VERSION_HEADER, CONTENT_TYPE_HEADER) == (
        "schema",
        "schema-version",
        "content-type",
    )
    headers.append(("traceparent", b"00-abc-def-01"))
    assert encode(reward())[1][-1][0] == CONTENT_TYPE_HEADER  # callers get a fresh list each time
    assert json.loads(value)["value"] == 0.75


def test_decode_accepts_mappings_and_ignores_other_headers() -> None:
    event = reward()
    value, headers = encode(event)
    with_trace = [("traceparent", b"00-4bf92f-00f067-01"), *headers, ("baggage", None)]
    assert decode(with_trace, value) == event
    assert decode(dict(headers), value) == event
    assert decode(tuple(headers), value) == event


def test_headers_decide_the_class_not_the_payload() -> None:
    value, _ = encode(reward())
    # The same bytes under another schema are validated as that schema, never as a "reward".
    with pytest.raises(InvalidEventError, match="invalid task v1 event"):
        decode([(SCHEMA_HEADER, b"task"), (VERSION_HEADER, b"1")], value)


def test_last_copy_of_a_repeated_header_wins() -> None:
    value, headers = encode(reward())
    repeated = [(SCHEMA_HEADER, b"task"), *headers]
    assert isinstance(decode(repeated, value), RewardV1)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([], "no 'schema' header"),
        ([(SCHEMA_HEADER, b"reward")], "no 'schema-version' header"),
        ([(SCHEMA_HEADER, b"reward"), (VERSION_HEADER, None)], "no 'schema-version' header"),
        ([(SCHEMA_HEADER, b""), (VERSION_HEADER, b"1")], "no 'schema' header"),
        ([(SCHEMA_HEADER, b"reward"), (VERSION_HEADER, b"v1")], "not a decimal version number"),
        ([(SCHEMA_HEADER, b"reward"), (VERSION_HEADER, b"-1")], "not a decimal version number"),
        ([(SCHEMA_HEADER, b"\xff"), (VERSION_HEADER, b"1")], "not UTF-8"),
    ],
)
def test_missing_or_malformed_schema_headers(headers: list[tuple[str, bytes | None]], message: str) -> None:
    value, _ = encode(reward())
    with pytest.raises(MissingSchemaHeaderError, match=message) as info:
        decode(headers, value)
    assert info.value.kind is DeadLetterErrorType.MISSING_SCHEMA


def test_unknown_schema_version() -> None:
    value, _ = encode(reward())
    with pytest.raises(UnknownSchemaError, match="known versions of 'reward': 1") as info:
        decode([(SCHEMA_HEADER, b"reward"), (VERSION_HEADER, b"7")], value)
    assert info.value.kind is DeadLetterErrorType.UNKNOWN_SCHEMA
    assert info.value.known_versions == (1,)


REWARD_HEADERS = [(SCHEMA_HEADER, b"reward"), (VERSION_HEADER, b"1")]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"{not json", "not valid UTF-8 JSON"),
        (b"", "no value"),
        (b'{"rollout_id": "r\xff\xfe", "value": 1.0, "verifier_id": "v"}', "not valid UTF-8 JSON"),
        (b"\xef\xbb\xbf\x00\x01", "not valid UTF-8 JSON"),
        (None, "no value"),
    ],
)
def test_undecodable_values(value: bytes | None, message: str) -> None:
    with pytest.raises(UndecodableEventError, match=message) as info:
        decode(REWARD_HEADERS, value)
    assert info.value.kind is DeadLetterErrorType.UNDECODABLE


def test_other_content_types_are_undecodable() -> None:
    value, _ = encode(reward())
    with pytest.raises(UndecodableEventError, match="is not application/json"):
        decode([*REWARD_HEADERS, (CONTENT_TYPE_HEADER, b"application/x-protobuf")], value)
    assert decode([*REWARD_HEADERS, (CONTENT_TYPE_HEADER, b"Application/JSON; charset=utf-8")], value)


def test_invalid_event_reason_is_compact() -> None:
    data = json.loads(encode(model_call())[0])
    data["choices"][0]["logprobs"] = data["choices"][1]["logprobs"]  # 5 logprobs for 90 tokens
    data["attempt"] = -1
    data["bogus"] = True
    with pytest.raises(InvalidEventError) as info:
        decode([(SCHEMA_HEADER, b"model_call"), (VERSION_HEADER, b"1")], json.dumps(data).encode())
    error = info.value
    assert error.kind is DeadLetterErrorType.INVALID_EVENT
    assert error.error_count == 3
    assert error.reason.startswith("invalid model_call v1 event (3 errors): ")
    assert "attempt: Input should be greater than or equal to 0" in error.reason
    assert (
        "choices[0]: choice 0: logprobs has 5 values but completion_token_ids has 90 tokens" in error.reason
    )
    assert "bogus: Extra inputs are not permitted" in error.reason
    assert str(error) == error.reason
    assert len(error.reason) < 600


def test_invalid_event_reason_is_bounded_for_many_errors() -> None:
    data = {f"x{i}": "y" * 10_000 for i in range(50)}
    with pytest.raises(InvalidEventError) as info:
        decode(REWARD_HEADERS, json.dumps(data).encode())
    assert info.value.error_count > 50
    assert "more" in info.value.reason
    assert len(info.value.reason) < 2000


def test_a_json_array_is_an_invalid_event() -> None:
    with pytest.raises(InvalidEventError, match="invalid reward v1 event"):
        decode(REWARD_HEADERS, b"[1, 2]")


def test_every_decode_error_is_a_decode_error_with_a_dead_letter_kind() -> None:
    for cls in (MissingSchemaHeaderError, UnknownSchemaError, UndecodableEventError, InvalidEventError):
        assert issubclass(cls, DecodeError)
        assert isinstance(cls.kind, DeadLetterErrorType)


def test_task_round_trip_keeps_nested_union() -> None:
    event = task()
    value, headers = encode(event)
    back = decode(headers, value)
    assert isinstance(back, TaskV1)
    assert back.harness.launch == event.harness.launch


def test_100k_token_call_round_trips_exactly() -> None:
    call = model_call(prompt_tokens=100_000, completion_tokens=8_000)
    value, headers = encode(call)
    back = decode(headers, value)
    assert isinstance(back, ModelCallV1)
    assert back == call
    assert back.prompt_token_ids.to_bytes() == call.prompt_token_ids.to_bytes()
    assert back.choices[0].logprobs.to_bytes() == call.choices[0].logprobs.to_bytes()
    assert back.choices[1].logprobs.to_bytes() == call.choices[1].logprobs.to_bytes()


def test_huge_integers_in_free_form_json_still_encode() -> None:
    # orjson stops at 64-bit integers; encode falls back to pydantic's serializer for those.
    event = TaskV1(**{**dict(task()), "metadata": {"seed": 2**70, "note": "ünïcode ✓"}})
    value, headers = encode(event)
    assert json.loads(value)["metadata"] == {"seed": 2**70, "note": "ünïcode ✓"}
    assert decode(headers, value) == event


def test_a_call_nested_deeper_than_pydantics_json_parser_reads_still_decodes_exactly() -> None:
    # The proxy serves what orjson can write (up to 254 levels); pydantic's JSON parser stops at
    # 200. Such a call's event is read, not dead-lettered.
    nested: object = "deep"
    for _ in range(240):
        nested = [nested]
    call = model_call()
    call = call.model_copy(update={"request": call.request.model_copy(update={"extra": {"schema": nested}})})
    value, headers = encode(call)
    back = decode(headers, value)
    assert back == call
    assert back.prompt_token_ids.to_bytes() == call.prompt_token_ids.to_bytes()
    deeper = value.replace(b'"deep"', b"[" * 800 + b'"deep"' + b"]" * 800)  # past orjson's limit too
    with pytest.raises(UndecodableEventError, match="recursion limit"):
        decode(headers, deeper)
    invalid = value.replace(b'"rollout_id":"', b'"rollout_id":7,"was":"', 1)  # deep and invalid
    with pytest.raises(InvalidEventError, match="rollout_id"):
        decode(headers, invalid)
