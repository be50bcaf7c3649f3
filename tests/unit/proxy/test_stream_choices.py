"""How many choices a stream waits for before it holds back the answer's closing chunks."""

from __future__ import annotations

import pytest

from proxy.service import _choices


@pytest.mark.parametrize(("n", "choices"), [
    (None, 1), (1, 1), (3, 3), (0, 1), (-2, 1),
    (2.0, 2), ("2", 2), (" 4 ", 4), ("2.0", 2), ("+2", 2),  # vLLM's request model reads these as counts too
    (2.5, 1), ("two", 1), ("²", 1), (True, 1), ([2], 1), (float("nan"), 1),  # the engine refuses these
])
def test_n_is_read_as_the_engine_reads_it(n: object, choices: int) -> None:
    assert _choices(n) == choices
