"""Which fields of a chat completion request reach the engine: passed, refused, or dropped.

A chat completion is passed through to vLLM, whose request takes far more than OpenAI's: fields
that bend the sampling distribution (``logit_bias``, a grammar), that make the engine work beyond
one answer (``prompt_logprobs``, ``best_of``) or that change the prompt the template renders
(``chat_template_kwargs``). Tokens sampled so are not the policy's: the learner scores them under
the policy's own distribution and its own render of the prompt. So only the fields of
:data:`PASSED` go through; a field of :data:`REFUSED` set to anything but a value that asks
nothing (its default) is refused with a 400 that names it; every other field is dropped. The
proxy itself forces the capture fields and, where a run sets them, the sampling parameters
(``OPENFORGE_PROXY_SAMPLING``).
"""

from __future__ import annotations

from typing import Any

from proxy.errors import UnsupportedFeatureError

__all__ = ["PASSED", "REFUSED", "admit"]

PASSED = frozenset({
    # The conversation and how it is answered.
    "messages", "model", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options",
    "max_tokens", "max_completion_tokens", "stop", "seed", "user", "reasoning_effort",
    # How tokens are drawn: the run's own values where OPENFORGE_PROXY_SAMPLING sets them.
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    # What capture asks for anyway; a harness that asks for them too gets them in its answer.
    "logprobs", "top_logprobs", "return_token_ids", "return_weight_versions", "include_reasoning",
})
"""Fields passed to the engine as the harness sent them."""

_DISTRIBUTION = "it changes the distribution tokens are sampled from, which the learner scores under the policy's own"
_WORK = "it asks the engine for work beyond one answer of the policy"
_PROMPT = "it changes the prompt the engine's template renders, which the learner scores under its own"

REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "logit_bias": ((None, {}), _DISTRIBUTION),
    "allowed_token_ids": ((None,), _DISTRIBUTION),
    "bad_words": ((None, []), _DISTRIBUTION),
    "min_tokens": ((None, 0), _DISTRIBUTION),
    "ignore_eos": ((None, False), _DISTRIBUTION),
    "response_format": ((None, {"type": "text"}), _DISTRIBUTION),
    "structured_outputs": ((None,), _DISTRIBUTION),
    "guided_json": ((None,), _DISTRIBUTION),
    "guided_regex": ((None,), _DISTRIBUTION),
    "guided_choice": ((None,), _DISTRIBUTION),
    "guided_grammar": ((None,), _DISTRIBUTION),
    "guided_decoding_backend": ((None,), _DISTRIBUTION),
    "guided_whitespace_pattern": ((None,), _DISTRIBUTION),
    "structural_tag": ((None,), _DISTRIBUTION),
    "thinking_token_budget": ((None,), _DISTRIBUTION),
    "watermarking": ((None, False), _DISTRIBUTION),
    "repetition_detection": ((None,), _DISTRIBUTION),
    "vllm_xargs": ((None, {}), _DISTRIBUTION),
    "n": ((None, 1), _WORK),
    "best_of": ((None, 1), _WORK),
    "use_beam_search": ((None, False), _WORK),
    "prompt_logprobs": ((None,), _WORK),
    "logprob_token_ids": ((None,), _WORK),
    "priority": ((None, 0), _WORK),
    "kv_transfer_params": ((None,), _WORK),
    "ec_transfer_params": ((None,), _WORK),
    "chat_template": ((None,), _PROMPT),
    "chat_template_kwargs": ((None, {}), _PROMPT),
    "documents": ((None,), _PROMPT),
    "echo": ((None, False), _PROMPT),
    "add_generation_prompt": ((None, True), _PROMPT),
    "continue_final_message": ((None, False), _PROMPT),
    "add_special_tokens": ((None, False), _PROMPT),
    "truncate_prompt_tokens": ((None,), _PROMPT),
    "mm_processor_kwargs": ((None, {}), _PROMPT),
    "media_io_kwargs": ((None, {}), _PROMPT),
}
"""Fields refused unless set to one of their values that ask nothing (then dropped), and why."""


def admit(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``body`` the engine gets: :data:`PASSED` ones; the rest dropped.

    Raises:
        UnsupportedFeatureError: a field of :data:`REFUSED` asks for something (``field`` names it).
    """
    for name, value in body.items():
        refused = REFUSED.get(name)
        if refused is not None and not _asks_nothing(value, refused[0]):
            raise UnsupportedFeatureError(name, f"the proxy refuses it: {refused[1]}")
    return {name: value for name, value in body.items() if name in PASSED}


def _asks_nothing(value: object, defaults: tuple[object, ...]) -> bool:
    # Compared with their types: ``1`` is not ``True``, nor ``0`` ``False``, to the engine's model.
    return any(type(value) is type(default) and value == default for default in defaults)
