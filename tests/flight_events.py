"""Rollouts of tool-using agents as recorded call events, with a consistent fake template and tokenizer.

Each call's prompt is the tokenized rendering of its messages; the completion is the tokenized
rendering of the answer, so a harness that keeps its history unchanged yields prompts that extend
the previous prompt and completion token for token (the assembler merges them), and one that
rewrites it breaks the prefix the way real harnesses do. Used by the assembler's, the flight
recorder's and the report's tests and by the UI benchmark.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from schemas import ModelCallV1, RewardV1, RolloutEventV1, WeightVersionRange
from schemas.call.v1 import ApiProtocol, CallChoice, CallStatus, CallTimings, CallUsage, NormalizedRequest
from schemas.rollout.v1 import Backend, RolloutPhase, RolloutReason

T0 = datetime(2026, 1, 1, tzinfo=UTC)
VOCAB = 4096
_PIECE = re.compile(r"\w+|[^\w\s]|\s+")

SHELL_TOOL = {"type": "function", "function": {"name": "shell", "description": "Run a shell command.",
                                                "parameters": {"type": "object", "properties": {
                                                    "command": {"type": "string"}}, "required": ["command"]}}}


def tokenize(text: str) -> list[int]:
    """Fake token ids: each word, mark or whitespace run hashed into a small vocabulary."""
    return [10 + zlib.crc32(p.encode()) % (VOCAB - 10) for p in _PIECE.findall(text)]


def _message_text(message: dict[str, Any]) -> str:
    calls = "".join(f"<tool_call>{c['function']['name']} {c['function']['arguments']}</tool_call>"
                    for c in message.get("tool_calls") or [])
    return f"{message.get('content') or ''}{calls}<|end|>"


def render(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str:
    """The fake template: tools first, each message, then the generation prompt."""
    head = "<|tools|>" + orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode() + "<|end|>" if tools else ""
    return head + "".join(f"<|{m['role']}|>{_message_text(m)}" for m in messages) + "<|assistant|>"


@dataclass
class Turn:
    """One answer of the model and what the harness does with it.

    ``command`` makes the answer a tool call and ``result`` the tool's output (``is_error`` flags it
    the Anthropic way); without ``command`` the answer is final ``text``.
    """

    command: str | None = None
    result: str = ""
    is_error: bool = False
    text: str = "done"
    tool: str = "shell"


@dataclass
class Recorded:
    """The events of one rollout."""

    calls: list[ModelCallV1] = field(default_factory=list)
    lifecycle: list[RolloutEventV1] = field(default_factory=list)
    reward: RewardV1 | None = None

    def events(self) -> list[Any]:
        """Lifecycle, calls and reward in the order a run produces them."""
        first, rest = self.lifecycle[:2], self.lifecycle[2:]
        return [*first, *self.calls, *rest, *([self.reward] if self.reward else [])]


def tool_rollout(rollout_id: str, turns: Sequence[Turn], *, task_id: str = "task-1", run_id: str | None = "run-1",
                 harness: str = "agent", group_index: int = 0, group_size: int = 1, reward: float | None = 1.0,
                 start_s: float = 0.0, moving_context: bool = False, protocol: ApiProtocol = ApiProtocol.OPENAI_CHAT,
                 version: str = "1", instruction: str = "Fix the failing test.") -> Recorded:
    """A rollout of ``turns``, recorded as a harness would make it.

    Args:
        moving_context: Put a context message at the end of every request, moved after the newest turn
            each time (as OpenClaw does): every call after the first breaks the prefix.
        protocol: The protocol on the events; with Anthropic Messages, ``is_error`` travels on the
            tool message as the proxy's translation keeps it.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": instruction}]
    recorded = Recorded()
    at = start_s
    recorded.lifecycle.append(RolloutEventV1(
        rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=group_index, group_size=group_size,
        harness=harness, phase=RolloutPhase.SCHEDULED, backend=Backend.LOCAL, created_at=T0 + timedelta(seconds=at)))
    recorded.lifecycle.append(RolloutEventV1(
        rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=group_index, group_size=group_size,
        harness=harness, phase=RolloutPhase.RUNNING, backend=Backend.LOCAL, created_at=T0 + timedelta(seconds=at)))
    for i, turn in enumerate(turns):
        sent = list(messages)
        if moving_context:
            sent.append({"role": "user", "content": f"[context] turn {i} of the session"})
        if turn.command is not None:
            answer: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"{rollout_id}-t{i}", "type": "function",
                 "function": {"name": turn.tool, "arguments": orjson.dumps({"command": turn.command}).decode()}}]}
        else:
            answer = {"role": "assistant", "content": turn.text}
        prompt = tokenize(render(sent, [SHELL_TOOL]))
        completion = tokenize(_message_text(answer))
        at += 1.0
        recorded.calls.append(ModelCallV1(
            rollout_id=rollout_id, task_id=task_id, call_id=f"{rollout_id}-c{i}", protocol=protocol, model="tiny",
            request=NormalizedRequest(messages=sent, tools=[SHELL_TOOL]),
            response={"id": f"chatcmpl-{i}", "choices": [{"index": 0, "message": answer,
                                                          "finish_reason": "tool_calls" if turn.command else "stop"}]},
            prompt_token_ids=prompt,
            choices=[CallChoice(index=0, completion_token_ids=completion,
                                logprobs=[-((t % 97) + 1) / 100.0 for t in completion],
                                weight_versions=[WeightVersionRange(version=version, start=0, end=len(completion))],
                                finish_reason="tool_calls" if turn.command else "stop")],
            usage=CallUsage(prompt_tokens=len(prompt), completion_tokens=len(completion)),
            timings=CallTimings(started_at=T0 + timedelta(seconds=at), total_s=0.5, time_to_first_token_s=0.1),
            status=CallStatus.OK, created_at=T0 + timedelta(seconds=at + 0.5)))
        messages.append(answer)
        if turn.command is not None:
            result: dict[str, Any] = {"role": "tool", "tool_call_id": f"{rollout_id}-t{i}", "content": turn.result}
            if turn.is_error and protocol is ApiProtocol.ANTHROPIC_MESSAGES:
                result["is_error"] = True
            messages.append(result)
    at += 1.0
    done = RolloutEventV1(rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=group_index,
                          group_size=group_size, harness=harness, phase=RolloutPhase.SUCCEEDED, backend=Backend.LOCAL,
                          harness_exit_code=0, verifier_exit_code=0, created_at=T0 + timedelta(seconds=at))
    recorded.lifecycle.append(done)
    if reward is not None:
        recorded.reward = RewardV1(rollout_id=rollout_id, task_id=task_id, value=reward, verifier_id="verifier:test",
                                   created_at=T0 + timedelta(seconds=at + 0.1))
    return recorded


def failed_rollout(rollout_id: str, *, task_id: str = "task-1", run_id: str | None = "run-1", harness: str = "agent",
                   reason: RolloutReason = RolloutReason.EVICTED, infrastructure: bool = True,
                   start_s: float = 0.0) -> Recorded:
    """A rollout that ended without a reward and without a call (an evicted pod, say)."""
    recorded = Recorded()
    for phase in (RolloutPhase.SCHEDULED, RolloutPhase.FAILED):
        recorded.lifecycle.append(RolloutEventV1(
            rollout_id=rollout_id, task_id=task_id, run_id=run_id, group_index=0, group_size=1, harness=harness,
            phase=phase, reason=reason if phase is RolloutPhase.FAILED else None,
            infrastructure_failure=infrastructure and phase is RolloutPhase.FAILED, backend=Backend.LOCAL,
            created_at=T0 + timedelta(seconds=start_s + (1 if phase is RolloutPhase.FAILED else 0))))
    return recorded


RECOVERED = [Turn("pytest -x", "FAILED test_x.py\nExit code: 1"), Turn("pytest -x", "1 passed\nExit code: 0"),
             Turn(text="The test passes now.")]
"""A failing tool call, then a successful retry of the same tool."""

NOT_RECOVERED = [Turn("pytest -x", "bash: pytest: command not found"), Turn(text="I could not run the tests.")]
"""A failing tool call and no retry."""
