"""Micro-batching by token budget: bounded activation memory whatever the sequence lengths.

A micro-batch is padded to its longest row, so its cost is ``rows x longest``. Rows are sorted by
length first so similar lengths share a micro-batch and little is wasted on padding.
"""

from __future__ import annotations

from collections.abc import Sequence

from learner.protocol import Row


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group row indices so that ``len(group) * max(length in group) <= token_budget``.

    A row longer than the budget forms a micro-batch of its own: it must train, and it cannot
    be split without changing what it means.

    Raises:
        ValueError: a non-positive budget or length.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    if any(n < 1 for n in lengths):
        raise ValueError("every row needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        candidate = max(longest, lengths[i])
        if current and candidate * (len(current) + 1) > token_budget:
            batches.append(current)
            current, candidate = [], lengths[i]
        current.append(i)
        longest = candidate
    if current:
        batches.append(current)
    return batches


def micro_batches(rows: Sequence[Row], token_budget: int) -> list[list[Row]]:
    """Rows split into token-budget micro-batches (see :func:`plan_micro_batches`)."""
    plan = plan_micro_batches([len(r.input_ids) for r in rows], token_budget)
    return [[rows[i] for i in group] for group in plan]
