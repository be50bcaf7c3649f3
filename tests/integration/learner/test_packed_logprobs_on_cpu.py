"""The learner's packed, chunked logprobs against the padded, full-vocabulary reference.

The reference is how logprobs were computed before (and how most trainers compute them): rows
padded to the longest, an attention mask, the model's full ``(rows, tokens, vocabulary)`` float32
logits, ``log_softmax`` and the entropy over the whole vocabulary. The worker instead runs the
rows back to back without padding and scores them a few positions at a time; the two must agree,
values and gradients, to float rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from trajectories import VOCAB

from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings
from learner.tensors import TensorBatch
from learner.workers.hf import HFPolicyWorker
from learner.workers.model import chunked_logprobs_and_entropy


def _rows(seed: int = 0) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for prompt, completion in ((5, 9), (17, 3), (2, 30), (11, 11)):
        ids = [rng.randrange(VOCAB) for _ in range(prompt + completion)]
        rows.append(Row(input_ids=ids, prompt_len=prompt, loss_mask=[1] * completion,
                        behavior_logprobs=[-1.0] * completion, advantage=1.0))
    return rows


def _padded_reference(lm: torch.nn.Module, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.input_ids) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row.input_ids)] = torch.tensor(row.input_ids)
        attention[i, :len(row.input_ids)] = 1
    logits = lm(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = F.log_softmax(logits, dim=-1)
    token = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    valid = attention[:, 1:].float()  # column j scores token j + 1, which must be a real one
    return token * valid, entropy * valid


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_packed_chunked_logprobs_equal_the_padded_full_vocabulary_ones(tiny_model: Path, chunk: int) -> None:
    worker = HFPolicyWorker(LearnerSettings(model_dir=tiny_model, logprob_chunk_tokens=chunk), tiny_model)
    rows = _rows()
    batch = TensorBatch.of(TrainBatch(rows))
    logprobs, entropy, packed = worker.token_logprobs(batch, list(range(len(rows))), entropy_grad=True)
    ref_logprobs, ref_entropy = _padded_reference(worker.lm, rows)
    valid = ref_logprobs != 0
    assert logprobs.shape == ref_logprobs.shape and torch.equal(logprobs != 0, valid)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert float(ref_entropy[valid].mean().detach()) > 1.0  # a real distribution, not a degenerate one

    # Gradients of a loss over both equal too: the chunks recompute their logits in the backward.
    weights = torch.linspace(-1, 1, logprobs.numel()).reshape(logprobs.shape)
    params = [p for p in worker.lm.parameters() if p.requires_grad]
    new = torch.autograd.grad(((logprobs + 0.1 * entropy) * weights).sum(), params)
    ref_logprobs, ref_entropy = _padded_reference(worker.lm, rows)
    old = torch.autograd.grad(((ref_logprobs + 0.1 * ref_entropy) * weights).sum(), params)
    for a, b in zip(new, old, strict=True):
        # Elementwise, a few near-zero entries differ by rounding; against the gradient's scale nothing does.
        assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
        assert float((a - b).norm()) <= 1e-5 * float(b.norm())
    assert packed.ids.shape == (1, sum(len(r.input_ids) for r in rows))  # no padding ran


@pytest.mark.parametrize("trained", ["logprobs", "entropy", "both"])
def test_chunked_logprobs_and_entropy_equal_the_full_ones_with_gradients(trained: str) -> None:
    # Each backward path: the logprobs' gradient alone (no entropy bonus), the entropy's alone, both.
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(1000, 16, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 1000, (37,))
    logprobs, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_tokens=5)
    logp = F.log_softmax(hidden @ weight.T, dim=-1)
    ref_logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-4, atol=1e-5)
    scale = torch.linspace(-1, 1, 37)

    def loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        terms = {"logprobs": lp * 2, "entropy": ent, "both": lp * 2 + ent}
        return (terms[trained] * scale).sum()

    grads = torch.autograd.grad(loss(logprobs, entropy), [hidden, weight])
    ref_grads = torch.autograd.grad(loss(ref_logprobs, ref_entropy), [hidden, weight])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_takes_the_same_step(tiny_model: Path) -> None:
    steps = []
    for checkpointing in (False, True):
        settings = LearnerSettings(model_dir=tiny_model, gradient_checkpointing=checkpointing, token_budget=40)
        worker = HFPolicyWorker(settings, tiny_model)
        assert worker.lm.is_gradient_checkpointing == checkpointing
        steps.append(worker.train_step(TrainBatch(_rows(1))))
    plain, recomputed = steps
    assert plain["micro_batches"] > 1
    for key in ("loss", "grad_norm", "entropy"):
        assert recomputed[key] == pytest.approx(plain[key], rel=1e-6), key
