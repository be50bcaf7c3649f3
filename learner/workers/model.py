"""The module a worker trains: a causal LM whose forward returns token logprobs and entropies.

A causal LM's own forward returns logits for every position over the whole vocabulary: at 8,192
tokens and Qwen's 152k vocabulary that is 5 GB in float32, and the log-softmax, the entropy and
their gradients each add a copy of that size. :class:`PolicyModel` runs the LM's body instead and
hands its last hidden states to :func:`chunked_logprobs_and_entropy`, which computes the output
projection, logprob and entropy a chunk of tokens at a time and recomputes each chunk's logits in
the backward pass: no tensor over all tokens and the whole vocabulary exists, forward or backward.

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
        hidden: ``(T, H)`` last hidden states.
        weight: ``(V, H)`` output projection (no bias).
        targets: ``(T,)`` the token each position is scored on.
        chunk_tokens: Positions per chunk; a chunk's float32 logits are ``chunk_tokens x V``.

    Returns:
        float32 logprobs and entropies ``(T,)``; both differentiable.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (tokens, hidden) and targets (tokens,); got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, weight, targets.long(), chunk_tokens)  # type: ignore[no-untyped-call]
    return logprobs, entropy


def _dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(C, V)`` tensors without the ``(C, V)`` product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    """Logprobs and entropies through the output projection, one chunk of positions at a time.

    What veRL's ``FusedLinearForPPO`` computes, with fewer tensors of a chunk's size alive at once:
    the backward's logits gradient is made in place from the probabilities (the target's one-hot is
    added by index, not built), the entropy's row sums are dot products (no product tensor), and
    the weight's gradient is accumulated into one buffer with ``addmm_`` (veRL adds a second
    ``V x H`` product per chunk). At Qwen's vocabulary and 512-token chunks that is at most two
    float32 ``chunk x V`` tensors (311 MB each) where veRL has about five, and one ``V x H``
    gradient instead of two: 1,024 tokens' forward and backward peak at 1.2 GiB instead of 2.4.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = hidden.shape[0]
        logprobs = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            logp = torch.log_softmax((hidden[start:stop] @ weight.t()).float(), dim=-1)
            logprobs[start:stop] = logp.gather(-1, targets[start:stop, None]).view(-1)
            entropy[start:stop] = -_dot_rows(logp.exp(), logp)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_tokens = chunk_tokens
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, dlogprobs: torch.Tensor | None, dentropy: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dhidden = torch.empty_like(hidden) if need_hidden else None
        dweight = torch.zeros_like(weight) if need_weight else None
        if dlogprobs is None and dentropy is None:
            return dhidden, dweight, None, None
        tokens, chunk = hidden.shape[0], ctx.chunk_tokens
        for start in range(0, tokens, chunk):
            stop = min(start + chunk, tokens)
            h = hidden[start:stop]
            logp = torch.log_softmax((h @ weight.t()).float(), dim=-1)
            probs = logp.exp()
            # d logp[t] / d logits = onehot(t) - p;  d H / d logits = -p * (logp + H).
            if dentropy is not None:
                grad = dentropy[start:stop, None].float()
                entropy = -_dot_rows(probs, logp)
                scale = logp.add_(entropy[:, None]).mul_(-grad)
                if dlogprobs is not None:
                    scale.sub_(dlogprobs[start:stop, None].float())
                dlogits = probs.mul_(scale)
            else:
                assert dlogprobs is not None
                dlogits = probs.mul_(-dlogprobs[start:stop, None].float())
            if dlogprobs is not None:
                rows = torch.arange(stop - start, device=dlogits.device)
                dlogits[rows, targets[start:stop]] += dlogprobs[start:stop].float()
            dlogits = dlogits.to(weight.dtype)
            if dhidden is not None:
                torch.mm(dlogits, weight, out=dhidden[start:stop])
            if dweight is not None:
                dweight.addmm_(dlogits.t(), h)
        return dhidden, dweight, None, None


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
