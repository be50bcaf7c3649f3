"""The toy verifier: scores the harness's answer and reports the reward to the proxy.

It runs after the harness in the same workspace, with the verifier credential the harness never
saw. A missing answer is a harness failure, not a zero: the verifier exits non-zero and reports
nothing, so the lifecycle says what happened and no reward is invented.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from openforge.toy.harness import ANSWER_FILE
from openforge.toy.scoring import score_answer
from openforge.toy.tasks import ENV_WORD


def main() -> int:
    """Score ``answer.txt`` and post the reward; exit non-zero when there is nothing to score."""
    from producers.reward_client import RewardError, post_reward

    word = os.environ.get(ENV_WORD)
    answer_path = Path(ANSWER_FILE)
    if not word:
        print(f"verifier: {ENV_WORD} is not set", file=sys.stderr)
        return 2
    if not answer_path.is_file():
        print(f"verifier: the harness wrote no {ANSWER_FILE}", file=sys.stderr)
        return 3
    answer = answer_path.read_text(encoding="utf-8")
    value = score_answer(answer, word)
    try:
        post_reward(value, {"answer": answer[:200], "word": word})
    except RewardError as exc:
        print(f"verifier: {exc}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
