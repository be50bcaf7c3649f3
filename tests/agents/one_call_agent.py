"""A minimal harness for loop tests: one chat call through the proxy, the answer written to a file.

Standard library only, so a rollout costs little more than the call itself. It reads what the
launcher gives every harness: OPENAI_BASE_URL, OPENAI_API_KEY and the instruction. Usage:
one_call_agent.py MODEL MAX_TOKENS
"""

import json
import os
import sys
import urllib.request
from pathlib import Path


def main() -> int:
    model, max_tokens = sys.argv[1], int(sys.argv[2])
    body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0,
            "messages": [{"role": "user", "content": os.environ.get("OPENFORGE_INSTRUCTION", "say hello")}]}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())["choices"][0]["message"]["content"] or ""
    Path("answer.txt").write_text(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
