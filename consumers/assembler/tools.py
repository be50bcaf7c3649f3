"""Tool use of a rollout from its recorded calls: errors, recoveries, tool-call parse failures.

A tool result is an error when the protocol says so (an Anthropic ``tool_result`` with ``is_error``,
which the proxy's translation keeps on the chat ``tool`` message) or, for protocols without such a
flag (Responses and chat tool outputs), when its text reports a non-zero exit code or matches an
error pattern (:class:`ToolErrorRules`, configurable in the assembler's settings). An error counts
as *recovered* when a later result of the same tool is not an error.

The annotations go on the trajectory as metadata: the learner does not use them in the loss.
Pure functions, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from consumers.assembler.drift import reply_message
from schemas import ModelCallV1
from schemas.call.v1 import CallStatus
from schemas.trajectory.v1 import ToolErrorRecord, ToolErrorRule, ToolUse

__all__ = [
    "DEFAULT_ERROR_PATTERNS",
    "DEFAULT_EXIT_CODE_PATTERN",
    "TOOL_CALL_MARKERS",
    "ToolErrorRules",
    "annotate_tool_use",
]

DEFAULT_EXIT_CODE_PATTERN = r"(?i)(?:exit[ _]?code|exit status|exited with code)[\"']?\s*[:=]?\s*(-?\d+)"
"""A reported exit code: ``Exit code: 1``, ``Process exited with code 2``, ``"exit_code": 1``. The
first group is the code; only a non-zero one marks an error."""

DEFAULT_ERROR_PATTERNS = (
    r"<tool_use_error>",  # Claude Code wraps its tools' failures in it
    r"(?im)^\s*(?:error|fatal)\s*:",
    r"Traceback \(most recent call last\)",
    r"command not found",
)
"""Texts that mark a tool result as an error when no exit code says otherwise."""

TOOL_CALL_MARKERS = ("<tool_call>", "<function=")
"""Tool-call markup that, left in an answer's text, means the engine's parser did not get a call out."""


@dataclass(frozen=True)
class ToolErrorRules:
    """How a tool result without a protocol error flag is judged (see the module docstring)."""

    exit_code: re.Pattern[str]
    errors: tuple[re.Pattern[str], ...]

    @classmethod
    def of(cls, exit_code: str = DEFAULT_EXIT_CODE_PATTERN,
           errors: Sequence[str] = DEFAULT_ERROR_PATTERNS) -> ToolErrorRules:
        """Compile the patterns.

        Raises:
            ValueError: A pattern does not compile, or the exit-code pattern has no group.
        """
        try:
            compiled = re.compile(exit_code)
            texts = tuple(re.compile(p) for p in errors)
        except re.error as exc:
            raise ValueError(f"tool error pattern {exc.pattern!r} does not compile: {exc}") from exc
        if compiled.groups < 1:
            raise ValueError(f"the exit-code pattern {exit_code!r} needs a group that captures the code")
        return cls(compiled, texts)

    def judge(self, message: Mapping[str, Any]) -> ToolErrorRule | None:
        """The rule that marks this ``tool`` message as an error, or None when it is not one."""
        if message.get("is_error") is True:
            return ToolErrorRule.IS_ERROR
        text = _text(message.get("content"))
        found = self.exit_code.search(text)
        if found is not None:
            try:
                code = int(found.group(1))
            except (TypeError, ValueError):
                code = 0
            # A reported exit code decides: a command that succeeded may well print "error:" lines.
            return ToolErrorRule.EXIT_CODE if code != 0 else None
        if any(p.search(text) for p in self.errors):
            return ToolErrorRule.ERROR_TEXT
        return None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text(part.get("text") if isinstance(part, Mapping) else part) for part in content)
    return orjson.dumps(content).decode()


@dataclass
class _Result:
    tool_call_id: str
    call_id: str
    rule: ToolErrorRule | None


def annotate_tool_use(calls: Sequence[ModelCallV1], rules: ToolErrorRules) -> tuple[ToolUse, list[ToolErrorRecord]]:
    """Count the rollout's tool calls, results, errors and recoveries, and list each error.

    Args:
        calls: The rollout's calls in call order, any status. Results are read from the requests
            (each once, where first seen: a retry or a later turn repeats them), tool calls and
            parse failures from the answers of calls that ended ``ok``.
        rules: How results without a protocol flag are judged.
    """
    names: dict[str, str] = {}
    results: list[_Result] = []
    seen: set[str] = set()
    made: set[str] = set()
    parse_failures = 0
    for call in calls:
        for message in call.request.messages:
            if not isinstance(message, Mapping):
                continue
            if message.get("role") == "assistant":
                _name_calls(message, names)
            elif message.get("role") == "tool":
                tool_call_id = str(message.get("tool_call_id") or "")
                if tool_call_id and tool_call_id not in seen:
                    seen.add(tool_call_id)
                    results.append(_Result(tool_call_id, call.call_id, rules.judge(message)))
        reply = reply_message(call) if call.status is CallStatus.OK else None
        if reply is None:
            continue
        made.update(_name_calls(reply, names))
        parse_failures += _parse_failures(reply)
    errors: list[ToolErrorRecord] = []
    for index, result in enumerate(results):
        if result.rule is None:
            continue
        name = names.get(result.tool_call_id, "")
        later = next((r for r in results[index + 1:] if r.rule is None and name
                      and names.get(r.tool_call_id) == name), None)
        errors.append(ToolErrorRecord(
            tool_call_id=result.tool_call_id, tool_name=name, call_id=result.call_id, rule=result.rule,
            recovered=later is not None, recovered_by=later.tool_call_id if later is not None else None))
    use = ToolUse(tool_calls=len(made), results=len(results), errors=len(errors),
                  recovered=sum(e.recovered for e in errors), parse_failures=parse_failures)
    return use, errors


def _name_calls(message: Mapping[str, Any], names: dict[str, str]) -> list[str]:
    ids = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        name = str(function.get("name") or "") if isinstance(function, Mapping) else ""
        tool_call_id = str(call.get("id") or "")
        if tool_call_id:
            names.setdefault(tool_call_id, name)
            ids.append(tool_call_id)
    return ids


def _parse_failures(reply: Mapping[str, Any]) -> int:
    calls = [c for c in reply.get("tool_calls") or [] if isinstance(c, Mapping)]
    if not calls:
        text = _text(reply.get("content"))
        return 1 if any(marker in text for marker in TOOL_CALL_MARKERS) else 0
    failures = 0
    for call in calls:
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        try:
            parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            parsed = None
        failures += not isinstance(parsed, dict)
    return failures
