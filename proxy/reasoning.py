"""The engine's reasoning, handed to harnesses whose APIs have a place for it, and taken back.

vLLM's reasoning parser splits a reasoning model's thinking from its answer into a field of the
message (or of each streamed delta): ``reasoning`` since vLLM renamed it, ``reasoning_content``
before, and vLLM still reads either on the assistant messages of a request. The translated APIs
have their own place for it: an Anthropic ``thinking`` block, an OpenAI Responses ``reasoning``
item with ``reasoning_text`` content (the shape vLLM's own Responses server uses).

Why it must come back on the next call: reasoning models' chat templates keep the thinking of the
assistant turns after the last user message (Qwen3 renders it through a whole tool loop, gpt-oss
needs its analysis between tool calls). Without it the model would see its own earlier turn with
the thinking it sampled taken out, a prompt it was never trained on, and the next call's prompt
would no longer extend the tokens the previous call captured.

Anthropic's thinking blocks carry a ``signature`` that harnesses send back untouched. Blocks this
proxy made are signed with :func:`signature` (a digest of the text, no key: it tells the proxy's
own blocks from another model's, which are dropped, and proves nothing else), so a conversation
begun on Anthropic's API and continued here does not hand Claude's thinking to the engine.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, Final

SIGNATURE_PREFIX: Final = "openforge-1."
"""How a thinking block's signature made by this proxy begins."""


def engine_reasoning(fields: dict[str, Any]) -> str:
    """The reasoning text of an engine message or delta; empty when it has none."""
    text = fields.get("reasoning")
    if not isinstance(text, str) or not text:
        text = fields.get("reasoning_content")
    return text if isinstance(text, str) else ""


def signature(text: str) -> str:
    """The signature of a thinking block this proxy made from the engine's ``text``."""
    digest = hashlib.sha256(text.encode()).digest()
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def signed_here(text: str, block_signature: Any) -> bool:
    """Whether a thinking block came from this proxy with its text as it was sent."""
    return isinstance(block_signature, str) and block_signature == signature(text)
