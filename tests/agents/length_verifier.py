"""A minimal verifier for loop tests: scores the answer's length parity, posts it with the verifier token.

Standard library only. The score (1.0 for an even number of characters, else 0.0) differs between
rollouts of one group often enough for advantages to be non-zero.
"""

import json
import os
import sys
import urllib.request
from pathlib import Path


def main() -> int:
    answer = Path("answer.txt").read_text() if Path("answer.txt").is_file() else ""
    body = {"value": 1.0 if len(answer) % 2 == 0 else 0.0, "info": {"chars": len(answer)}}
    request = urllib.request.Request(
        os.environ["OPENFORGE_REWARD_URL"], data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {os.environ['OPENFORGE_VERIFIER_TOKEN']}",
                 "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
