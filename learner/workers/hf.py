"""The ``hf`` worker: a transformers causal LM trained with veRL's losses on one device.

Per step: for each token-budget micro-batch, a forward pass recomputes the current logprobs of the
completion tokens; veRL's rollout correction turns them and the behaviour logprobs into truncated
importance weights; veRL's policy loss, normalised over the whole step's tokens, is backpropagated;
after the last micro-batch the gradients are clipped and AdamW steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import torch_functional as verl_F
from verl.workers.config import ActorConfig

from learner.algos import policy_loss, rollout_correction
from learner.batching import micro_batches
from learner.entropy import EntropyControl
from learner.protocol import Row, TrainBatch
from learner.settings import LearnerSettings

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
# Files of a model folder that save_pretrained does not write but an engine needs to serve it.
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json")
_WEIGHT_SAMPLE = 512  # importance weights reported per step, as evenly spaced quantiles of all of them


class HFPolicyWorker:
    """A Hugging Face causal LM with AdamW, trained by :meth:`train_step`."""

    def __init__(self, settings: LearnerSettings, model_dir: Path) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.rank, self.world_size = 0, 1
        """Data-parallel rank and size; the ``fsdp`` worker sets them from its process group."""
        self.device = self._setup_device()
        torch.manual_seed(settings.seed)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa")
        self.model = self._wrap(model)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, eps=settings.adam_eps,
                                           weight_decay=settings.weight_decay)
        state = model_dir / OPTIMIZER_FILE
        if state.exists():
            self._load_optimizer(torch.load(state, map_location="cpu", weights_only=True))
            # The saved state carries the hyperparameters it was made with; a restart with
            # changed settings means the new ones.
            for group in self.optimizer.param_groups:
                group.update(lr=settings.lr, eps=settings.adam_eps, weight_decay=settings.weight_decay)
        self._loss_fn = policy_loss(settings.policy_loss)
        self.entropy_control = EntropyControl(settings.entropy_coeff, settings.entropy_target,
                                              settings.entropy_coeff_delta, settings.entropy_coeff_max)
        self._actor = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                                  rollout_n=1, clip_ratio=settings.clip_ratio, clip_ratio_low=settings.clip_ratio,
                                  clip_ratio_high=settings.clip_ratio)
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self._last_weights: list[float] = []

    # -- what an engine changes ------------------------------------------------------------------

    def _setup_device(self) -> torch.device:
        return torch.device(self.settings.device)

    def _wrap(self, model: Any) -> Any:
        """Place (and, in subclasses, shard) the freshly loaded float32 model."""
        return model.to(self.device)

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def _optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state to save (None on ranks that do not write)."""
        return self.optimizer.state_dict()

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip))

    def _micro_batch_count(self, local: int) -> int:
        """How many micro-batches every rank runs (ranks must agree: each backward is collective)."""
        return local

    def _sum_across_ranks(self, values: list[float]) -> list[float]:
        return values

    def _write_weights(self, folder: Path) -> bool:
        """Write weights and config into ``folder``; return whether this rank wrote files."""
        self.model.save_pretrained(folder, safe_serialization=True)
        return True

    def _tensors(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        width = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        # Aligned with the predicted token: column j scores input_ids[:, j + 1].
        mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        behavior = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        advantages = torch.zeros((len(rows), width - 1), dtype=torch.float32)
        bonus = torch.tensor([[float(r.entropy_bonus)] for r in rows], dtype=torch.float32)
        for i, row in enumerate(rows):
            n, start = len(row.input_ids), row.prompt_len - 1
            ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            attention[i, :n] = 1
            stop = start + len(row.loss_mask)
            mask[i, start:stop] = torch.tensor(row.loss_mask, dtype=torch.float32)
            behavior[i, start:stop] = torch.tensor(row.behavior_logprobs, dtype=torch.float32)
            advantages[i, start:stop] = row.advantage
        out = {"ids": ids, "attention": attention, "mask": mask, "behavior": behavior, "advantages": advantages,
               "bonus_rows": bonus}
        return {k: v.to(self.device) for k, v in out.items()}

    def token_logprobs(self, rows: list[Row], *, entropy_grad: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Current logprobs and entropies of every predicted token, with the padded tensors.

        The entropies carry gradients only when ``entropy_grad`` is set (an entropy bonus is
        trained); otherwise they are a metric and cost no graph.
        """
        t = self._tensors(rows)
        logits = self.model(input_ids=t["ids"], attention_mask=t["attention"]).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, t["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = verl_F.entropy_from_logits(logits)
        return logprobs, entropy, t

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over ``batch`` (see the module docstring)."""
        s = self.settings
        every = [r for r in batch.rows if r.trained_tokens > 0]
        if not every:
            return {}
        # Data parallel: every rank holds the whole batch and trains its share of the rows; the loss
        # is normalised by the whole step's tokens and scaled by dp_size, because the gradient
        # reduction averages over ranks (veRL's agg_loss contract).
        actor = dataclasses.replace(self._actor, global_batch_info={
            "dp_size": self.world_size, "batch_num_tokens": sum(r.trained_tokens for r in every),
            "global_batch_size": len(every),
        })
        rows = every[self.rank::self.world_size]
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        weights_seen: list[torch.Tensor] = []
        total_loss = 0.0
        entropy_sum, mask_sum = 0.0, 0.0
        coeff = self.entropy_control.coeff
        parts = micro_batches(rows, s.token_budget) if rows else []
        count = self._micro_batch_count(len(parts))
        for index in range(count):
            # A rank with fewer micro-batches than the others runs a zero-weighted one, so that every
            # rank enters the same number of (collective) backward passes.
            padding = index >= len(parts)
            part = [every[0]] if padding else parts[index]
            logprobs, entropy, t = self.token_logprobs(part, entropy_grad=coeff > 0)
            current = logprobs.detach()
            weights, mask, corr = rollout_correction(
                current, t["behavior"], t["mask"], mode=s.rollout_is, threshold=s.rollout_is_threshold,
                rejection=s.rollout_rs, rejection_threshold=s.rollout_rs_threshold,
            )
            # One update per batch: the proximal policy is the current one, so the PPO ratio starts
            # at 1 and the off-policy gap is carried entirely by the rollout-correction weights.
            loss, loss_metrics = self._loss_fn(
                old_log_prob=current, log_prob=logprobs, advantages=t["advantages"], response_mask=mask,
                loss_agg_mode=s.loss_agg_mode, config=actor, rollout_is_weights=weights,
            )
            if coeff > 0:
                # As veRL's actor does: the bonus is aggregated like the policy loss, over the same
                # (correction-masked) tokens and the same whole-step normalisation, over the rows it
                # acts on.
                bonus = agg_loss(loss_mat=entropy, loss_mask=mask * t["bonus_rows"], loss_agg_mode=s.loss_agg_mode,
                                 **actor.global_batch_info)
                loss = loss - coeff * bonus
            if padding:
                (loss * 0.0).backward()  # type: ignore[no-untyped-call]
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            total_loss += float(loss.detach())
            entropy_sum += float((entropy.detach() * t["mask"]).sum())
            mask_sum += float(t["mask"].sum())
            if weights is not None:
                weights_seen.append(weights[t["mask"] > 0].detach().flatten())
            for key, value in {**corr, **_floats(loss_metrics)}.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step's loss is the sum over ranks of their dp_size-scaled parts, divided by dp_size.
        total_loss, entropy_sum, mask_sum = self._sum_across_ranks([total_loss, entropy_sum, mask_sum])
        metrics = {k: v / max(len(parts), 1) for k, v in sums.items()}
        metrics.update({"loss": total_loss / self.world_size, "entropy": entropy_sum / max(mask_sum, 1.0),
                        "grad_norm": grad_norm, "micro_batches": float(count)})
        if self.entropy_control.active:
            # Every rank sees the same summed entropy, so every rank steers to the same coefficient.
            metrics["entropy_coeff"] = coeff
            self.entropy_control.update(metrics["entropy"])
        self._last_weights = []
        if weights_seen:
            w = torch.cat(weights_seen)
            self._last_weights = _quantile_sample(w, _WEIGHT_SAMPLE)
            metrics.update({
                "is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()), "is_weight_min": float(w.min()),
                # Kish's effective sample size, as a fraction of the tokens.
                "is_ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if float((w**2).sum()) > 0 else 0.0,
            })
        return {k: v for k, v in metrics.items() if math.isfinite(v) or k == "loss"}

    def importance_weights(self) -> Sequence[float]:
        """The last step's per-token importance weights, at most ``_WEIGHT_SAMPLE`` evenly spaced quantiles.

        A histogram of them has the batch's distribution without one record per token (a batch of
        long rollouts has hundreds of thousands).
        """
        return list(self._last_weights)

    def save(self, folder: Path) -> None:
        """Weights as safetensors, the config, tokenizer files from the source folder, optimizer state."""
        optimizer = self._optimizer_state()  # collective under FSDP: every rank takes part
        if self.rank == 0:  # the other ranks take part in the gathering but write nothing
            folder.mkdir(parents=True, exist_ok=True)
        if not self._write_weights(folder):
            return
        for name in _CARRIED:
            src = self.model_dir / name
            if src.exists() and not (folder / name).exists():
                shutil.copy2(src, folder / name)
        if optimizer is not None:
            torch.save(optimizer, folder / OPTIMIZER_FILE)


def _quantile_sample(values: torch.Tensor, limit: int) -> list[float]:
    """All of ``values`` when there are at most ``limit``, else ``limit`` evenly spaced order statistics."""
    flat = values.detach().flatten().float().cpu()
    if flat.numel() <= limit:
        return [float(v) for v in flat]
    ordered = flat.sort().values
    index = torch.linspace(0, flat.numel() - 1, limit).round().long()
    return [float(v) for v in ordered[index]]


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out
