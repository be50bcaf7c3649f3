"""The ``hf`` worker: a transformers causal LM trained with veRL's losses on one device.

A learner step (one weight version) is ``ppo_epochs`` passes over ``ppo_mini_batches`` parts of its
rows, each part one optimizer update. Before the first update, the proximal logprobs of every
completion token are computed once without gradients; veRL's rollout correction turns them and the
behaviour logprobs into truncated importance weights, and every update uses them as the PPO
``old_log_prob``, so clipping acts from the second update on (veRL's decoupled PPO). With one
update per step (the default) the policy being trained is the proximal one and its own detached
logprobs serve. Per update, for each token-budget micro-batch, a forward pass recomputes the
current logprobs; veRL's policy loss, normalised over the whole mini-batch's tokens, is
backpropagated; after the last micro-batch the gradients are clipped and AdamW steps, unless the
loss or the gradient norm is not finite, in which case the update is skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss
from verl.workers.config import ActorConfig

from learner.algos import policy_loss, rollout_correction
from learner.batching import plan_micro_batches
from learner.entropy import EntropyControl
from learner.protocol import TrainBatch
from learner.settings import LearnerSettings
from learner.tensors import Packed, TensorBatch
from learner.workers.model import PolicyModel
from learner.workers.weights import (
    TRAINING_STATE_DIR,
    load_safetensors,
    load_training_state,
    materialize,
    parameters_on_meta,
    save_training_state,
    served_dtype,
    write_model_files,
    write_serving_weights,
)

logger = logging.getLogger(__name__)

_WEIGHT_SAMPLE = 512  # importance weights reported per step, as evenly spaced quantiles of all of them
# Kept in a step's metrics even when not finite: they are how a skipped update shows.
_KEPT_WHEN_NONFINITE = ("loss", "grad_norm")


def is_training_state(folder: Path) -> bool:
    """Whether ``folder`` is a training state (weights and optimizer to resume) rather than a model folder."""
    return (folder / TRAINING_STATE_DIR).is_dir()


class HFPolicyWorker:
    """A Hugging Face causal LM with AdamW, trained by :meth:`train_step`.

    ``model_dir`` is either a Hugging Face folder (the initial weights) or a training-state folder
    written by :meth:`save_state` (weights and optimizer state to resume from). Either way the model
    is built on the meta device, placed (sharded, in subclasses) and then filled: no full copy of
    the model exists besides the one being trained.
    """

    def __init__(self, settings: LearnerSettings, model_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.settings = settings
        self.model_dir = model_dir
        self.rank, self.world_size = 0, 1
        """Data-parallel rank and size; the ``fsdp`` worker sets them from its process group."""
        self.device = self._setup_device()
        torch.manual_seed(settings.seed)
        self.config: Any = AutoConfig.from_pretrained(model_dir)
        self.serving_dtype = served_dtype(settings.serving_dtype, self.config)
        """The dtype of the serving weights (what the engines load)."""
        # Parameters on the meta device (no memory); buffers for real, since some are computed
        # at construction and carried by no checkpoint (rotary frequencies).
        with parameters_on_meta():
            lm: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                self.config, dtype=torch.float32, attn_implementation="sdpa")
        if settings.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lm = lm
        """The causal LM itself (its state-dict names are the checkpoint's)."""
        self.model = self._wrap(PolicyModel(lm, settings.logprob_chunk_tokens))
        materialize(self.model, self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, eps=settings.adam_eps,
                                           weight_decay=settings.weight_decay)
        if is_training_state(model_dir):
            load_training_state(self.lm, self.optimizer, model_dir)
            # The saved state carries the hyperparameters it was made with; a restart with
            # changed settings means the new ones.
            for group in self.optimizer.param_groups:
                group.update(lr=settings.lr, eps=settings.adam_eps, weight_decay=settings.weight_decay)
        else:
            load_safetensors(self.lm, model_dir)
        self._loss_fn = policy_loss(settings.policy_loss)
        self.entropy_control = EntropyControl(settings.entropy_coeff, settings.entropy_target,
                                              settings.entropy_coeff_delta, settings.entropy_coeff_max)
        self._actor = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                                  rollout_n=1, clip_ratio=settings.clip_ratio, clip_ratio_low=settings.clip_ratio,
                                  clip_ratio_high=settings.clip_ratio)
        self._last_weights: list[float] = []

    # -- what an engine changes ------------------------------------------------------------------

    def _setup_device(self) -> torch.device:
        return torch.device(self.settings.device)

    def _wrap(self, model: PolicyModel) -> PolicyModel:
        """Shard the model (in subclasses); it is still on the meta device."""
        return model

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip))

    def _micro_batch_count(self, local: int) -> int:
        """How many micro-batches every rank runs (ranks must agree: each backward is collective)."""
        return local

    def _sum_across_ranks(self, values: list[float]) -> list[float]:
        return values

    # -- the step --------------------------------------------------------------------------------

    def token_logprobs(self, batch: TensorBatch, rows: list[int], *, entropy_grad: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor, Packed]:
        """Current logprobs and entropies of every predicted token of ``rows``, padded per row.

        The rows run as one packed sequence (no padding) and are scored in chunks (no full logits
        tensor); the results come back in the ``(rows, longest - 1)`` layout the losses take. The
        entropies carry gradients only when ``entropy_grad`` is set (an entropy bonus is trained);
        otherwise they are a metric and cost no graph.
        """
        packed = batch.pack(rows, self.device)
        logprobs, entropy = self.model(packed.ids, packed.positions, packed.targets)
        if not (entropy_grad and torch.is_grad_enabled()):
            entropy = entropy.detach()
        return packed.padded(logprobs), packed.padded(entropy.float()), packed

    def train_step(self, batch: TrainBatch | TensorBatch) -> dict[str, float]:
        """One learner step over ``batch``: ``ppo_epochs x ppo_mini_batches`` updates (module docstring).

        Returns:
            The step's metrics, empty when no row has a trained token. ``loss`` and ``grad_norm``
            are means over the updates and are kept when not finite; ``updates`` counts the
            optimizer updates taken, ``nonfinite_updates`` those skipped, and ``nonfinite`` is 1.0
            when every update was skipped, so the weights and the optimizer are exactly as before.
        """
        s = self.settings
        tensors = TensorBatch.of(batch)
        trained = tensors.trained_tokens()
        every = [i for i, n in enumerate(trained) if n > 0]
        if not every:
            return {}
        minis = self._plan(tensors, every, trained)
        totals = _StepTotals()
        # With one update the policy being trained is the proximal one (veRL's actor takes the same
        # shortcut): its own detached logprobs serve, and no extra forward pass is spent.
        proximal = None if len(minis) * s.ppo_epochs == 1 else self._proximal(tensors, minis, totals)
        coeff = self.entropy_control.coeff
        losses: list[float] = []
        norms: list[float] = []
        for _ in range(s.ppo_epochs):
            for index, mini in enumerate(minis):
                loss, norm = self._update(tensors, mini, None if proximal is None else proximal[index], coeff,
                                          totals)
                losses.append(loss)
                norms.append(norm)
        entropy_sum, mask_sum = self._sum_across_ranks([totals.entropy_sum, totals.mask_sum])
        metrics = {k: v / max(totals.proximal_parts, 1) for k, v in totals.correction.items()}
        metrics.update({k: v / max(totals.update_parts, 1) for k, v in totals.losses.items()})
        skipped = len(losses) - totals.updates
        metrics.update({"loss": sum(losses) / len(losses), "entropy": entropy_sum / max(mask_sum, 1.0),
                        "grad_norm": sum(norms) / len(norms), "micro_batches": float(totals.micro_batches),
                        "updates": float(totals.updates), "nonfinite_updates": float(skipped),
                        "nonfinite": 1.0 if totals.updates == 0 else 0.0})
        if self.entropy_control.active:
            # Every rank sees the same summed entropy, so every rank steers to the same coefficient.
            metrics["entropy_coeff"] = coeff
            if totals.updates and math.isfinite(metrics["entropy"]):
                self.entropy_control.update(metrics["entropy"])
        self._last_weights = []
        if totals.weights:
            w = torch.cat(totals.weights)
            self._last_weights = _quantile_sample(w, _WEIGHT_SAMPLE)
            metrics.update({
                "is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()), "is_weight_min": float(w.min()),
                # Kish's effective sample size, as a fraction of the tokens.
                "is_ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if float((w**2).sum()) > 0 else 0.0,
            })
        return {k: v for k, v in metrics.items() if math.isfinite(v) or k in _KEPT_WHEN_NONFINITE}

    def _plan(self, batch: TensorBatch, every: list[int], trained: list[int]) -> list[_MiniBatch]:
        """The step's mini-batches, each with this rank's micro-batches and its veRL normalisation.

        Every rank holds the whole batch, so every rank makes the same mini-batches; each rank then
        trains its share of each mini-batch's rows. As veRL's actor does per mini-batch, the loss
        is normalised by the mini-batch's tokens and rows over all ranks and scaled by dp_size,
        because the gradient reduction averages over ranks (veRL's ``agg_loss`` contract).
        ``seq-mean-token-sum-norm`` divides by the step's longest completion: veRL's default is
        the width of the response tensor, which for the whole step at once is exactly that, and it
        is the same in every micro-batch and mini-batch of the step.
        """
        completions, lengths = batch.completion_lengths(), batch.row_lengths()
        horizon = max(completions[i] for i in every)
        plans: list[_MiniBatch] = []
        for mini in _split(every, self.settings.ppo_mini_batches):
            actor = dataclasses.replace(self._actor, global_batch_info={
                "dp_size": self.world_size, "batch_num_tokens": sum(trained[i] for i in mini),
                "global_batch_size": len(mini), "loss_scale_factor": horizon,
            })
            rows = mini[self.rank::self.world_size]
            plan = plan_micro_batches([lengths[i] for i in rows], self.settings.token_budget) if rows else []
            parts = [[rows[k] for k in part] for part in plan]
            plans.append(_MiniBatch(actor, parts, self._micro_batch_count(len(parts)), mini[0]))
        return plans

    def _part(self, mini: _MiniBatch, index: int) -> tuple[list[int], bool]:
        # A rank with fewer micro-batches than the others runs a zero-weighted one, so that every
        # rank enters the same number of (collective) forward and backward passes.
        if index >= len(mini.parts):
            return [mini.filler], True
        return mini.parts[index], False

    def _correct(self, proximal: torch.Tensor, t: dict[str, torch.Tensor],
                 ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """Rollout correction of the behaviour logprobs towards the proximal ones (veRL's decoupled PPO)."""
        s = self.settings
        return rollout_correction(proximal, t["behavior"], t["mask"], mode=s.rollout_is,
                                  threshold=s.rollout_is_threshold, rejection=s.rollout_rs,
                                  rejection_threshold=s.rollout_rs_threshold)

    def _proximal(self, batch: TensorBatch, minis: list[_MiniBatch], totals: _StepTotals) -> list[list[_Proximal]]:
        """Logprobs, importance weights and masks of every micro-batch before any update, without gradients."""
        out: list[list[_Proximal]] = []
        with torch.no_grad():
            for mini in minis:
                entries: list[_Proximal] = []
                for index in range(mini.count):
                    part, padding = self._part(mini, index)
                    logprobs, entropy, packed = self.token_logprobs(batch, part)
                    t = packed.loss
                    if padding:
                        continue  # the forward is collective under FSDP; its result is not needed
                    weights, mask, corr = self._correct(logprobs, t)
                    totals.add_proximal(entropy, t["mask"], weights, corr)
                    entries.append(_Proximal(logprobs, weights, mask))
                out.append(entries)
        return out

    def _update(self, batch: TensorBatch, mini: _MiniBatch, proximal: list[_Proximal] | None, coeff: float,
                totals: _StepTotals) -> tuple[float, float]:
        """One optimizer update over ``mini``; return its loss and gradient norm.

        A loss or gradient norm that is not finite skips the update, as veRL's FSDP engine does: the
        gradients are dropped and the optimizer is not stepped. Both numbers are the same on every
        rank (the loss summed over ranks, the norm reduced by the clipping), so all ranks skip alike.
        """
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        local_loss = 0.0
        for index in range(mini.count):
            part, padding = self._part(mini, index)
            logprobs, entropy, packed = self.token_logprobs(batch, part, entropy_grad=coeff > 0)
            t = packed.loss
            if proximal is None or padding:
                old = logprobs.detach()
                weights, mask, corr = self._correct(old, t)
                if proximal is None and not padding:
                    totals.add_proximal(entropy, t["mask"], weights, corr)
            else:
                old, weights, mask = proximal[index].logprobs, proximal[index].weights, proximal[index].mask
            loss, loss_metrics = self._loss_fn(
                old_log_prob=old, log_prob=logprobs, advantages=t["advantages"], response_mask=mask,
                loss_agg_mode=s.loss_agg_mode, config=mini.actor, rollout_is_weights=weights,
            )
            if coeff > 0:
                # As veRL's actor does: the bonus is aggregated like the policy loss, over the same
                # (correction-masked) tokens and the same normalisation, over the rows it acts on.
                bonus = agg_loss(loss_mat=entropy, loss_mask=mask * t["bonus_rows"], loss_agg_mode=s.loss_agg_mode,
                                 **mini.actor.global_batch_info)
                loss = loss - coeff * bonus
            totals.micro_batches += 1
            if padding:
                (loss * 0.0).backward()  # type: ignore[no-untyped-call]
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            local_loss += float(loss.detach())
            totals.add_losses(_floats(loss_metrics))
        norm = self._clip_grad_norm()
        # The update's loss is the sum over ranks of their dp_size-scaled parts, divided by dp_size.
        (summed,) = self._sum_across_ranks([local_loss])
        if math.isfinite(norm) and math.isfinite(summed):
            self.optimizer.step()
            totals.updates += 1
        else:
            logger.warning("update skipped: loss %s, gradient norm %s (weights and optimizer left as they were)",
                           summed / self.world_size, norm)
        self.optimizer.zero_grad(set_to_none=True)
        return summed / self.world_size, norm

    def importance_weights(self) -> Sequence[float]:
        """The last step's per-token importance weights, at most ``_WEIGHT_SAMPLE`` evenly spaced quantiles.

        A histogram of them has the batch's distribution without one record per token (a batch of
        long rollouts has hundreds of thousands).
        """
        return list(self._last_weights)

    def save_serving(self, folder: Path) -> None:
        """Serving weights into ``folder``: safetensors in the served dtype, config, tokenizer files.

        What an engine loads and nothing else. Collective under FSDP (each tensor is gathered in
        turn); only rank 0 writes.
        """
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        write_serving_weights(self.lm, folder, self.serving_dtype, self.rank)
        if self.rank == 0:
            write_model_files(self.config, self.serving_dtype, self.model_dir, folder)

    def save_state(self, folder: Path) -> None:
        """Training state into ``folder``: float32 master weights and optimizer state, config, tokenizer files.

        Collective under FSDP: every rank writes its own shards into the same folder; a worker
        made from the folder resumes exactly (on any number of ranks, either engine).
        """
        save_training_state(self.lm, self.optimizer, folder)
        if self.rank == 0:
            write_model_files(self.config, self.serving_dtype, self.model_dir, folder)


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


@dataclasses.dataclass
class _MiniBatch:
    """The rows of one optimizer update, as this rank trains them."""

    actor: ActorConfig
    """veRL's actor config with this mini-batch's normalisation (``global_batch_info``)."""
    parts: list[list[int]]
    """This rank's micro-batches (row indices)."""
    count: int
    """Micro-batches every rank runs: the most any rank has."""
    filler: int
    """What a rank short of micro-batches runs, zero-weighted."""


@dataclasses.dataclass
class _Proximal:
    """A micro-batch's logprobs before the step's first update, and its rollout correction against them."""

    logprobs: torch.Tensor
    weights: torch.Tensor | None
    mask: torch.Tensor


@dataclasses.dataclass
class _StepTotals:
    """What a step's metrics are made of, summed over its micro-batches and updates on this rank."""

    entropy_sum: float = 0.0
    mask_sum: float = 0.0
    correction: dict[str, float] = dataclasses.field(default_factory=dict)
    proximal_parts: int = 0
    weights: list[torch.Tensor] = dataclasses.field(default_factory=list)
    losses: dict[str, float] = dataclasses.field(default_factory=dict)
    update_parts: int = 0
    micro_batches: int = 0
    updates: int = 0

    def add_proximal(self, entropy: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
                     correction: dict[str, float]) -> None:
        """The proximal policy's entropy and the rollout correction of one micro-batch."""
        self.entropy_sum += float((entropy.detach() * mask).sum())
        self.mask_sum += float(mask.sum())
        if weights is not None:
            self.weights.append(weights[mask > 0].detach().flatten())
        for key, value in correction.items():
            self.correction[key] = self.correction.get(key, 0.0) + value
        self.proximal_parts += 1

    def add_losses(self, metrics: dict[str, float]) -> None:
        """Add the policy-loss metrics (veRL's) of one trained micro-batch."""
        for key, value in metrics.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        self.update_parts += 1


def _split(rows: list[int], count: int) -> list[list[int]]:
    """``rows`` in order, as ``count`` (at most one per row) consecutive parts of near-equal row count."""
    count = min(count, len(rows))
    size, extra = divmod(len(rows), count)
    parts: list[list[int]] = []
    start = 0
    for index in range(count):
        stop = start + size + (1 if index < extra else 0)
        parts.append(rows[start:stop])
        start = stop
    return parts
