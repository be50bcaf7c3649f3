"""Learner settings (``OPENFORGE_LEARNER_*``), read from the environment in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stream.broker import cache_root


class LearnerSettings(BaseSettings):
    """What the learner trains, how, and how it paces, bounds and saves its work."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_LEARNER_", frozen=True, extra="ignore")

    model_name: str = Field(default="tiny", min_length=1, max_length=256)
    """Model name as the engine serves it; the key of its checkpoints on the checkpoints topic."""

    model_dir: Path | None = None
    """Hugging Face folder of the initial weights and tokenizer. Needed on a fresh start; on a
    restart the latest published checkpoint is loaded instead."""

    checkpoint_dir: Path | None = None
    """Where checkpoint folders are written; defaults to ``<cache>/checkpoints/<model_name>``.
    Must be readable by the checkpoint publisher and the engines."""

    engine: Literal["hf", "fsdp"] = "hf"
    """Training engine: ``hf`` (transformers model, one device) or ``fsdp`` (FSDP2 sharding through
    veRL's fsdp helpers; one process or ``torchrun``, GPUs or CPU)."""

    device: str = "cpu"
    """torch device (``cpu``, ``cuda``, ``cuda:1``). The ``fsdp`` engine under ``torchrun`` uses
    ``cuda:<local rank>`` whatever index is given."""

    fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32"
    """``fsdp`` engine: dtype of the forward/backward compute (FSDP2 mixed precision). Master
    weights, gradient reduction, optimizer state and training states stay float32; ``bfloat16`` is
    the usual choice on GPUs, ``float32`` matches the ``hf`` engine exactly."""

    serving_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the serving weights written at each publish (what the engines load): ``auto`` is
    the dtype the initial model's config names (bfloat16 for released models, float32 for the
    tiny test model). Training state always keeps float32 master weights."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    activation memory of one layer instead of all, for about a third more compute."""

    logprob_chunk_tokens: int = Field(default=512, ge=1)
    """Tokens whose logits exist at once while logprobs and entropies are computed (a chunk's
    float32 logits are this x the vocabulary, 311 MB at Qwen's 152k; the full tensor is never
    made, forward or backward)."""

    seed: int = 0
    """Seeds torch before the model is loaded, for reproducible runs."""

    lr: float = Field(default=1e-5, ge=0)
    """AdamW learning rate. 0 runs every step (losses, metrics, checkpoints, publishes) but leaves the
    weights exactly as they were: a control run, whose reward shows what the loop does without learning."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""

    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon (torch's default). AdamW scales every parameter's step to about the
    learning rate whatever its gradient's size, so parameters whose gradients have always been
    tiny (the output rows of tokens a sharp policy never samples) move as far as any other once
    something consistent pushes them, an entropy bonus for one; a larger epsilon (PPO
    implementations commonly use 1e-5) lets such gradients make correspondingly small steps."""

    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm is clipped to this before each step; bounds the damage of an outlier batch."""

    checkpoint_every: int = Field(default=10, ge=1)
    """Publish every this many optimizer steps: serving weights (safetensors in the served dtype)
    and a checkpoint event, the next weight version."""

    state_every: int = Field(default=10, ge=1)
    """Write a training state (float32 master weights, optimizer state, consumed offsets) every
    this many optimizer steps, and when the learner stops. A restart resumes from the newest one;
    the steps after it are trained again (from the same trajectories), never lost."""

    serving_keep_last: int = Field(default=3, ge=1)
    """Retention: serving-weight folders of the newest this many published versions are kept.
    At least 2 keeps the version before the newest for a rollback; more covers publishes that
    come faster than an engine reloads (a folder must outlive every reload of it)."""

    serving_keep_every: int | None = Field(default=None, ge=1)
    """Retention: also keep the serving weights of every version divisible by this (None: none)."""

    state_keep_last: int = Field(default=2, ge=1)
    """Retention: the newest this many training states are kept."""

    state_keep_every: int | None = Field(default=None, ge=1)
    """Retention: also keep every training state whose step is divisible by this (None: none)."""

    max_staleness: int = Field(default=4, ge=0)
    """Largest trained token age, in published versions: a token sampled by version v trains while
    the newest published version is at most v + max_staleness. Older tokens are masked out of the
    loss and counted (importance weights stop correcting them well); a trajectory left with no
    trainable token is dropped. Versions count publishes (0 is the initial weights, each
    checkpoint the next), so a stale token is one whose engine had been updated more than this
    many times since it sampled, whatever ``checkpoint_every`` is."""

    unversioned_as: int = Field(default=0, ge=0)
    """Version assumed for tokens whose engine version is missing or not a decimal integer (the
    base model's label): 0 means the initial weights."""

    progress_interval_s: float = Field(default=1.0, gt=0)
    """Besides after every step, the learner publishes its progress (newest version, steps,
    trajectories waiting) at most this often while it reads, so the launcher can pace rollouts."""

    token_budget: int = Field(default=8192, ge=16)
    """Tokens per micro-batch; bounds activation memory. A micro-batch's rows run packed into one
    sequence, without padding. A longer row than this trains alone."""

    groups_per_step: int = Field(default=4, ge=1)
    """Task groups per optimizer step."""

    batch_wait_s: float = Field(default=30.0, gt=0)
    """A step starts with fewer groups when the oldest ready group has waited this long."""

    group_grace_s: float = Field(default=60.0, ge=0)
    """A group waits for its stragglers until its first trajectory's arrival plus the task's
    timeout (carried by every trajectory) plus this grace, which covers launch skew and the
    assembler's latency. Then it is released with the members it has (see ``min_group_size``);
    a member arriving later is dropped as ``late_member``."""

    group_timeout_s: float = Field(default=120.0, gt=0)
    """The wait for stragglers of trajectories that carry no task timeout (written before tasks
    carried one to their trajectories)."""

    min_group_size: int = Field(default=2, ge=1)
    """Groups with fewer usable trajectories are dropped (a baseline from one sample is noise). The
    same rule holds for a group released short at its deadline: it trains with the members it
    has when at least this many are usable, else its members are dropped as ``small_group``."""

    missing_reward: float = 0.0
    """Reward of a trajectory that arrived without one (e.g. the agent failed); infrastructure
    failures are excluded instead."""

    advantage_estimator: str = "grpo"
    """veRL advantage estimator by name (``grpo``, ``rloo``, ``grpo_passk``, ...): outcome estimators
    that need only rewards and the group index."""

    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std (False gives Dr. GRPO)."""

    filter_alike_groups: bool = False
    """Leave out groups whose trajectories all got the same reward (DAPO's dynamic sampling,
    veRL's ``algorithm.filter_groups``), counted as dropped ``alike_group``. Their advantages are
    zero, so they add nothing to the policy gradient, yet they dilute the step's token-mean
    normalisation and carry the entropy bonus; a step made only of them is not taken at all. That
    last part is what matters once a policy has solved its tasks: a step with no signal but the
    bonus is still a full-size AdamW step, and a few of them undo what was learned. With
    ``entropy_bonus_scope="stuck"`` the alike groups below ``max_reward`` stay in (see there)."""

    max_reward: float | None = None
    """The verifier's best score, when it has one (1.0 for pass/fail and share-of-credit verifiers).
    It tells a solved group (every trajectory scored it) from a stuck one (every trajectory scored
    the same lower reward); only ``entropy_bonus_scope="stuck"`` uses it."""

    entropy_bonus_scope: Literal["all", "stuck"] = "all"
    """Where the entropy bonus acts. ``all``: on every trained token (veRL's actor). ``stuck``: only on
    the tokens of stuck groups (needs ``max_reward`` and ``filter_alike_groups``), which then stay in
    the step with zero advantage instead of being left out. A policy that has sharpened onto a
    partial answer gets no gradient from its alike groups; the bonus there spreads its sampling
    until some rollout scores differently. Groups that are still learning, or solved, get no bonus:
    on them the bonus fights a policy loss that is already small, and near the optimum it wins and
    undoes the policy (docs/demo.md)."""

    policy_loss: str = "vanilla"
    """veRL policy loss by name (``vanilla``, ``gspo``, ``cispo``, ...)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How veRL aggregates the per-token loss; normalised over each update's whole mini-batch (the
    whole step by default), never per micro-batch. ``seq-mean-token-sum-norm`` divides by the
    step's longest completion (veRL's ``loss_scale_factor``; its default, the response width, for
    the step taken at once)."""

    clip_ratio: float = Field(default=0.2, gt=0)
    """PPO clip range of the policy loss. It acts from a step's second optimizer update on (see
    ``ppo_mini_batches`` and ``ppo_epochs``); a step with one update has nothing to clip."""

    ppo_mini_batches: int = Field(default=1, ge=1)
    """Mini-batches per learner step (veRL's ``ppo_mini_batch_size`` as a count): the step's rows are
    split into this many parts of near-equal row count, each an optimizer update of its own,
    normalised over its own tokens and rows. A step with fewer rows has one mini-batch per row."""

    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the step's mini-batches (veRL's ``ppo_epochs``). A step makes
    ``ppo_epochs x ppo_mini_batches`` optimizer updates and still publishes one weight version;
    the proximal logprobs of every update are the policy's before the first one. The defaults (one
    and one) take one on-policy update per step."""

    entropy_coeff: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus subtracted from the loss (veRL's ``entropy_coeff``), aggregated
    like the policy loss; the starting weight when ``entropy_target`` is set. Zero (veRL's default)
    leaves it out; a small model trained at a large step size needs it, or its sampling collapses
    onto one answer and GRPO's advantages vanish."""

    entropy_target: float | None = Field(default=None, ge=0)
    """Adaptive entropy control: after each step the coefficient rises by ``entropy_coeff_delta``
    while the step's mean token entropy (nats) is below this, and falls by it otherwise, within
    ``[0, entropy_coeff_max]``. None keeps the coefficient fixed. A restart begins again from
    ``entropy_coeff``."""

    entropy_coeff_delta: float = Field(default=0.005, ge=0)
    """Adaptive entropy control: change of the coefficient per step."""

    entropy_coeff_max: float = Field(default=0.1, ge=0)
    """Adaptive entropy control: upper bound of the coefficient."""

    rollout_is: Literal["token", "sequence", "none"] = "token"
    """Rollout correction (veRL ``rollout_corr_helper``): importance weights per token (truncated IS,
    the default), per sequence, or none."""

    rollout_is_threshold: str = "2.0"
    """Upper bound of the importance weights (truncation); ``"lower_upper"`` selects IcePop."""

    rollout_rs: str | None = None
    """Optional veRL rejection-sampling modes (comma separated); None disables rejection."""

    rollout_rs_threshold: str | None = None
    """Thresholds for ``rollout_rs``, one per mode."""

    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many steps in this process (benchmarks, tests); None runs until stopped."""

    prefetch_records: int = Field(default=4096, ge=1)
    """Decoded trajectories buffered ahead of training, so fetching overlaps with the step."""

    drain_timeout_s: float = Field(default=60.0, gt=0)
    """How long ``stop()`` lets the running step finish before giving up on it (the step is then
    lost and redone after restart, since no checkpoint recorded it)."""

    rank_timeout_s: float = Field(default=600.0, gt=0)
    """Several ranks (``torchrun``): how long a collective may wait for a peer before it fails, so a
    rank that died or hung ends the others with an error instead of leaving them blocked. Must
    exceed the longest legitimate wait: rank 0 writing a checkpoint's files while the others wait
    for its next message. Rank 0 sends a keep-alive every quarter of it while no batch is due."""

    @model_validator(mode="after")
    def _thresholds(self) -> Self:
        if (self.rollout_rs is None) != (self.rollout_rs_threshold is None):
            raise ValueError("rollout_rs and rollout_rs_threshold must be set together")
        if self.entropy_bonus_scope == "stuck" and (self.max_reward is None or not self.filter_alike_groups):
            raise ValueError("entropy_bonus_scope='stuck' needs max_reward (to tell stuck groups from solved "
                             "ones) and filter_alike_groups=true (solved groups are left out)")
        return self

    def resolved_checkpoint_dir(self) -> Path:
        """``checkpoint_dir``, or the default folder under the cache."""
        return self.checkpoint_dir or cache_root() / "checkpoints" / self.model_name
