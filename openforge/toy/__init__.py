"""The demo's built-in toy task suite: a small multi-turn harness with one tool, and its verifier.

Why this task: a tiny randomly initialised model (about 1.3M parameters) on two CPU cores has to
show learning by RL alone within minutes. Sparse rewards (an exact word, a well-formed tool call)
stay at zero from random init, so the reward is dense: the share of the final answer's characters
that are letters of the secret word the tool reveals. A random model scores about 0.17 (the two
letters are common ones); a policy that learns to emit only those letters scores 1.0. Every sampled
token moves the reward a little, which is what makes the curve rise within the demo's minutes.
"""

from openforge.toy.scoring import score_answer
from openforge.toy.tasks import SECRET_WORDS, toy_tasks

__all__ = ["SECRET_WORDS", "score_answer", "toy_tasks"]
