"""How deep a request may nest, checked by the encoding the proxy does anyway (no walk of its own).

orjson writes at most 254 nested containers. The records that carry a request's fields sit
deeper than the request itself (the call event's ``request.extra``, a trajectory's calls), so a
request that only just encodes would be answered and then fail to be recorded. Requests are
therefore held to :data:`MAX_DEPTH` levels, far past any real one (a tool's JSON schema is a
dozen) and far enough inside orjson's limit for every record that carries them.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import InvalidRequestError

MAX_DEPTH = 128
"""Most levels of objects and lists a request may nest, its top object counted."""

_WRITABLE = 254
"""Most levels orjson writes (one more raises ``TypeError: Recursion limit reached``)."""

_WRAP = _WRITABLE - MAX_DEPTH
"""Lists around what is encoded, so that orjson's own limit falls at :data:`MAX_DEPTH`."""


def _frame() -> tuple[list[Any], list[Any]]:
    outer: list[Any] = [None]
    inner = outer
    for _ in range(_WRAP - 1):
        nested: list[Any] = [None]
        inner[0] = nested
        inner = nested
    return outer, inner


_OUTER, _INNER = _frame()  # made once: wrapping each call's body anew would cost microseconds


def dumps_within_depth(value: Any, *, option: int = 0) -> bytes:
    """``value`` encoded inside the frame's lists (not its own JSON: a stable digest of it).

    Raises:
        InvalidRequestError: ``value`` nests deeper than :data:`MAX_DEPTH` levels, or holds what
            JSON cannot carry.
    """
    _INNER[0] = value
    try:
        return orjson.dumps(_OUTER, option=option)
    except TypeError as exc:
        if "Recursion" in str(exc):
            raise InvalidRequestError(f"the request nests deeper than {MAX_DEPTH} levels of objects and "
                                      "lists") from exc
        raise InvalidRequestError(f"the request could not be encoded: {exc}") from exc
    finally:
        _INNER[0] = None


__all__ = ["MAX_DEPTH", "dumps_within_depth"]
