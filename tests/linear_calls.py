"""Call events stored linearly, for tests: each prompt by reference to an earlier call's context."""

from __future__ import annotations

from schemas import ModelCallV1
from schemas.call.linear import context_bytes, prefix_digest
from schemas.call.v1 import PromptPrefix


def linked(call: ModelCallV1, parent: ModelCallV1, tokens: int | None = None, *, messages: int = 0,
           tools: bool = False, digest: str | None = None) -> ModelCallV1:
    """``call`` (whole) with its first ``tokens`` prompt ids (default: as many as it shares with
    ``parent``'s context) by reference, and its first ``messages`` messages and (``tools``) its tools."""
    context, prompt = context_bytes(parent), call.prompt_token_ids.to_bytes()
    if tokens is None:
        tokens = 0
        while tokens * 4 < min(len(context), len(prompt)) and context[tokens * 4:tokens * 4 + 4] == prompt[
                tokens * 4:tokens * 4 + 4]:
            tokens += 1
    head = call.prompt_token_ids.to_bytes()[:tokens * 4]
    prefix = PromptPrefix(call_id=parent.call_id, tokens=tokens, digest=digest or prefix_digest(head),
                          messages=messages, tools=tools)
    request = call.request.model_copy(update={"messages": call.request.messages[messages:],
                                              "tools": None if tools else call.request.tools})
    return call.model_copy(update={"prompt_prefix": prefix, "prompt_token_ids": call.prompt_token_ids[tokens:],
                                   "request": request})
