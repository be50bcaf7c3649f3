"""A tiny harness for tests: an OpenAI-SDK agent that makes two calls and writes an answer file.

It is configured the way real harnesses are: only OPENAI_BASE_URL and OPENAI_API_KEY (read by
the SDK itself). The instruction comes as the first argument. Usage: echo_agent.py INSTRUCTION
"""

import sys
from pathlib import Path

from openai import OpenAI


def main() -> int:
    instruction = sys.argv[1] if len(sys.argv) > 1 else "say hello"
    client = OpenAI(max_retries=2, timeout=60)
    messages = [{"role": "user", "content": instruction}]
    first = client.chat.completions.create(model="echo-agent", messages=messages, max_tokens=8, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Now give your final answer."}]
    second = client.chat.completions.create(model="echo-agent", messages=messages, max_tokens=8, temperature=1.0)
    Path("answer.txt").write_text(second.choices[0].message.content or "(empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
