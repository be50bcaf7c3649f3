"""The proxy cuts the prompt's ids out of the engine's JSON unparsed, and the event still carries them exactly."""

from __future__ import annotations

import orjson
import pytest
from test_capture_build import _capture, _choice, _whole
from test_raw_calls import REGISTRY, _finite

from producers.capture import cut_prompt_ids
from producers.raw_calls import pack_raw_call, ship_record
from schemas import ModelCallV1, decode
from schemas.call.v1 import CallStatus

IDS = [0, 7, 151_000, 2**31 - 1, 42]


def test_the_ids_are_cut_and_the_rest_parses_as_before() -> None:
    answer = orjson.dumps(_whole([_finite(_choice())], prompt_token_ids=IDS))
    rest, ids = cut_prompt_ids(answer)
    assert ids == orjson.dumps(IDS) and orjson.loads(ids) == IDS
    parsed = orjson.loads(rest)
    assert parsed["prompt_token_ids"] is None
    assert {k: v for k, v in parsed.items() if k != "prompt_token_ids"} == {
        k: v for k, v in orjson.loads(answer).items() if k != "prompt_token_ids"}
    assert cut_prompt_ids(orjson.dumps({"prompt_token_ids": []})) == (b'{"prompt_token_ids":null}', b"[]")
    assert cut_prompt_ids(b'{"prompt_token_ids":[0,10,0,101,0]}')[1] == b"[0,10,0,101,0]"  # the id 0 is fine


@pytest.mark.parametrize("body", [
    b'{"id":"x","prompt_token_ids":null}',  # not sent
    b'{"prompt_token_ids": [1,2]}',  # not as vLLM writes it: left to the parser
    b'{"prompt_token_ids":[1, 2]}',
    b'{"prompt_token_ids":[1,-2]}',
    b'{"prompt_token_ids":[1,,2]}',
    b'{"prompt_token_ids":[,1]}',
    b'{"prompt_token_ids":[1,]}',
    b'{"prompt_token_ids":[1.5]}',
    b'{"prompt_token_ids":[[1]]}',
    b'{"prompt_token_ids":[01,2]}',  # leading zeros are not JSON: the parser says so, as before
    b'{"prompt_token_ids":[1,2,007]}',
    b'{"prompt_token_ids":[1,2',  # truncated
    # Model text quoting the key: inside a JSON string every quote is escaped.
    orjson.dumps({"choices": [{"message": {"content": '"prompt_token_ids":[1,2]'}}], "prompt_token_ids": None}),
])
def test_anything_else_is_left_whole(body: bytes) -> None:
    assert cut_prompt_ids(body) == (body, None)


def test_ids_held_unparsed_are_counted_parsed_on_demand_and_journalled_exactly() -> None:
    answer = orjson.dumps(_whole([_finite(_choice())], prompt_token_ids=IDS))
    rest, ids = cut_prompt_ids(answer)
    capture = _capture()
    capture.prompt_ids_json = ids
    capture.on_response(orjson.loads(rest))
    assert capture.prompt_token_count == len(IDS) and capture.prompt_ids_json == ids  # counted, not parsed
    topic, key, value, headers = pack_raw_call(capture, CallStatus.OK, upstream_status_code=200)
    assert capture.prompt_ids_json == ids  # journalled as the engine's JSON, still not parsed
    event = decode(list(ship_record(REGISTRY, topic, key, value, headers, seq=1)[3]),
                   ship_record(REGISTRY, topic, key, value, headers, seq=1)[2])
    assert isinstance(event, ModelCallV1) and list(event.prompt_token_ids) == IDS
    # Built from the capture itself: parsed when needed.
    assert list(capture.build(CallStatus.OK).prompt_token_ids) == IDS and capture.prompt_ids_json is None
    assert capture.prompt_token_ids == IDS and capture.prompt_token_count == len(IDS)
