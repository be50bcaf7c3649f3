"""JSON with integers of any size, for the rare answer that holds one past 64 bits.

orjson, the proxy's JSON everywhere else, reads such an integer as a float (another number) and
cannot write one back. A model may still write one into a tool call (an id, a hash as a number),
and an Anthropic whole answer parses the call's arguments into its ``input``: there the standard
library's decoder and encoder stand in, held to what orjson accepts so that arguments mean the
same whichever reads them.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

LONG_DIGITS: Final = re.compile(r"\d{19}")
"""A run of digits that may be an integer past 64 bits (2**63 has 19 digits): text without one
is read by orjson as exactly as by this module."""


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, integers of any size written exactly.

    Raises:
        ValueError: ``value`` holds what JSON cannot carry (a non-finite float, a lone surrogate).
    """
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def loads(text: str) -> Any:
    """JSON with integers of any size, refusing what orjson refuses.

    The standard decoder also reads ``NaN``, numbers past a double's range (as infinity) and lone
    surrogates, which orjson refuses; let through, an answer holding them could not be written
    back out by :func:`dumps` (a 500 after the call was recorded ok).

    Raises:
        ValueError: ``text`` is not JSON orjson would read, or could not be written back.
        RecursionError: nested deeper than the standard decoder goes.
    """
    value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    dumps(value)  # a lone surrogate fails here
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a double's range")
    return value


__all__ = ["LONG_DIGITS", "dumps", "loads"]
