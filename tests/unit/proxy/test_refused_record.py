"""A refused request's record: the body the harness sent, cut so that its event fits the calls topic."""

from __future__ import annotations

import orjson

from proxy.service import _CUT_KEY, _REFUSED_TOTAL, _untranslated
from stream.topics import CALLS


def _kept(body: dict[str, object]) -> dict[str, object]:
    return _untranslated(body).extra["untranslated"]


def test_a_small_body_is_kept_as_sent() -> None:
    body = {"model": "m", "max_tokens": 5, "stream": True, "temperature": None,
            "messages": [{"role": "user", "content": [{"type": "document", "source": {"data": "JVBERi0="}}]}]}
    assert _kept(body) == body


def test_many_strings_each_under_the_string_cut_stop_at_the_total() -> None:
    # 300 blocks of 60,000 characters: each is under the per-string cut, together 18 MB, over the
    # calls topic's 16 MiB: without a total the event went to the dead-letter topic.
    blocks = [{"type": "text", "text": chr(65 + i % 26) * 60_000} for i in range(300)]
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "document"}, *blocks]}]}
    content = _kept(body)["messages"][0]["content"]  # type: ignore[index]
    whole = len(content) - 2  # the document, the blocks kept whole, the marker
    assert 10 < whole < 20
    assert content[1:-1] == blocks[:whole]
    assert content[-1] == f"[{300 - whole} more items not recorded: the record's limit]"
    assert len(orjson.dumps(content)) < _REFUSED_TOTAL + 70_000


def test_many_small_values_and_fields_stop_at_the_total() -> None:
    numbers = _kept({"model": "m", "extra": list(range(1_000_000))})["extra"]
    assert isinstance(numbers, list) and 100_000 < len(numbers) < 200_000
    assert numbers[:-1] == list(range(len(numbers) - 1))
    assert numbers[-1] == f"[{1_000_000 - len(numbers) + 1} more items not recorded: the record's limit]"

    fields = {f"k{i}": i for i in range(400_000)}
    kept = _kept({"model": "m", "logit_bias": fields, "after": "x", "later": "y"})
    cut = kept["logit_bias"]
    assert isinstance(cut, dict) and _CUT_KEY in cut
    assert list(cut)[:-1] == list(fields)[:len(cut) - 1]
    assert cut[_CUT_KEY] == f"[{400_000 - len(cut) + 1} more fields not recorded: the record's limit]"
    # The fields used the whole total: the body's own fields after them are one marker.
    assert kept == {"model": "m", "logit_bias": cut, _CUT_KEY: "[2 more fields not recorded: the record's limit]"}
    assert len(orjson.dumps(kept)) < 2 * _REFUSED_TOTAL


def test_text_that_escapes_to_six_bytes_a_character_still_fits_the_topic() -> None:
    blocks = [{"type": "text", "text": "\x01" * 60_000} for _ in range(500)]  # 30 M characters
    kept = _kept({"model": "m", "messages": [{"role": "user", "content": blocks}]})
    assert len(orjson.dumps(kept)) < CALLS.max_message_bytes // 2


def test_a_body_of_empty_values_is_bounded_too() -> None:
    # 3 bytes of body each ("[]," and the like): 30 MB holds ten million of them.
    for empty in ([], "", {}):
        kept = _kept({"model": "m", "x": [empty] * 10_000_000})
        assert len(orjson.dumps(kept)) < CALLS.max_message_bytes // 4, type(empty)
        assert kept["x"][-1].endswith("more items not recorded: the record's limit]")  # type: ignore[index]


def test_a_key_over_the_string_cut_is_cut_as_a_string_is_and_kept_apart() -> None:
    long_a, long_b = "a" * 5_000_000, "a" * 4_000_000 + "b"
    kept = _kept({"model": "m", "metadata": {long_a: 1, long_b: 2}})
    assert kept["metadata"] == {f"{'a' * 256}…[{len(long_a) - 256} more characters not recorded]#0": 1,
                                f"{'a' * 256}…[{len(long_b) - 256} more characters not recorded]#1": 2}
    assert len(orjson.dumps(kept)) < 2_000
