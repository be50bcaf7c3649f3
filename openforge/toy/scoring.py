"""The toy verifier's reward: dense, in [0, 1], computed from text alone."""

from __future__ import annotations

__all__ = ["MAX_REWARD", "score_answer"]

MAX_REWARD = 1.0
"""The best score: an answer made only of the secret word's letters."""


def score_answer(answer: str, word: str) -> float:
    """Share of the answer's non-space characters that are letters of ``word`` (case-insensitive).

    An empty answer scores 0: saying nothing must not beat a poor attempt.

    Raises:
        ValueError: ``word`` has no letters, so no answer could score.
    """
    letters = {c for c in word.lower() if c.isalpha()}
    if not letters:
        raise ValueError(f"the secret word {word!r} has no letters")
    chars = [c for c in answer.lower() if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in letters for c in chars) / len(chars)
