"""The built-in toy harness: two turns against an OpenAI-compatible endpoint, one tool on both.

It behaves like any agent harness the proxy serves: it reads ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``, offers one tool (``secret``), runs it when the model calls it, and otherwise
hands the tool's answer back as a user turn, since a tiny random model cannot yet form a tool call.
The final answer and a transcript go into the working directory for the verifier.

Run as ``python -m openforge.toy.harness "instruction"`` (the instruction may also come from
``OPENFORGE_INSTRUCTION``). Imports only httpx, so each rollout's process starts fast.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

ANSWER_FILE = "answer.txt"
TRANSCRIPT_FILE = "transcript.json"

SYSTEM_PROMPT = "You are a terse assistant with one tool."

SECRET_TOOL = {"type": "function", "function": {
    "name": "secret", "description": "Reveal the secret word.",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def tool_answer_turn(word: str) -> dict[str, Any]:
    """The user turn that hands over the tool's answer when the model did not call the tool."""
    return {"role": "user", "content": f"The secret tool says: {word}. Answer now."}


def _chat(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/chat/completions", json=body)
    if resp.status_code >= 400:
        raise SystemExit(f"harness: the model endpoint answered {resp.status_code}: {resp.text[:300]}")
    data: dict[str, Any] = resp.json()
    return data


def main(argv: list[str] | None = None) -> int:
    """Run the two turns; exit 0 when an answer was written."""
    args = sys.argv[1:] if argv is None else argv
    instruction = " ".join(args) or os.environ.get("OPENFORGE_INSTRUCTION", "")
    base, key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    word, model = os.environ.get("OPENFORGE_TOY_WORD"), os.environ.get("OPENFORGE_TOY_MODEL", "")
    if not (base and key and word and instruction):
        print("harness: needs OPENAI_BASE_URL, OPENAI_API_KEY, OPENFORGE_TOY_WORD and an instruction",
              file=sys.stderr)
        return 2
    max_tokens = int(os.environ.get("OPENFORGE_TOY_MAX_TOKENS", "16"))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": instruction},
    ]
    with httpx.Client(base_url=base.rstrip("/"), headers={"authorization": f"Bearer {key}"},
                      timeout=120) as client:
        first = _chat(client, {"model": model, "messages": messages, "tools": [SECRET_TOOL],
                               "max_tokens": max_tokens, "temperature": 1.0})
        reply = first["choices"][0]["message"]
        calls = reply.get("tool_calls") or []
        if calls:
            messages.append({"role": "assistant", "content": reply.get("content"), "tool_calls": calls})
            messages.extend({"role": "tool", "tool_call_id": c["id"], "content": word} for c in calls)
        else:
            messages.append({"role": "assistant", "content": reply.get("content") or ""})
            messages.append(tool_answer_turn(word))
        # The same tools as the first call: a request whose tools changed renders another system
        # prompt, so its prompt could never extend the first call's and the two turns would train
        # as separate samples.
        second = _chat(client, {"model": model, "messages": messages, "tools": [SECRET_TOOL],
                                "max_tokens": max_tokens, "temperature": 1.0})
    answer = second["choices"][0]["message"].get("content") or ""
    messages.append({"role": "assistant", "content": answer})
    Path(ANSWER_FILE).write_text(answer, encoding="utf-8")
    Path(TRANSCRIPT_FILE).write_text(json.dumps(messages, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
