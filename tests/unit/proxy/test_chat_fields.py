"""The chat passthrough's fields: which reach the engine, which are refused by name, which are dropped."""

from __future__ import annotations

import pytest

from proxy.adapters import ChatAdapter
from proxy.chat_fields import PASSED, REFUSED
from proxy.errors import UnsupportedFeatureError

MESSAGES = [{"role": "user", "content": "hi"}]

ASKING: dict[str, object] = {
    "logit_bias": {"12": -100}, "allowed_token_ids": [1, 2], "bad_words": ["no"], "min_tokens": 5,
    "ignore_eos": True, "n": 2,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}, "guided_json": {},
    "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "structural_tag": "{}",
    "thinking_token_budget": 16, "watermarking": True, "repetition_detection": {"max_pattern_size": 4},
    "vllm_xargs": {"k": 1}, "best_of": 2, "use_beam_search": True, "prompt_logprobs": 0,
    "logprob_token_ids": [3], "priority": -1, "kv_transfer_params": {}, "ec_transfer_params": {},
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}], "echo": True, "add_generation_prompt": False,
    "continue_final_message": True, "add_special_tokens": True, "truncate_prompt_tokens": 8,
    "mm_processor_kwargs": {"fps": 1}, "media_io_kwargs": {"video": {}},
}
"""A value that asks for something, for every refused field."""


def test_every_refused_field_has_a_value_that_asks_something_here() -> None:
    assert set(ASKING) == set(REFUSED)
    assert not PASSED & set(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_refused_field_is_a_400_naming_it(field: str) -> None:
    adapter = ChatAdapter()
    with pytest.raises(UnsupportedFeatureError) as refused:
        adapter.to_chat({"model": "m", "messages": MESSAGES, field: ASKING[field]})
    assert refused.value.field == field and refused.value.status_code == 400
    assert field in refused.value.message
    error = adapter.error(400, refused.value.message, refused.value.error_type, refused.value.field)
    assert error["error"]["param"] == field  # where the openai SDKs read it


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, (values, _) in REFUSED.items() for v in values])
def test_a_refused_field_that_asks_nothing_is_dropped(field: str, value: object) -> None:
    assert field not in ChatAdapter().to_chat({"model": "m", "messages": MESSAGES, field: value})


@pytest.mark.parametrize(("field", "value"), [("min_tokens", False), ("n", True), ("n", 1.0), ("priority", 0.0),
                                              ("add_generation_prompt", 1)])
def test_a_value_equal_to_a_default_only_in_python_is_refused(field: str, value: object) -> None:
    with pytest.raises(UnsupportedFeatureError):
        ChatAdapter().to_chat({"model": "m", "messages": MESSAGES, field: value})


def test_passed_fields_go_through_and_unknown_ones_are_dropped() -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True},
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "max_tokens": 8,
            "max_completion_tokens": 8, "stop": ["\n"], "seed": 3, "user": "u", "reasoning_effort": "low",
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "include_reasoning": False}
    sent = ChatAdapter().to_chat({**body, "store": False, "metadata": {"a": "b"}, "cache_salt": "s",
                                  "skip_special_tokens": False, "request_id": "x"})
    assert sent == body
