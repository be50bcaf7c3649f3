"""``OPENFORGE_PROXY_SAMPLING``: what it may force, read from the environment, and its errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proxy.settings import POLICY_SAMPLING, ProxySettings


def test_the_policys_sampling_is_read_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_PROXY_SAMPLING", '{"temperature": 1.0, "top_p": 1, "top_k": -1.0, "min_p": 0}')
    sampling = ProxySettings().sampling
    assert sampling == {"temperature": 1.0, "top_p": 1, "top_k": -1, "min_p": 0}
    assert type(sampling["top_k"]) is int  # vLLM refuses -1.0 where it wants an integer
    monkeypatch.delenv("OPENFORGE_PROXY_SAMPLING")
    assert ProxySettings().sampling == {}  # by default each harness's own sampling goes through
    assert ProxySettings(sampling=POLICY_SAMPLING).sampling == POLICY_SAMPLING  # the demo's and the chart's


@pytest.mark.parametrize(("value", "says"), [
    ({"max_tokens": 64}, "sampling cannot set max_tokens"),  # the answer's length stays the harness's
    ({"seed": 1, "stop": ["x"]}, "sampling cannot set seed, stop"),
    ({"temperature": True}, "temperature"),  # not a number, though Python would take it as 1
    ({"temperature": "1.0"}, "temperature"),
    ({"top_k": 2.5}, "top_k must be a whole number"),
    ({"top_k": float("inf")}, "top_k must be at least -1"),  # not an overflow from int()
    ({"temperature": float("nan")}, "temperature must be at least 0"),
    ({"temperature": -3}, "temperature must be at least 0"),
    ({"top_p": 0}, "top_p must be over 0 and at most 1"),
    ({"top_p": 7}, "top_p must be over 0 and at most 1"),
    ({"presence_penalty": 2.5}, "presence_penalty must be at least -2 and at most 2"),
])
def test_what_sampling_cannot_force_is_refused_by_name(value: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ProxySettings(sampling=value)
