"""A prompt over the engine's context reaches each harness in its own API's words.

Claude Code compacts on Anthropic's "prompt is too long: N tokens > M maximum" and reads both
numbers; Codex compacts on OpenAI's error code ``context_length_exceeded``. The engine's
messages here are vLLM's, verbatim, in the forms it has used.
"""

from __future__ import annotations

import pytest

from proxy.adapters import ChatAdapter
from proxy.anthropic.adapter import AnthropicAdapter
from proxy.errors import context_overflow
from proxy.responses.adapter import ResponsesAdapter

COUNTED = ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input "
           "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
           "input prompt. (parameter=input_tokens, value=5000)")
LOWER_BOUND = ("This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025 "
               "input tokens, which exceeds this limit even without any output tokens.")
CHARACTERS = ("This model's maximum context length is 1024 tokens. However, your prompt contains 90000 characters "
              "(more than 30000 characters, which is the upper bound for 1023 input tokens).")
OLD = ("This model's maximum context length is 4096 tokens. However, you requested 5100 tokens (5000 in the "
       "messages, 100 in the completion). Please reduce the length of the messages or completion.")
OLD_ROOM = ("This model's maximum context length is 4096 tokens. However, you requested 4196 tokens (96 in the "
            "messages, 4100 in the completion). Please reduce the length of the messages or completion.")
OTHER = "max_tokens=32000 cannot be greater than max_model_len=1024. Please request fewer output tokens."


@pytest.mark.parametrize(("message", "expected"), [
    (COUNTED, (5000, 4096)), (LOWER_BOUND, (None, 1024)), (CHARACTERS, (None, 1024)), (OLD, (5000, 4096)),
    (OLD_ROOM, None), (OTHER, None), ("", None)])
def test_the_engines_overflow_messages_are_read(message: str, expected: tuple[int | None, int] | None) -> None:
    assert context_overflow(message) == expected


def test_anthropic_says_prompt_is_too_long_with_the_numbers_it_knows() -> None:
    adapter = AnthropicAdapter()
    body = adapter.error(400, COUNTED, "invalid_request_error")
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "prompt is too long: 5000 tokens > 4096 maximum"}}
    vague = adapter.error(400, LOWER_BOUND, "invalid_request_error")["error"]["message"]
    assert vague.startswith("prompt is too long: ") and "1024" in vague and ">" not in vague
    assert adapter.error(400, OTHER, "invalid_request_error")["error"]["message"] == OTHER
    assert adapter.error(500, COUNTED, "api_error")["error"]["message"] == COUNTED  # only a refusal is rephrased


def test_responses_and_chat_codes() -> None:
    body = ResponsesAdapter().error(400, COUNTED, "invalid_request_error")
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["message"] == COUNTED
    assert ResponsesAdapter().error(400, OTHER, "invalid_request_error")["error"]["code"] is None
    # Chat completions are the engine's own API: its error passes as the engine shaped it.
    assert ChatAdapter().error(400, COUNTED, "invalid_request_error")["error"]["code"] == 400
