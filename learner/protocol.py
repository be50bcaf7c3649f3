"""The one batch type that crosses from the trainer (control loop) to a worker (the model).

As veRL's ``DataProto`` does for its workers, this keeps the engine swappable: the trainer decides
what trains and with which advantage; a worker only turns rows into gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """One training sequence: prompt plus completion, with per-completion-token mask and logprobs."""

    input_ids: list[int]
    """Prompt ids followed by completion ids."""
    prompt_len: int
    """How many leading ids are prompt (never trained)."""
    loss_mask: list[int]
    """1 per trained completion token, aligned with the completion."""
    behavior_logprobs: list[float]
    """Engine logprob per completion token (0.0 where masked)."""
    advantage: float
    """The trajectory's advantage, applied to each of its trained tokens."""
    entropy_bonus: bool = True
    """Whether the step's entropy bonus acts on this row's tokens (see ``entropy_bonus_scope``)."""

    def __post_init__(self) -> None:
        completion = len(self.input_ids) - self.prompt_len
        if self.prompt_len < 1:
            raise ValueError("a row needs at least one prompt token to predict the first completion token")
        if completion != len(self.loss_mask) or completion != len(self.behavior_logprobs):
            raise ValueError(
                f"row has {completion} completion tokens but {len(self.loss_mask)} mask values and "
                f"{len(self.behavior_logprobs)} logprobs"
            )

    @property
    def trained_tokens(self) -> int:
        """Completion tokens with mask 1."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class TrainBatch:
    """Everything one optimizer step trains on."""

    rows: list[Row]
    """Sequences of the step, in any order."""
    info: dict[str, float] = field(default_factory=dict)
    """Trainer-side statistics (reward mean, staleness, drops) to report with the step's metrics."""

    @property
    def trained_tokens(self) -> int:
        """Trained tokens over all rows: the normaliser of a token-mean loss over the whole step."""
        return sum(r.trained_tokens for r in self.rows)

    @property
    def total_tokens(self) -> int:
        """Every token of every row (prompt included): what the forward passes process."""
        return sum(len(r.input_ids) for r in self.rows)
