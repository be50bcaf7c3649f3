"""The engine's reasoning, handed to harnesses whose APIs have a place for it, and taken back.

vLLM's reasoning parser splits a reasoning model's thinking from its answer into a field of the
message (or of each streamed delta): ``reasoning`` since vLLM renamed it, ``reasoning_content``
before; the proxy reads both, and gives it back to the engine as ``reasoning`` on the assistant
message, which vLLM hands to the chat template. The translated APIs have their own place for
it: an Anthropic ``thinking`` block, an OpenAI Responses ``reasoning`` item with
``reasoning_text`` content (the shape vLLM's own Responses server uses).

Why it must come back on the next call: reasoning models' chat templates keep the thinking of the
assistant turns after the last user message (Qwen3 renders it through a whole tool loop, gpt-oss
needs its analysis between tool calls). Without it the model would see its own earlier turn with
the thinking it sampled taken out, a prompt it was never trained on, and the next call's prompt
would no longer extend the tokens the previous call captured.

Anthropic's thinking blocks carry a ``signature`` that harnesses send back untouched, and with
``display: "omitted"`` (Claude Code asks for it on most calls) the block's text is empty and
only the signature carries the thinking. So the signature of a block this proxy made
(:func:`signature`) carries the text itself, and the text comes back from it
(:func:`signed_thought`) exactly as the engine wrote it, whatever a client did to the shown
text. It has no key: it tells the proxy's own blocks from another model's, which are dropped,
so a conversation begun on Anthropic's API and continued here does not hand Claude's thinking
to the engine, and proves nothing else.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Final

# Read where the call's record reads it, so that what a harness is shown and what is recorded agree.
from producers.capture import reasoning_text as engine_reasoning

__all__ = ["SIGNATURE_PREFIX", "engine_reasoning", "signature", "signed_thought"]

SIGNATURE_PREFIX: Final = "openforge-1."
"""How a thinking block's signature made by this proxy begins; the text follows, base64url."""


def signature(text: str) -> str:
    """The signature of a thinking block this proxy made from the engine's ``text``."""
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def signed_thought(block_signature: Any) -> str | None:
    """The engine's text a thinking block's signature carries; None for another model's block."""
    if not isinstance(block_signature, str) or not block_signature.startswith(SIGNATURE_PREFIX):
        return None
    encoded = block_signature[len(SIGNATURE_PREFIX):]
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
