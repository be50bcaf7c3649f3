"""JSON Schema export: coverage, packed-array description, and self-validation of examples."""

from __future__ import annotations

import json

import jsonschema
import pytest
from schema_examples import all_examples

from schemas import EventBase, all_events, encode, json_schemas, schema_file_name


def test_one_schema_per_registered_event() -> None:
    schemas = json_schemas()
    assert set(schemas) == {schema_file_name(cls) for cls in all_events()}
    assert "model_call.v1.schema.json" in schemas
    assert "checkpoint_applied.v1.schema.json" in schemas
    for name, schema in schemas.items():
        assert schema["$id"] == name
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False
        assert schema["description"]
        json.dumps(schema)  # plain JSON, writable as is


def test_packed_arrays_appear_as_described_base64_strings() -> None:
    schema = json_schemas()["model_call.v1.schema.json"]
    prompt = schema["properties"]["prompt_token_ids"]
    assert prompt["type"] == "string"
    assert prompt["contentEncoding"] == "base64"
    assert prompt["x-packed-dtype"] == "<i4"
    assert "Token ids of the prompt" in prompt["description"]
    assert "little-endian" in prompt["$comment"]
    choice = schema["$defs"]["CallChoice"]["properties"]
    assert choice["logprobs"]["x-packed-dtype"] == "<f8"
    assert "base64" in choice["logprobs"]["$comment"]
    sample = json_schemas()["trajectory.v1.schema.json"]["$defs"]["TrajectorySample"]["properties"]
    assert sample["loss_mask"]["x-packed-dtype"] == "|u1"


@pytest.mark.parametrize("event", all_examples(), ids=lambda e: type(e).__name__)
def test_examples_validate_against_their_schema(event: EventBase) -> None:
    schema = json_schemas()[schema_file_name(type(event))]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    instance = json.loads(encode(event)[0])
    validator.validate(instance)
    instance["unexpected"] = 1
    assert not validator.is_valid(instance)
