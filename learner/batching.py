"""Micro-batching by token budget: bounded activation memory whatever the sequence lengths.

A micro-batch's rows run packed into one sequence, without padding, so its cost is the sum of
its rows' lengths. Rows are taken shortest first, which keeps the plan independent of the order
rows arrive in.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group row indices so that each group's lengths sum to at most ``token_budget``.

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
    total = 0
    for i in order:
        if current and total + lengths[i] > token_budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    if current:
        batches.append(current)
    return batches

