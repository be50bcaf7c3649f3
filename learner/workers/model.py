"""The module a worker trains: a causal LM whose forward returns token logprobs and entropies.

A causal LM's own forward returns logits for every position over the whole vocabulary: at 8,192
tokens and Qwen's 152k vocabulary that is 5 GB in float32, and the log-softmax, the entropy and
their gradients each add a copy of that size. :class:`PolicyModel` runs the LM's body instead and
hands its last hidden states to veRL's ``FusedLinearForPPO``, which computes the output projection,
logprob and entropy a chunk of tokens at a time and recomputes each chunk's logits in the backward
pass: no tensor over all tokens and the whole vocabulary exists, forward or backward.

The wrapper is the root of the FSDP sharding (see :mod:`learner.workers.fsdp`), so the output
projection's weight is gathered for the whole forward and backward, where the chunks use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PolicyModel", "chunked_logprobs_and_entropy"]


def chunked_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and entropy of each position's distribution, ``chunk_tokens`` positions at a time.

    Args:
        hidden: ``(..., T, H)`` last hidden states.
        weight: ``(V, H)`` output projection (no bias).
        targets: ``(..., T)`` the token each position is scored on.
        chunk_tokens: Positions per chunk; a chunk's float32 logits are ``chunk_tokens x V``.

    Returns:
        float32 logprobs and entropies shaped like ``targets``; both differentiable.
    """
    from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction

    logprobs, entropy = FusedLinearForPPOFunction.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets.long(), 1.0, chunk_tokens)
    return logprobs, entropy


class PolicyModel(nn.Module):
    """A Hugging Face causal LM (``lm``) whose forward scores packed sequences in chunks."""

    def __init__(self, lm: Any, chunk_tokens: int) -> None:
        super().__init__()
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("the learner scores tokens in chunks with the output projection's weight alone; "
                             f"{type(lm).__name__}'s has a bias")
        for name in ("final_logit_softcapping", "logit_scale"):
            if getattr(lm.config, name, None) not in (None, 1.0):
                raise ValueError(f"{type(lm).__name__} transforms its logits ({name}); the learner's chunked "
                                 "logprobs do not")
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of ``targets`` and entropies ``(T,)`` at every position of the packed rows in ``ids``.

        No attention mask is given: with positions that restart at each row, transformers keeps
        attention within each row (its packed-sequence mask), so no padding is needed.
        """
        body = self.lm.get_decoder()
        hidden = body(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        # Flat (tokens, hidden) in, flat results out: a reshaped (view) output would lose FSDP's
        # pre-backward hook if anything later changed it in place.
        return chunked_logprobs_and_entropy(hidden.flatten(0, -2), weight, targets.flatten(), self.chunk_tokens)
