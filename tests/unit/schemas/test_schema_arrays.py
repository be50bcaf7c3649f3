"""Packed arrays: exactness, sequence behaviour, validation messages, size."""

from __future__ import annotations

import copy
import json
import math
import pickle
import random
import struct
import sys
from array import array

import pytest
from pydantic import BaseModel, ValidationError
from schema_examples import model_call

from schemas import Logprobs, LossMask, RawBytes, TokenIds, decode, encode


class Holder(BaseModel):
    ids: TokenIds = TokenIds()
    lps: Logprobs = Logprobs()
    mask: LossMask = LossMask()
    raw: RawBytes = b""


EDGE_FLOATS = [
    -math.inf,
    math.inf,
    math.nan,
    -0.0,
    0.0,
    5e-324,  # smallest subnormal
    -5e-324,
    2.2250738585072014e-308,  # smallest normal
    1.7976931348623157e308,
    -1e-300,
    -0.6931471805599453,
    -9999.0,
]


def packed_le(fmt: str, values: list[float] | list[int]) -> bytes:
    return struct.pack(f"<{len(values)}{fmt}", *values)


def test_token_ids_pack_little_endian_int32() -> None:
    values = [0, 1, 255, 256, 151_935, 2**31 - 1]
    arr = TokenIds(values)
    assert arr.to_bytes() == packed_le("i", values)
    assert TokenIds.from_bytes(arr.to_bytes()) == arr
    assert TokenIds.from_base64(arr.to_base64()) == arr
    assert arr.tolist() == values


def test_logprob_edge_values_round_trip_bit_exact_through_json() -> None:
    lps = Logprobs(EDGE_FLOATS)
    assert lps.to_bytes() == packed_le("d", EDGE_FLOATS)
    back = Holder.model_validate_json(Holder(lps=lps).model_dump_json()).lps
    assert back.to_bytes() == lps.to_bytes()
    assert back == lps  # same kind compares bytes, so NaN equals itself
    assert math.isnan(back[2])
    assert math.copysign(1.0, back[3]) == -1.0
    assert back[5] == 5e-324


def test_nan_payload_is_preserved() -> None:
    payload_nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    lps = Logprobs([payload_nan])
    back = Holder.model_validate_json(Holder(lps=lps).model_dump_json()).lps
    assert back.to_bytes() == b"\x01\x00\x00\x00\x00\x00\xf8\x7f"


def test_logprobs_from_json_number_lists_are_exact() -> None:
    # vLLM returns logprobs as JSON numbers; the shortest repr round-trips to the same double.
    rng = random.Random(7)
    values = [math.log(rng.random()) for _ in range(2000)] + [-1e-310, -0.0]
    parsed = Holder.model_validate_json(json.dumps({"lps": values})).lps
    assert parsed.to_bytes() == packed_le("d", values)


def test_negative_zero_differs_from_zero_as_a_record() -> None:
    assert Logprobs([-0.0]) != Logprobs([0.0])
    assert Logprobs([-0.0]) == [0.0]  # plain sequences compare by value


def test_json_form_is_a_standard_base64_string() -> None:
    data = json.loads(Holder(ids=[1, 2], mask=[0, 1], raw=b"\xfb\xff").model_dump_json())
    assert data["ids"] == "AQAAAAIAAAA="
    assert data["mask"] == "AAE="
    assert data["raw"] == "+/8="  # standard alphabet, not URL-safe


def test_python_dump_keeps_instances() -> None:
    holder = Holder(ids=[1, 2, 3])
    assert isinstance(holder.model_dump()["ids"], TokenIds)
    assert Holder.model_validate(holder.model_dump()) == holder


def test_sequence_behaviour() -> None:
    arr = TokenIds(range(10))
    assert len(arr) == 10
    assert arr[0] == 0
    assert arr[-1] == 9
    assert list(arr) == list(range(10))
    assert arr[2:5] == TokenIds([2, 3, 4])
    assert isinstance(arr[2:5], TokenIds)
    assert arr[::3] == [0, 3, 6, 9]
    assert arr[5:2] == []
    assert 7 in arr
    assert 11 not in arr
    assert arr.index(4) == 4
    assert arr == list(range(10))
    assert arr == tuple(range(10))
    assert arr != TokenIds(range(9))
    assert arr != LossMask([0, 1])
    assert bool(TokenIds()) is False
    assert hash(arr) == hash(TokenIds(range(10)))
    assert arr.nbytes == 40
    assert "len=10" in repr(arr)
    assert repr(TokenIds([1, 2])) == "TokenIds([1, 2])"
    with pytest.raises(IndexError):
        arr[10]


def test_immutable_and_copyable() -> None:
    arr = TokenIds([1, 2, 3])
    with pytest.raises(TypeError):
        arr[0] = 5  # type: ignore[index]
    with pytest.raises(AttributeError):
        arr.foo = 1  # type: ignore[attr-defined]
    assert copy.deepcopy(arr) is arr
    assert pickle.loads(pickle.dumps(arr)) == arr


def test_concat_joins_without_unpacking() -> None:
    joined = TokenIds.concat([TokenIds([1, 2]), TokenIds([]), TokenIds([3])])
    assert joined == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot concatenate"):
        TokenIds.concat([TokenIds([1]), LossMask([1])])  # type: ignore[list-item]


def test_accepts_array_and_tuple_inputs() -> None:
    assert Holder(ids=array("i", [1, 2])).ids == [1, 2]
    assert Holder(ids=(1, 2)).ids == [1, 2]
    assert Holder(lps=[1, -2]).lps == [1.0, -2.0]


@pytest.mark.parametrize("values", [
    [], [0], [2**31 - 1, 0, 1, 150_000], (5, 6, 7), [True, False, 3], list(range(0, 2**31 - 1, 2**31 // 977)),
])
def test_lists_and_tuples_pack_as_array_packs_them(values: list[int]) -> None:
    # Lists and tuples take a faster path (struct) than other iterables (array); same bytes.
    expected = array("i", values)
    if sys.byteorder != "little":
        expected.byteswap()
    assert TokenIds(values).to_bytes() == expected.tobytes() == TokenIds(iter(values)).to_bytes()
    floats = [float(v) / 7 for v in values]
    assert Logprobs(floats).to_bytes() == Logprobs(iter(floats)).to_bytes()
    assert LossMask([v & 1 for v in values]).to_bytes() == LossMask(iter([v & 1 for v in values])).to_bytes()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([-1], "token id -1 at index 0 is negative"),
        ([5, 2**31], "token id 2147483648 at index 1 is out of int32 range"),
        ([1, -(2**40)], "at index 1"),
        ([1.5], "every item must be a non-negative int32"),
        (["7"], "every item must be a non-negative int32"),
        ("AAAAAAA=", "base64 decodes to 5 bytes, which is not a whole number of 4-byte int32 items"),
        ("not base64!", "not valid base64"),
        ("/////w==", "token id -1 at index 0 is negative"),
        (b"\x00\x00\x00\x00", "expects a base64 string or a list of numbers, got bytes"),
        (Logprobs([1.0]), "got Logprobs"),
        ({"a": 1}, "got dict"),
    ],
)
def test_token_id_validation_errors(value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Holder(ids=value)


def test_constructor_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="negative"):
        TokenIds([3, -2])
    with pytest.raises(ValueError, match="not a whole number of 8-byte float64 items"):
        Logprobs.from_bytes(b"\x00" * 12)
    with pytest.raises(ValueError, match="use from_bytes"):
        TokenIds(b"\x01\x00\x00\x00")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value 2 at index 1 is not 0 or 1"):
        LossMask([1, 2])


def test_loss_mask() -> None:
    mask = LossMask([1, 1, 0, 0, 1])
    assert mask.count_trained() == 3
    assert mask.to_bytes() == b"\x01\x01\x00\x00\x01"
    with pytest.raises(ValidationError, match="not 0 or 1"):
        Holder(mask="AgA=")  # bytes 2, 0


def test_raw_bytes() -> None:
    raw = b"\x00\xffkey\x80"
    holder = Holder(raw=raw)
    assert holder.raw == raw
    assert Holder.model_validate_json(holder.model_dump_json()).raw == raw
    assert Holder(raw=bytearray(b"ab")).raw == b"ab"
    with pytest.raises(ValidationError, match="not valid base64"):
        Holder(raw="***")
    with pytest.raises(ValidationError, match="expected bytes or a base64 string"):
        Holder(raw=12)


def test_json_schema_describes_packed_arrays_as_base64() -> None:
    props = Holder.model_json_schema()["properties"]
    for name, dtype in (("ids", "<i4"), ("lps", "<f8"), ("mask", "|u1")):
        assert props[name]["type"] == "string"
        assert props[name]["contentEncoding"] == "base64"
        assert props[name]["x-packed-dtype"] == dtype
        assert "base64" in props[name]["description"]


def test_100k_token_prompt_event_is_compact_and_exact() -> None:
    call = model_call(prompt_tokens=100_000, completion_tokens=2_000)
    value, headers = encode(call)
    # Packed: 400 kB of ids -> ~533 kB of base64. As JSON numbers it would be ~700 kB, and
    # the per-element validation would dominate decoding.
    assert len(value) < 700 * 1024
    back = decode(headers, value)
    assert back == call
    assert isinstance(back, type(call))
    assert back.prompt_token_ids.to_bytes() == call.prompt_token_ids.to_bytes()
    assert len(back.prompt_token_ids) == 100_000
