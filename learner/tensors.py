"""A step's rows as a few flat tensors: what travels to the ranks and what a worker packs.

The trainer builds :class:`~learner.protocol.TrainBatch` rows of Python lists; a worker needs
tensors. :class:`TensorBatch` is the one conversion: every row's tokens concatenated, with per-row
lengths and per-token values aligned to the token each position predicts (position ``j`` of a row
scores token ``j + 1``; a row's last position scores nothing). Several ranks receive it as two
tensor broadcasts (integers, floats) after a two-number header, not as pickled lists.

:meth:`TensorBatch.pack` turns some of its rows into one packed sequence without padding: the
tokens back to back, positions restarting at each row (transformers then masks attention across
rows), the next token of each position as its target, and the index that scatters per-token
results into the ``(rows, longest - 1)`` layout veRL's losses take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from learner.protocol import TrainBatch

__all__ = ["Packed", "TensorBatch"]


@dataclass(frozen=True)
class Packed:
    """Rows of a micro-batch as one sequence, and how its per-token results map back to rows."""

    ids: torch.Tensor
    """``(1, T)`` token ids, the rows back to back."""
    positions: torch.Tensor
    """``(1, T)`` positions, restarting at 0 for each row."""
    targets: torch.Tensor
    """``(1, T)`` the token each position predicts (0 at a row's last position, which trains nothing)."""
    rows: torch.Tensor
    """``(T',)`` row (within the micro-batch) of each packed position that predicts a token."""
    cols: torch.Tensor
    """``(T',)`` its column in the padded layout: the position within its row."""
    scored: torch.Tensor
    """``(T',)`` those packed positions (every position but each row's last)."""
    width: int
    """Columns of the padded layout: the longest row's length minus one."""
    loss: dict[str, torch.Tensor]
    """Padded ``(rows, width)`` tensors for the losses: ``mask``, ``behavior``, ``advantages``, and
    ``bonus_rows`` ``(rows, 1)``."""

    def padded(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position results ``(1, T)`` (or ``(T,)``) as ``(rows, width)``, zero where no token is scored."""
        flat = values.reshape(-1)
        out = flat.new_zeros((self.loss["mask"].shape[0], self.width))
        return out.index_put((self.rows, self.cols), flat[self.scored])


@dataclass(frozen=True)
class TensorBatch:
    """Every row of a step as flat tensors (see the module docstring)."""

    ids: torch.Tensor
    """int64 ``(N,)``: every row's prompt and completion ids, rows back to back."""
    lengths: torch.Tensor
    """int64 ``(R,)``: tokens per row."""
    prompt_lens: torch.Tensor
    """int64 ``(R,)``: prompt tokens per row."""
    mask: torch.Tensor
    """float32 ``(N,)``: 1 where the token this position predicts is trained."""
    behavior: torch.Tensor
    """float32 ``(N,)``: the engine's logprob of the token this position predicts (0 elsewhere)."""
    advantages: torch.Tensor
    """float32 ``(R,)``: each row's advantage."""
    bonus: torch.Tensor
    """float32 ``(R,)``: 1 where the entropy bonus acts on the row."""
    _starts: list[int] = field(init=False, repr=False, compare=False)
    _lengths: list[int] = field(init=False, repr=False, compare=False)
    _prompt_lens: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = [int(n) for n in self.lengths.tolist()]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_prompt_lens", [int(n) for n in self.prompt_lens.tolist()])

    @classmethod
    def of(cls, batch: TrainBatch | TensorBatch) -> TensorBatch:
        """``batch`` as tensors (a :class:`TensorBatch` is returned as it is)."""
        if isinstance(batch, TensorBatch):
            return batch
        ids: list[int] = []
        mask: list[float] = []
        behavior: list[float] = []
        for row in batch.rows:
            ids.extend(row.input_ids)
            # Position prompt_len - 1 predicts the first completion token; the last position predicts nothing.
            lead = row.prompt_len - 1
            mask.extend([0.0] * lead)
            mask.extend(float(v) for v in row.loss_mask)
            mask.append(0.0)
            behavior.extend([0.0] * lead)
            behavior.extend(row.behavior_logprobs)
            behavior.append(0.0)
        return cls(
            ids=torch.tensor(ids, dtype=torch.long),
            lengths=torch.tensor([len(r.input_ids) for r in batch.rows], dtype=torch.long),
            prompt_lens=torch.tensor([r.prompt_len for r in batch.rows], dtype=torch.long),
            mask=torch.tensor(mask, dtype=torch.float32),
            behavior=torch.tensor(behavior, dtype=torch.float32),
            advantages=torch.tensor([r.advantage for r in batch.rows], dtype=torch.float32),
            bonus=torch.tensor([1.0 if r.entropy_bonus else 0.0 for r in batch.rows], dtype=torch.float32),
        )

    # -- what a worker plans with ---------------------------------------------------------------

    @property
    def row_count(self) -> int:
        """Rows in the batch."""
        return len(self._lengths)

    def row_lengths(self) -> list[int]:
        """Tokens per row."""
        return list(self._lengths)

    def trained_tokens(self) -> list[int]:
        """Trained tokens per row."""
        sums = torch.zeros(self.row_count, dtype=torch.float64)
        sums.index_add_(0, self._row_of_token(), self.mask.double())
        return [round(v) for v in sums.tolist()]

    def completion_lengths(self) -> list[int]:
        """Completion tokens per row."""
        return [int(v) for v in (self.lengths - self.prompt_lens).tolist()]

    def _row_of_token(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.row_count), self.lengths)

    def pack(self, rows: list[int], device: torch.device) -> Packed:
        """Rows ``rows`` (indices into this batch) as one packed sequence on ``device``."""
        lengths = [self._lengths[i] for i in rows]
        index = torch.cat([torch.arange(self._starts[i], self._starts[i] + n) for i, n in zip(rows, lengths,
                                                                                             strict=True)])
        local = torch.cat([torch.arange(n) for n in lengths])
        row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
        ends = torch.tensor(lengths)[row_of] - 1
        scored = torch.nonzero(local < ends).flatten()
        ids = self.ids[index]
        # A row's last position has no next token of its own; its target is never scored.
        targets = torch.zeros_like(ids)
        targets[scored] = ids[scored + 1]
        width = max(lengths) - 1
        loss = {
            "mask": _scatter(self.mask[index], row_of, local, scored, len(rows), width),
            "behavior": _scatter(self.behavior[index], row_of, local, scored, len(rows), width),
        }
        # As the rows' own layout has it: the advantage on every completion column, zero on the prompt's.
        prompt = torch.tensor([self._prompt_lens[i] for i in rows])[row_of]
        completion = (local >= prompt - 1).to(torch.float32)
        loss["advantages"] = _scatter(self.advantages[rows][row_of] * completion, row_of, local, scored, len(rows),
                                      width)
        loss["bonus_rows"] = self.bonus[rows].unsqueeze(1)
        return Packed(ids=ids.unsqueeze(0).to(device), positions=local.unsqueeze(0).to(device),
                      targets=targets.unsqueeze(0).to(device), rows=row_of[scored].to(device),
                      cols=local[scored].to(device), scored=scored.to(device), width=width,
                      loss={k: v.to(device) for k, v in loss.items()})

    # -- several ranks ---------------------------------------------------------------------------

    def broadcast(self, group: Any = None) -> None:
        """Rank 0: send this batch to the other ranks (they call :meth:`receive` with the same group)."""
        import torch.distributed as dist

        header = torch.tensor([self.ids.numel(), self.row_count], dtype=torch.long)
        dist.broadcast(header, src=0, group=group)
        dist.broadcast(torch.cat([self.ids, self.lengths, self.prompt_lens]), src=0, group=group)
        dist.broadcast(torch.cat([self.mask, self.behavior, self.advantages, self.bonus]), src=0, group=group)

    @classmethod
    def receive(cls, group: Any = None) -> TensorBatch:
        """Other ranks: the batch rank 0 sends with :meth:`broadcast`."""
        import torch.distributed as dist

        header = torch.empty(2, dtype=torch.long)
        dist.broadcast(header, src=0, group=group)
        tokens, rows = (int(v) for v in header.tolist())
        integers = torch.empty(tokens + 2 * rows, dtype=torch.long)
        dist.broadcast(integers, src=0, group=group)
        floats = torch.empty(2 * tokens + 2 * rows, dtype=torch.float32)
        dist.broadcast(floats, src=0, group=group)
        ids, lengths, prompt_lens = torch.split(integers, [tokens, rows, rows])
        mask, behavior, advantages, bonus = torch.split(floats, [tokens, tokens, rows, rows])
        return cls(ids=ids, lengths=lengths, prompt_lens=prompt_lens, mask=mask, behavior=behavior,
                   advantages=advantages, bonus=bonus)


def _scatter(values: torch.Tensor, row_of: torch.Tensor, local: torch.Tensor, scored: torch.Tensor,
             rows: int, width: int) -> torch.Tensor:
    out = torch.zeros((rows, width), dtype=values.dtype)
    return out.index_put((row_of[scored], local[scored]), values[scored])
