"""One call's engine request in continuation mode: plan it, render it, and the prompt to generate from.

This is the step the proxy's call path runs instead of sending a chat request: given the rollout's
history and the chat request (as the proxy sends chat mode's), it returns the render (the sampling
parameters the engine derives from the request), the prompt ids (an earlier turn's exact ids
extended, or the full render with the reason), and after the call the turn to record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from consumers.assembler.drift import canonical_tools, template_view
from proxy.continuation.engine import TokenEndpoints, TokenEngine, TokenEngineError, generate_body
from proxy.continuation.history import RolloutHistory, Turn, View
from proxy.continuation.planner import Extend, Prompt, Repeat, choose, extend_prompt, full_prompt, repeat_prompt
from schemas.drift import DriftReason

__all__ = ["ContinuationCall", "prepare"]


@dataclass(frozen=True)
class ContinuationCall:
    """A planned call: what to generate from, and what derender and the history need afterwards."""

    chat_request: Mapping[str, Any]
    """The chat request as the engine would take it; derender parses the answer against it."""
    rendered: Mapping[str, Any]
    """The engine's render of the whole request: its sampling parameters, and in ``token_ids``
    the prompt chat mode would have sent."""
    prompt: Prompt
    views: tuple[View, ...]
    tools: bytes

    def generate_body(self, *, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        """The generate request for this call's prompt."""
        return generate_body(self.rendered, self.prompt.ids(), max_tokens=max_tokens, stream=stream)

    def turn(self, call_id: str, sampled: Sequence[int], answer: Mapping[str, Any] | None) -> Turn:
        """The turn to record once the engine answered (``answer``: the message the harness got)."""
        return self.prompt.turn(call_id, self.views, self.tools, sampled,
                                template_view(answer) if answer is not None else None)


async def prepare(engine: TokenEngine, endpoints: TokenEndpoints, history: RolloutHistory,
                  chat_request: Mapping[str, Any]) -> ContinuationCall:
    """Plan a call against the rollout's history and render what it needs.

    A call that extends a turn renders twice at once: the whole request, and its messages up to the
    repeated answer, closed. A closed render the engine refuses is a ``bridge_mismatch``, not a
    failed call.

    Raises:
        TokenEngineError: the engine refused to render the request (the harness's bad request).
        EngineError: no answer.
    """
    messages = list(chat_request.get("messages") or [])
    views = tuple(template_view(m) for m in messages)
    tools = canonical_tools(chat_request.get("tools"))
    plan = choose(history, views, tools)
    prompt: Prompt
    if isinstance(plan, Extend):
        closed_request = {**chat_request, "messages": messages[:plan.through], "add_generation_prompt": False,
                          "continue_final_message": False}
        closing = asyncio.ensure_future(engine.render(closed_request))
        try:
            rendered = await engine.render(chat_request)
        except BaseException:
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)  # its outcome retrieved, none left running
            raise
        try:
            closed = await closing
        except TokenEngineError:
            prompt = full_prompt(rendered["token_ids"], DriftReason.BRIDGE_MISMATCH)
        else:
            prompt = extend_prompt(plan, endpoints.turn_closing, closed["token_ids"], rendered["token_ids"])
    else:
        rendered = await engine.render(chat_request)
        prompt = repeat_prompt(plan) if isinstance(plan, Repeat) else full_prompt(rendered["token_ids"], plan.reason)
    return ContinuationCall(chat_request, rendered, prompt, views, tools)
