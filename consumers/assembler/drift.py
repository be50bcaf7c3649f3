"""Why a call broke the token prefix: a diagnosis from the recorded messages.

The merge itself is decided on token ids alone (:mod:`consumers.assembler.samples`); this module
only names the cause of a break, for the trajectory's ``merge_breaks`` and the harness report.
It compares the call's request with the earlier call's request and answer, the way a chat template
sees them: role, text, reasoning, tool calls (name and parsed arguments) and tool-call ids, not
the JSON spelling. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from schemas import ModelCallV1
from schemas.drift import DriftReason

__all__ = ["canonical_tools", "diagnose_break", "diagnose_views", "reply_message", "template_view"]

_REASONING_KEYS = ("reasoning", "reasoning_content")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text") if isinstance(part, Mapping) else part) for part in content)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _arguments(raw: Any) -> Any:
    # Arguments travel as JSON text; a harness that parses and re-serialises them changes spacing and
    # key order, which the template would render differently but which is the same call.
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def template_view(message: Any) -> tuple[Any, ...]:
    """What of a chat message a template renders, comparable across re-serialisations."""
    if not isinstance(message, Mapping):
        return ("?", _text(message))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else {}
        calls.append((str(function.get("name") or ""),
                      orjson.dumps(_arguments(function.get("arguments")), option=orjson.OPT_SORT_KEYS)))
    reasoning = next((_text(message.get(key)) for key in _REASONING_KEYS if message.get(key)), "")
    return (str(message.get("role") or ""), _text(message.get("content")), reasoning, tuple(calls),
            str(message.get("tool_call_id") or ""))


def reply_message(call: ModelCallV1) -> Mapping[str, Any] | None:
    """The assistant message of the call's first choice, as the engine answered it."""
    response = call.response
    if not isinstance(response, Mapping):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    message = choices[0].get("message")
    return message if isinstance(message, Mapping) else None


def without_reasoning(view: tuple[Any, ...]) -> tuple[Any, ...]:
    """A message's view with its reasoning left out."""
    return (view[0], view[1], "", view[3], view[4])


def canonical_tools(tools: Sequence[Any] | None) -> bytes:
    """The tools offered, comparable across JSON spellings (no tools and ``[]`` are the same)."""
    return orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)


def diagnose_break(previous: ModelCallV1, call: ModelCallV1) -> DriftReason | None:
    """Name the cause of ``call`` not extending ``previous``'s prompt and completion.

    Returns:
        The reason (see :func:`diagnose_views`), or None when a request holds no messages (a
        refused call).
    """
    reply = reply_message(previous)
    return diagnose_views(
        [template_view(m) for m in previous.request.messages], template_view(reply) if reply is not None else None,
        [template_view(m) for m in call.request.messages],
        tools_before=canonical_tools(previous.request.tools), tools_after=canonical_tools(call.request.tools))


def diagnose_views(before: Sequence[tuple[Any, ...]], answer: tuple[Any, ...] | None,
                   after: Sequence[tuple[Any, ...]], *, tools_before: bytes, tools_after: bytes) -> DriftReason | None:
    """Name why the messages ``after`` do not repeat ``before`` and its ``answer``, as template views.

    In order: the tools changed; the earlier messages and answer came back unchanged (then only the
    template's writing of the sampled turn differs: ``rerendered``, or ``reasoning_dropped`` when
    the answer's reasoning is missing); an earlier message reappears after the answer
    (``message_moved``); anything else is ``history_rewritten``. The proxy's continuation planner
    asks the same question of its own token history, so both name a break alike.

    Returns:
        The reason, or None when either side holds no messages.
    """
    before, after = list(before), list(after)
    if not before or not after:
        return None
    if tools_before != tools_after:
        return DriftReason.TOOLS_CHANGED
    if after[:len(before)] == before:
        if len(after) == len(before) or answer is None:
            return DriftReason.HISTORY_REWRITTEN  # the answer is not in the history: another conversation
        given = after[len(before)]
        if answer[2] and not given[2] and without_reasoning(answer) == given:
            return DriftReason.REASONING_DROPPED
        return DriftReason.RERENDERED
    diverged = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b) \
        if any(a != b for a, b in zip(before, after, strict=False)) else min(len(before), len(after))
    left_out = before[diverged:]
    rest = after[diverged:]
    # The messages the harness took out from before the new turn come back after it: each as it was,
    # or one trailing message, put last again (a context message that restates the current state).
    if left_out and answer is not None and rest and _same_turn(rest[0], answer):
        later = rest[1:]
        if all(view in later for view in left_out) or (
                len(left_out) == 1 and later and later[-1][0] == left_out[0][0] and later[-1] not in before):
            return DriftReason.MESSAGE_MOVED
    return DriftReason.HISTORY_REWRITTEN


def _same_turn(given: tuple[Any, ...], answer: tuple[Any, ...]) -> bool:
    return given == answer or without_reasoning(given) == without_reasoning(answer)
