"""One rollout of the loop benchmark (``bench.loop``): its harness, or its verifier.

Standard library only and started without ``site``, so a rollout costs the machine little more
than its model calls. The launcher runs it as a task's harness and verifier commands:

    loop_rollout.py harness MODEL TURNS MAX_TOKENS
    loop_rollout.py verifier

The task's harness environment carries the drawn duration of each member of its group
(``BENCH_LOOP_DURATIONS``: seconds, comma-separated, by group index); a rollout finds its own by
its group index, the last part of its rollout id (``consumers.rollouts.launcher.rollout_id_for``).
The harness spreads that duration around its model calls: it sleeps a share before each call
and one after the last, as an agent thinks, runs tools and checks its work. The verifier scores
even group indexes 1 and odd ones 0, so no group's rewards are all alike.
"""

import json
import os
import sys
import time
import urllib.request
from typing import Any

DURATIONS = "BENCH_LOOP_DURATIONS"


def group_index() -> int:
    return int(os.environ["OPENFORGE_ROLLOUT_ID"].rsplit("-", 1)[1])


def post(url: str, token: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "authorization": f"Bearer {token}", "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read() or b"{}")


def harness(model: str, turns: int, max_tokens: int) -> None:
    duration = float(os.environ[DURATIONS].split(",")[group_index()])
    share = duration / (turns + 1)
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    messages = [{"role": "user", "content": os.environ.get("OPENFORGE_INSTRUCTION", "work")}]
    for _ in range(turns):
        time.sleep(share)
        answer = post(url, os.environ["OPENAI_API_KEY"], {"model": model, "messages": messages,
                                                          "max_tokens": max_tokens})
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": "go on"}]
    time.sleep(share)


def verifier() -> None:
    post(os.environ["OPENFORGE_REWARD_URL"], os.environ["OPENFORGE_VERIFIER_TOKEN"],
         {"value": 1.0 if group_index() % 2 == 0 else 0.0})


def main() -> int:
    if sys.argv[1:2] == ["harness"] and len(sys.argv) == 5:
        harness(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:] == ["verifier"]:
        verifier()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
