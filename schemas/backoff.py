"""How long to wait before trying again something that keeps failing: one rule for every retry.

Every layer retries (a consumer's handler, the OAuth token fetch, the pod watch, a replica's
reload, the verifier's reward post), and all of them wait the same way: a first pause that
doubles after each failure in a row, up to a cap, and starts over after a success. It sits at
the bottom of the layers and imports only the standard library, so that ``openforge reward``,
which runs in every rollout, can use it without paying for anything else.
"""

from __future__ import annotations

import math

__all__ = ["Backoff"]


class Backoff:
    """Pauses of ``first_s``, doubling after each failure in a row, never longer than ``max_s``.

    The caller sleeps (or waits on its own stop event) for what :meth:`next_s` returns, so the
    same rule serves blocking and asynchronous code.
    """

    __slots__ = ("failures", "first_s", "max_s")

    def __init__(self, first_s: float, max_s: float = math.inf) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0
        """Failures in a row so far."""

    def next_s(self) -> float:
        """Count one more failure; the pause before the next try."""
        self.failures += 1
        # Past 2**62 every cap is long reached; a float power would overflow at 2**1024.
        return min(self.first_s * 2.0 ** min(self.failures - 1, 62), self.max_s)

    def reset(self) -> None:
        """A try succeeded: the next failure pauses ``first_s`` again."""
        self.failures = 0
