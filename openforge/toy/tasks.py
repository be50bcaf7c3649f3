"""The toy task suite: a few tasks that share one letter set, run by the built-in harness."""

from __future__ import annotations

import sys

from schemas.task.v1 import HarnessSpec, LocalLaunch, TaskV1, VerifierSpec

__all__ = ["ENV_MAX_TOKENS", "ENV_MODEL", "ENV_WORD", "SECRET_WORDS", "toy_tasks"]

SECRET_WORDS = ("mid", "dim", "midi")
"""One letter set ({d, i, m}) behind every word, so what the policy learns on one task helps the
others and the group statistics of every task move together on the plot. ``d``, ``i`` and ``m``
make up about 11% of the characters of the tiny model's vocabulary, so a random policy starts near
0.11.

The set is chosen against the reward's trap. The reward counts characters, so early on a long
token with a middling share of the letters raises it more than a short pure one, and a policy
that sharpens onto such a token stays there: with {e, s} one seed collapsed onto ``message``
(4 of 7 letters, reward 0.57) every time. With {d, i, m} the tokens that raise the reward most from
a random start are mostly pure (``mimi``, ``midi``, ``didi``; the twenty best average 0.92), so
the early drift already heads for the optimum."""

INSTRUCTION = "Find the secret word with your tool, then answer using only its letters."
"""What every toy task asks."""

ENV_WORD = "OPENFORGE_TOY_WORD"
"""The secret word: the harness's tool returns it, the verifier scores against it."""
ENV_MODEL = "OPENFORGE_TOY_MODEL"
"""Model name the harness asks for."""
ENV_MAX_TOKENS = "OPENFORGE_TOY_MAX_TOKENS"
"""Token limit of each of the harness's calls."""


def toy_tasks(*, run_id: str, rounds: int, group_size: int, model: str, max_tokens: int = 16,
              timeout_s: float = 60.0, python: str | None = None) -> list[TaskV1]:
    """Return ``rounds`` passes over the suite as tasks with unique ids.

    Args:
        run_id: Experiment run, also the prefix of every task id.
        rounds: How many times each secret word is asked.
        group_size: Rollouts per task (GRPO's group).
        model: Served model name.
        max_tokens: Limit of each call; short answers keep rollouts fast on CPU.
        timeout_s: Deadline of one rollout.
        python: Interpreter that runs harness and verifier (this one by default).
    """
    exe = python or sys.executable
    tasks = []
    for r in range(rounds):
        for w, word in enumerate(SECRET_WORDS):
            tasks.append(TaskV1(
                task_id=f"{run_id}-r{r:04d}-w{w}", run_id=run_id,
                instruction=INSTRUCTION,
                harness=HarnessSpec(
                    name="openforge-toy",
                    launch=LocalLaunch(command=[exe, "-m", "openforge.toy.harness"]),
                    env={ENV_WORD: word, ENV_MODEL: model, ENV_MAX_TOKENS: str(max_tokens)},
                ),
                verifier=VerifierSpec(command=[exe, "-m", "openforge.toy.verifier"], timeout_s=30),
                group_size=group_size, timeout_s=timeout_s,
                metadata={"suite": "toy-letters", "round": r, "word": word},
            ))
    return tasks
