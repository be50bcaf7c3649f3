"""The entropy bonus's coefficient: fixed, or steered toward a target entropy.

A fixed coefficient has a narrow useful range on a small model trained at a large step size: too
small and sampling collapses onto one answer (every rollout of a group alike, GRPO's advantages
zero, learning over); too large and the bonus holds the policy near uniform. Steering the
coefficient instead (adaptive entropy control, as in Skywork-OR1) lets the policy sharpen freely
while its entropy is above the target and pushes back, harder each step, once it falls below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EntropyControl"]


@dataclass
class EntropyControl:
    """The coefficient for the next step, updated from each step's mean token entropy."""

    coeff: float
    """Current coefficient (starts at ``entropy_coeff``)."""
    target: float | None = None
    """Entropy in nats per token to hold the policy at or above; None keeps ``coeff`` fixed."""
    delta: float = 0.005
    """Change of the coefficient per step."""
    max_coeff: float = 0.1
    """Upper bound, so a policy whose entropy cannot rise does not drown its policy loss."""

    def __post_init__(self) -> None:
        if self.coeff < 0 or self.delta < 0 or self.max_coeff < 0:
            raise ValueError("entropy coefficient, its step and its bound must not be negative")
        if self.target is not None and self.target < 0:
            raise ValueError(f"entropy target must not be negative, got {self.target}")

    @property
    def active(self) -> bool:
        """Whether the bonus can ever be non-zero (it then costs a differentiable entropy)."""
        return self.coeff > 0 or (self.target is not None and self.delta > 0 and self.max_coeff > 0)

    def update(self, entropy: float) -> float:
        """Move the coefficient after a step whose mean token entropy was ``entropy``; return it.

        Below the target it rises by ``delta``, at or above it falls by ``delta``, within
        ``[0, max_coeff]``. A fixed coefficient (no target) and a non-finite entropy (an empty
        step) leave it as it is.
        """
        if self.target is None or not math.isfinite(entropy):
            return self.coeff
        step = self.delta if entropy < self.target else -self.delta
        self.coeff = min(self.max_coeff, max(0.0, self.coeff + step))
        return self.coeff
