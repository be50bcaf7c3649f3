"""A small tool-using harness for tests: an OpenAI-SDK agent with one shell tool, writing an answer file.

Configured as real harnesses are, by OPENAI_BASE_URL and OPENAI_API_KEY only. It offers a ``shell``
tool, runs each command the model asks for in the workspace (its output and exit code go back as
the tool result) and writes the model's final text to answer.txt.

With ``--move-context`` every request ends with a context message that is put after the newest turn
each time, as OpenClaw does with its internal context: every call after the first breaks the
token prefix (the assembler names it ``message_moved``). With ``--move-context-once`` it moves
only once, after the first turn, and stays where it is from then on: one break, and the calls
after it merge again.

Usage: tool_agent.py [--move-context | --move-context-once] INSTRUCTION
"""

import json
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a shell command in the workspace.",
                                          "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                         "required": ["command"]}}}


def run(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30, check=False)
    return f"{done.stdout}{done.stderr}Exit code: {done.returncode}"


def main() -> int:
    args = sys.argv[1:]
    move = "--move-context" in args
    once = "--move-context-once" in args
    pinned = 0
    instruction = next((a for a in args if not a.startswith("--")), "Run the command.")
    client = OpenAI(max_retries=2, timeout=60)
    messages: list[dict] = [{"role": "system", "content": "You are a careful agent with a shell."},
                            {"role": "user", "content": instruction}]
    for turn in range(4):
        sent = messages
        if move:
            sent = [*messages, {"role": "user", "content": f"[context] turn {turn}"}]
        elif once:
            if turn <= 1:
                pinned = len(messages)
            sent = [*messages[:pinned], {"role": "user", "content": "[context] the session"}, *messages[pinned:]]
        reply = client.chat.completions.create(model="tool-agent", messages=sent, tools=[SHELL], max_tokens=64)
        message = reply.choices[0].message
        if not message.tool_calls:
            Path("answer.txt").write_text(message.content or "")
            return 0
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [{"id": c.id, "type": "function",
                                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                        for c in message.tool_calls]})
        for call in message.tool_calls:
            command = json.loads(call.function.arguments).get("command", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run(command)})
    Path("answer.txt").write_text("(no final answer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
