"""Anthropic Messages <-> chat completions translation.

Requests and engine answers here are shaped like what Claude Code sends and what vLLM returns. The
``_against_sdk_parser`` tests hand the translated output to the official ``anthropic`` SDK through
``sdk_http.MockTransport``: the SDK's own parsing and stream accumulation are real, the transport is
simulated (no server, no network).
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import pytest

from proxy.anthropic.adapter import AnthropicAdapter
from proxy.anthropic.translate import (
    EMPTY_ERROR_RESULT_TEXT,
    StreamTranslator,
    ThinkingDisplay,
    error_body,
    error_event,
    from_chat_response,
    sse_encode,
    thinking_display,
    to_chat_request,
)
from proxy.errors import InvalidRequestError, UnsupportedFeatureError
from proxy.media import DOCUMENT_PLACEHOLDER, IMAGE_PLACEHOLDER
from proxy.reasoning import signature

try:  # the SDK brings its own HTTP library (a fork of httpx) in recent versions and refuses httpx objects
    import httpx2 as sdk_http
except ImportError:  # pragma: no cover - older SDKs take httpx
    import httpx as sdk_http  # type: ignore[no-redef]

BASH_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number"},
    },
    "required": ["command"],
    "additionalProperties": False,
}
READ_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}},
    "required": ["file_path"],
}


def claude_code_request(**overrides: Any) -> dict[str, Any]:
    """A second-turn request in the shape Claude Code sends it (streamed, beta fields included)."""
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "system", "content": "Today's date is 2026-01-05."},
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Use TodoWrite for multi-step work.</system-reminder>"},
                {"type": "text", "text": "How many lines does setup.py have?", "cache_control": {"type": "ephemeral"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should count the lines.", "signature": "EqQBCkYIBxgCKkD"},
                {"type": "text", "text": "I'll count them."},
                {"type": "tool_use", "id": "toolu_01A", "name": "Bash",
                 "input": {"command": "wc -l setup.py", "timeout": 120000}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "42 setup.py"},
                {"type": "text", "text": "Also read it, please."},
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01B", "name": "Read", "input": {"file_path": "/repo/setup.py"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01B",
                 "content": [{"type": "text", "text": "1\tfrom setuptools import setup"},
                             {"type": "text", "text": "2\tsetup()"}]},
            ]},
        ],
        "tools": [
            {"name": "Bash", "description": "Executes a bash command.", "input_schema": BASH_SCHEMA},
            {"name": "Read", "description": "Reads a file.", "input_schema": READ_SCHEMA,
             "cache_control": {"type": "ephemeral"}},
        ],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_0a1b_account__session_7f3e"},
        "thinking": {"type": "adaptive", "budget_tokens": 0},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    body.update(overrides)
    return body


# ---------------------------------------------------------------------------------------- requests


def test_claude_code_like_request_translates_to_chat_body() -> None:
    chat = to_chat_request(claude_code_request())

    assert chat == {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 32000,
        "temperature": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
                                          "You are an interactive CLI tool that helps users with software engineering tasks."},
            {"role": "system", "content": "Today's date is 2026-01-05."},
            {"role": "user", "content": "<system-reminder>Use TodoWrite for multi-step work.</system-reminder>\n"
                                        "How many lines does setup.py have?"},
            {"role": "assistant", "content": "I'll count them.", "tool_calls": [
                {"id": "toolu_01A", "type": "function",
                 "function": {"name": "Bash", "arguments": '{"command":"wc -l setup.py","timeout":120000}'}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_01A", "content": "42 setup.py"},
            {"role": "user", "content": "Also read it, please."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_01B", "type": "function",
                 "function": {"name": "Read", "arguments": '{"file_path":"/repo/setup.py"}'}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_01B",
             "content": "1\tfrom setuptools import setup\n2\tsetup()"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "Bash", "description": "Executes a bash command.",
                                              "parameters": BASH_SCHEMA}},
            {"type": "function", "function": {"name": "Read", "description": "Reads a file.",
                                              "parameters": READ_SCHEMA}},
        ],
        "tool_choice": "auto",
    }


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "tool", "name": "Read"}, {"tool_choice": {"type": "function", "function": {"name": "Read"}}}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "auto", "disable_parallel_tool_use": True}, {"tool_choice": "auto", "parallel_tool_calls": False}),
        ({"type": "any", "disable_parallel_tool_use": False}, {"tool_choice": "required"}),
    ],
)
def test_tool_choice_maps_to_chat(tool_choice: dict[str, Any], expected: dict[str, Any]) -> None:
    chat = to_chat_request(claude_code_request(tool_choice=tool_choice))
    assert {k: chat[k] for k in ("tool_choice", "parallel_tool_calls") if k in chat} == expected


def test_tool_choice_forcing_a_tool_without_tools_is_invalid() -> None:
    body = claude_code_request(tool_choice={"type": "any"})
    del body["tools"]
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        to_chat_request(body)


def test_tool_choice_auto_without_tools_sends_neither() -> None:
    body = claude_code_request()
    del body["tools"]
    chat = to_chat_request(body)
    assert "tools" not in chat and "tool_choice" not in chat


def test_sampling_stop_sequences_and_non_streaming() -> None:
    chat = to_chat_request({
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.2, "top_p": 0.9, "top_k": 40, "stop_sequences": ["</answer>", "\n\nHuman:"],
        "stream": False, "service_tier": "auto",
    })
    assert chat == {
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.2, "top_p": 0.9, "top_k": 40, "stop": ["</answer>", "\n\nHuman:"], "stream": False,
    }


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 10000}, {"type": "adaptive"},
                                      {"type": "disabled"}])
def test_thinking_config_is_ignored(thinking: dict[str, Any]) -> None:
    chat = to_chat_request(claude_code_request(thinking=thinking))
    assert chat == to_chat_request(claude_code_request())
    assert "thinking" not in chat


def test_thinking_blocks_are_dropped_from_assistant_history() -> None:
    chat = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
            {"type": "thinking", "thinking": "greet back", "signature": "sig"},
            {"type": "text", "text": "Hello!"},
        ]},
        {"role": "user", "content": "bye"},
    ]})
    assert chat["messages"][1] == {"role": "assistant", "content": "Hello!"}


def test_tool_result_is_error_keeps_text_and_fills_empty() -> None:
    chat = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/nope"}},
            {"type": "tool_use", "id": "t2", "name": "Read", "input": {"file_path": "/also-nope"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
             "content": "<tool_use_error>File does not exist.</tool_use_error>"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True},
        ]},
    ]})
    # The flag stays on the message (templates do not render it) for the error-recovery annotations.
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "<tool_use_error>File does not exist.</tool_use_error>",
         "is_error": True},
        {"role": "tool", "tool_call_id": "t2", "content": EMPTY_ERROR_RESULT_TEXT, "is_error": True},
    ]


def test_assistant_prefill_continues_the_final_message() -> None:
    chat = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Answer in JSON."},
        {"role": "assistant", "content": "{"},
    ]})
    assert chat["continue_final_message"] is True
    assert chat["add_generation_prompt"] is False
    assert "continue_final_message" not in to_chat_request(claude_code_request())


def test_an_empty_final_assistant_turn_asks_for_no_prefill_and_is_not_rendered() -> None:
    for empty in ("", [], [{"type": "redacted_thinking", "data": "x"}]):
        chat = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": empty}]})
        assert chat["messages"] == [{"role": "user", "content": "Hi"}], empty
        assert "continue_final_message" not in chat


def test_structured_output_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = to_chat_request(claude_code_request(output_config={"effort": "high",
                                                                "format": {"type": "json_schema", "schema": schema}}))
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert "response_format" not in to_chat_request(claude_code_request(output_config={"effort": "low"}))


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
"""A whole 1x1 PNG, base64."""


def test_an_image_block_is_refused_by_default_naming_the_setting_that_passes_it() -> None:
    # The learner trains on token ids alone: a vision model's image tokens would be trained
    # without their pixels, so images are the operator's choice, not a silent default.
    body = claude_code_request()
    body["messages"][1]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
    with pytest.raises(UnsupportedFeatureError, match="OPENFORGE_PROXY_IMAGES=inline") as info:
        to_chat_request(body)
    assert info.value.field == "messages[1].content[2].type"


def test_an_image_block_becomes_a_chat_image_part_in_its_place() -> None:
    body = claude_code_request()
    body["messages"][1]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
    body["messages"][1]["content"].append({"type": "text", "text": "What does the screenshot show?"})
    chat = to_chat_request(body, images="inline")
    [turn] = [m for m in chat["messages"] if m["role"] == "user" and isinstance(m["content"], list)]
    assert turn["content"] == [
        {"type": "text", "text": "<system-reminder>Use TodoWrite for multi-step work.</system-reminder>"},
        {"type": "text", "text": "How many lines does setup.py have?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "text", "text": "What does the screenshot show?"},
    ]
    # Text-only turns keep their one string, so their prompt does not change.
    assert [m["content"] for m in chat["messages"] if m["role"] == "user" and m is not turn] == [
        "Also read it, please."]


def test_an_image_a_tool_read_comes_back_in_the_tool_message() -> None:
    # Claude Code's Read of an image file answers with an image block in the tool_result.
    body = claude_code_request()
    body["messages"][5]["content"][0]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/webp", "data": "UklGRg=="}})
    chat = to_chat_request(body, images="inline")
    [result] = [m for m in chat["messages"] if m.get("tool_call_id") == "toolu_01B"]
    assert result["content"] == [
        {"type": "text", "text": "1\tfrom setuptools import setup"}, {"type": "text", "text": "2\tsetup()"},
        {"type": "image_url", "image_url": {"url": "data:image/webp;base64,UklGRg=="}}]


@pytest.mark.parametrize("source", [{"type": "base64", "media_type": "image/webp", "data": "UklGRg=="},
                                    {"type": "url", "url": "https://example.com/a.png"}])
def test_an_image_is_a_line_of_text_in_its_place_under_placeholder(source: dict[str, Any]) -> None:
    # In a tool result (Claude Code's Read of an image file) and in a user turn alike.
    body = claude_code_request()
    body["messages"][5]["content"][0]["content"].append({"type": "image", "source": source})
    body["messages"].append({"role": "assistant", "content": "Seen."})
    body["messages"].append({"role": "user", "content": [{"type": "text", "text": "And this?"},
                                                         {"type": "image", "source": source}]})
    chat = to_chat_request(body, images="placeholder")
    [result] = [m for m in chat["messages"] if m.get("tool_call_id") == "toolu_01B"]
    assert result["content"] == f"1\tfrom setuptools import setup\n2\tsetup()\n{IMAGE_PLACEHOLDER}"
    assert chat["messages"][-1] == {"role": "user", "content": f"And this?\n{IMAGE_PLACEHOLDER}"}


def test_a_document_is_a_line_of_text_in_its_place_under_placeholder_and_refused_otherwise() -> None:
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    body = claude_code_request()
    body["messages"][5]["content"][0]["content"] = [pdf]
    chat = to_chat_request(body, images="placeholder")
    [result] = [m for m in chat["messages"] if m.get("tool_call_id") == "toolu_01B"]
    assert result["content"] == DOCUMENT_PLACEHOLDER
    with pytest.raises(UnsupportedFeatureError, match="reads no documents"):
        to_chat_request(body, images="inline")


@pytest.mark.parametrize(("source", "error", "field"), [
    ({"type": "base64", "media_type": "image/tiff", "data": PNG}, InvalidRequestError,
     "messages[1].content[2].source.media_type must be one of image/gif, image/jpeg, image/png, image/webp"),
    ({"type": "base64", "media_type": "image/png"}, InvalidRequestError, "messages[1].content[2].source.data"),
    # The engine would fetch it, from inside the cluster, at an address the rollout chose.
    ({"type": "url", "url": "http://169.254.169.254/latest/meta-data/"}, UnsupportedFeatureError,
     "messages[1].content[2].source.url: image URLs are refused"),
    ({"type": "file", "file_id": "file_01"}, UnsupportedFeatureError, "messages[1].content[2].source.type"),
    ({"type": "svg"}, InvalidRequestError, "messages[1].content[2].source.type must be"),
    (None, InvalidRequestError, "messages[1].content[2].source must be an object"),
])
def test_an_image_the_engine_cannot_be_given_names_its_field(source: Any, error: type[Exception], field: str) -> None:
    body = claude_code_request()
    body["messages"][1]["content"].append({"type": "image", "source": source})
    with pytest.raises(error, match=re.escape(field)):
        to_chat_request(body, images="inline")


def test_images_are_refused_where_anthropic_refuses_them() -> None:
    body = claude_code_request()
    body["messages"][2]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
    with pytest.raises(InvalidRequestError, match=r"messages\[2\]\.content\[3\]\.type 'image' is only allowed in user"):
        to_chat_request(body, images="inline")
    system = claude_code_request()
    system["system"].append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
    with pytest.raises(InvalidRequestError, match=r"system\[2\]\.type must be 'text' here"):
        to_chat_request(system, images="inline")


def test_document_block_is_unsupported() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "summarise"},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
    ]}]}
    with pytest.raises(UnsupportedFeatureError) as info:
        to_chat_request(body)
    assert info.value.field == "messages[0].content[1].type"


@pytest.mark.parametrize("server_tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
    {"type": "bash_20250124", "name": "bash"},
])
def test_server_tool_is_unsupported(server_tool: dict[str, Any]) -> None:
    body = claude_code_request()
    body["tools"].append(server_tool)
    with pytest.raises(UnsupportedFeatureError) as info:
        to_chat_request(body)
    assert info.value.field == "tools[2].type"


def test_custom_tool_type_is_accepted() -> None:
    body = claude_code_request(tools=[{"type": "custom", "name": "Bash", "input_schema": BASH_SCHEMA}])
    assert to_chat_request(body)["tools"] == [{"type": "function",
                                               "function": {"name": "Bash", "parameters": BASH_SCHEMA}}]


@pytest.mark.parametrize(("field", "value"), [
    ("mcp_servers", [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]),
    ("container", "container_011CPR5CNjB747bTd36fQLFk"),
])
def test_server_side_features_are_unsupported(field: str, value: Any) -> None:
    with pytest.raises(UnsupportedFeatureError) as info:
        to_chat_request(claude_code_request(**{field: value}))
    assert info.value.field == field


@pytest.mark.parametrize("max_tokens", [None, 0, -1, 1.5, "100", True])
def test_missing_or_bad_max_tokens_is_invalid(max_tokens: Any) -> None:
    body = claude_code_request(max_tokens=max_tokens)
    if max_tokens is None:
        del body["max_tokens"]
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        to_chat_request(body)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"messages": "hi"}, "messages must be an array"),
    ({"messages": []}, "messages must contain"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content is required"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content must be an array"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, r"messages\[0\]\.content\[0\]\.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, r"messages\[0\]\.content\[0\]\.text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     r"messages\[0\]\.content\[0\]\.type 'tool_use'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "x"}]}]},
     r"messages\[0\]\.content\[0\]\.input must be an object"),
    ({"model": ""}, "model"),
    ({"system": 5}, "system must be an array"),
    ({"tools": {"name": "Bash"}}, "tools must be an array"),
    ({"tools": [{"name": "Bash"}]}, r"tools\[0\]\.input_schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"stop_sequences": "STOP"}, "stop_sequences must be an array"),
    ({"stream": "yes"}, "stream must be a boolean"),
])
def test_wrong_types_are_invalid_and_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        to_chat_request(claude_code_request(**overrides))
    assert not isinstance(info.value, UnsupportedFeatureError)


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequestError, match="request body"):
        to_chat_request([])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- responses


def vllm_completion(message: dict[str, Any], finish_reason: str, stop_reason: Any = None,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9f2c1e",
        "object": "chat.completion",
        "created": 1767600000,
        "model": "Qwen/Qwen3-0.6B",
        "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": None, **message},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}],
        "usage": usage or {"prompt_tokens": 1234, "total_tokens": 1290, "completion_tokens": 56,
                           "prompt_tokens_details": None},
    }


def test_response_with_text_and_tool_call_validates_with_sdk() -> None:
    chat = vllm_completion({"content": "Let me look.", "tool_calls": [
        {"id": "chatcmpl-tool-4d1e", "type": "function",
         "function": {"name": "Bash", "arguments": '{"command": "ls -la"}'}},
    ]}, "tool_calls")
    result = from_chat_response(chat, model="claude-sonnet-4-5-20250929")
    message = anthropic.types.Message.model_validate(result)

    assert message.id == "msg_chatcmpl-9f2c1e"
    assert message.model == "claude-sonnet-4-5-20250929"
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me look."  # type: ignore[union-attr]
    tool = message.content[1]
    assert isinstance(tool, anthropic.types.ToolUseBlock)
    assert (tool.id, tool.name, tool.input) == ("chatcmpl-tool-4d1e", "Bash", {"command": "ls -la"})
    assert message.usage.input_tokens == 1234 and message.usage.output_tokens == 56
    assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens == 0


@pytest.mark.parametrize(("finish_reason", "stop_reason", "expected"), [
    ("stop", None, ("end_turn", None)),
    ("stop", 151645, ("end_turn", None)),  # a stop *token* id is a natural end
    ("stop", "</answer>", ("stop_sequence", "</answer>")),
    ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("end_turn", None)),  # no call was parsed: nothing for the harness to run
])
def test_response_stop_reasons(finish_reason: str, stop_reason: Any, expected: tuple[str, str | None]) -> None:
    result = from_chat_response(vllm_completion({"content": "42"}, finish_reason, stop_reason), model="m")
    message = anthropic.types.Message.model_validate(result)
    assert (message.stop_reason, message.stop_sequence) == expected


@pytest.mark.parametrize(("max_tokens", "context", "expected"), [
    (None, 1290, "max_tokens"),  # nothing to tell them apart by: the budget, as before
    (56, 1290, "max_tokens"),  # all the tokens asked for were made
    (32000, 1290, "model_context_window_exceeded"),  # 1,234 + 56 filled the context, short of 32,000
    (32000, None, "max_tokens"),  # the context unknown
    (32000, 4096, "max_tokens"),  # short of both: the engine's own cap on answers, not a full context
])
def test_a_length_cut_that_fills_the_context_is_a_full_context(max_tokens: int | None, context: int | None,
                                                                expected: str) -> None:
    result = from_chat_response(vllm_completion({"content": "42"}, "length"), model="m", max_tokens=max_tokens,
                                context=context)
    assert anthropic.types.Message.model_validate(result).stop_reason == expected


@pytest.mark.parametrize(("max_tokens", "context", "usage", "expected"), [
    (31, 41, True, "max_tokens"),
    (32000, 41, True, "model_context_window_exceeded"),  # 10 + 31 filled it
    (32000, 4096, True, "max_tokens"),
    (32000, 41, False, "max_tokens"),  # the stream ended without the engine's counts
])
def test_stream_a_length_cut_that_fills_the_context_is_a_full_context(max_tokens: int, context: int, usage: bool,
                                                                       expected: str) -> None:
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "42"}),
              chunk({"content": ""}, finish_reason="length")] + ([usage_chunk(10, 31)] if usage else [])
    events = run_stream(chunks, max_tokens=max_tokens, context=context)
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["delta"] == {"stop_reason": expected, "stop_sequence": None}


def test_the_adapter_passes_the_harness_s_max_tokens_and_the_engine_s_context() -> None:
    adapter = AnthropicAdapter()
    body = {"model": "claude-opus-4-7", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    whole = adapter.from_chat(vllm_completion({"content": "42"}, "length"), body, {}, context=1290)
    assert whole["stop_reason"] == "model_context_window_exceeded"
    assert adapter.from_chat(vllm_completion({"content": "42"}, "length"), body, {})["stop_reason"] == "max_tokens"
    session = adapter.stream(body, {}, context=41)
    sent = b"".join(session.feed(c) for c in [
        chunk({"role": "assistant", "content": ""}), chunk({"content": "42"}),
        chunk({"content": ""}, finish_reason="length"), usage_chunk(10, 31)])
    assert b'"stop_reason":"model_context_window_exceeded"' in sent


def test_forced_tool_call_finishing_with_stop_is_tool_use() -> None:
    chat = vllm_completion({"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": '{"file_path":"/a"}'}},
    ]}, "stop")
    result = from_chat_response(chat, model="m")
    assert result["stop_reason"] == "tool_use"
    assert [block["type"] for block in result["content"]] == ["tool_use"]


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"command": "ls', {"_raw": '{"command": "ls'}),
    ('["ls"]', {"_raw": '["ls"]'}),
    ("", {}),
])
def test_invalid_tool_arguments_are_wrapped(arguments: str, expected: dict[str, Any]) -> None:
    chat = vllm_completion({"content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": arguments}},
    ]}, "tool_calls")
    message = anthropic.types.Message.model_validate(from_chat_response(chat, model="m"))
    assert len(message.content) == 1  # empty text makes no text block
    assert message.content[0].input == expected  # type: ignore[union-attr]


def test_cached_prompt_tokens_are_reported_as_cache_reads() -> None:
    chat = vllm_completion({"content": "ok"}, "stop", usage={
        "prompt_tokens": 1000, "completion_tokens": 3, "total_tokens": 1003,
        "prompt_tokens_details": {"cached_tokens": 960}})
    usage = from_chat_response(chat, model="m")["usage"]
    assert usage == {"input_tokens": 40, "output_tokens": 3, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 960}


def test_response_tool_call_round_trips_into_the_next_request() -> None:
    chat = vllm_completion({"content": None, "tool_calls": [
        {"id": "chatcmpl-tool-77", "type": "function",
         "function": {"name": "Read", "arguments": '{"file_path":"/repo/ü.py"}'}},
    ]}, "tool_calls")
    message = from_chat_response(chat, model="m")
    nxt = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "read it"},
        {"role": message["role"], "content": message["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "chatcmpl-tool-77", "content": "x"}]},
    ]})
    assert nxt["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [chat["choices"][0]["message"]
                                                                                      ["tool_calls"][0]]}
    assert nxt["messages"][2] == {"role": "tool", "tool_call_id": "chatcmpl-tool-77", "content": "x"}


def test_response_without_choices_is_an_engine_fault() -> None:
    from proxy.errors import ProxyError

    with pytest.raises(ProxyError) as info:
        from_chat_response({"id": "x", "choices": []}, model="m")
    assert info.value.status_code == 500


# ---------------------------------------------------------------------------------------- streaming

CHUNK_BASE: dict[str, Any] = {"id": "chatcmpl-s1", "object": "chat.completion.chunk", "created": 1767600000,
                              "model": "Qwen/Qwen3-0.6B"}


def chunk(delta: dict[str, Any], finish_reason: str | None = None, stop_reason: Any = None) -> dict[str, Any]:
    return {**CHUNK_BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def usage_chunk(prompt: int = 1200, completion: int = 31) -> dict[str, Any]:
    return {**CHUNK_BASE, "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}}


def tool_call_chunks() -> list[dict[str, Any]]:
    """vLLM's stream for: text, then a Bash call whose arguments arrive in fragments, then usage."""
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "I'll list"}),
        chunk({"content": " the files."}),
        chunk({"tool_calls": [{"id": "chatcmpl-tool-a1", "type": "function", "index": 0,
                               "function": {"name": "Bash"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls -la", "timeout'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '": 5000}'}}]}),
        chunk({"tool_calls": [{"id": "chatcmpl-tool-b2", "type": "function", "index": 1,
                               "function": {"name": "Read", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"file_path": "/repo/README.md"}'}}]}),
        chunk({"content": ""}, finish_reason="tool_calls"),
        usage_chunk(),
    ]


def run_stream(chunks: list[dict[str, Any]], **kwargs: Any) -> list[tuple[str, dict[str, Any]]]:
    translator = StreamTranslator(model="claude-sonnet-4-5-20250929", **kwargs)
    events = [event for c in chunks for event in translator.feed(c)]
    return events + translator.finish()


def test_stream_event_sequence_for_text_and_tool_calls() -> None:
    events = run_stream(tool_call_chunks())
    summary = [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
               for name, data in events]
    assert summary == [
        ("message_start", None, None),
        ("content_block_start", 0, "text"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"),
        ("content_block_delta", 1, "input_json_delta"),  # the arguments, whole, once they are
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert all(data["type"] == name for name, data in events)

    start = events[0][1]["message"]
    assert start["id"] == "msg_chatcmpl-s1" and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 0 and start["usage"]["output_tokens"] == 0
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-a1", "name": "Bash", "input": {}}
    partial = "".join(data["delta"]["partial_json"] for _, data in events if data.get("index") == 1
                      and data["type"] == "content_block_delta")
    assert json.loads(partial) == {"command": "ls -la", "timeout": 5000}
    assert events[11][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"output_tokens": 31, "input_tokens": 1200, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 0}}


def test_message_start_carries_the_prompt_length_known_before_the_engine_s_usage() -> None:
    translator = StreamTranslator(model="m")
    translator.prompt_tokens = 1000  # not the engine's count below, to tell the two apart
    events = [event for c in tool_call_chunks() for event in translator.feed(c)]
    start = events[0][1]["message"]["usage"]
    assert start == {"input_tokens": 1000, "output_tokens": 0, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 0}
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["usage"]["input_tokens"] == 1200 and delta["usage"]["output_tokens"] == 31  # the engine's


def test_stream_message_delta_waits_for_the_usage_chunk() -> None:
    translator = StreamTranslator(model="m", message_id="msg_fixed")
    chunks = tool_call_chunks()
    for c in chunks[:-1]:
        events = translator.feed(c)
    assert [name for name, _ in events] == ["content_block_delta", "content_block_stop"]  # the arguments, then the stop
    closing = translator.feed(chunks[-1])
    assert [name for name, _ in closing] == ["message_delta", "message_stop"]
    assert translator.finish() == [] and translator.feed(usage_chunk()) == []
    assert translator.message_id == "msg_fixed" and translator.upstream_finished


def test_stream_stop_sequence() -> None:
    events = run_stream([chunk({"role": "assistant", "content": ""}), chunk({"content": "42"}),
                         chunk({"content": ""}, finish_reason="stop", stop_reason="</answer>"), usage_chunk(10, 2)])
    delta = next(data for name, data in events if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "</answer>"}


def test_stream_ending_without_finish_reason_still_closes() -> None:
    translator = StreamTranslator(model="m")
    events = translator.feed(chunk({"role": "assistant", "content": ""}))
    events += translator.feed(chunk({"content": "partial ans"}))
    events += translator.feed(chunk({"tool_calls": [{"id": "c1", "type": "function", "index": 0,
                                                     "function": {"name": "Bash", "arguments": '{"comm'}}]}))
    assert not translator.upstream_finished and not translator.done
    closing = translator.finish()
    assert [name for name, _ in closing] == ["content_block_delta", "content_block_stop", "message_delta",
                                             "message_stop"]
    # The cut arguments are no JSON object: they go as text the harness can show, not as broken JSON.
    assert json.loads(closing[0][1]["delta"]["partial_json"]) == {"_raw": '{"comm'}
    assert closing[2][1]["delta"] == {"stop_reason": None, "stop_sequence": None}
    assert closing[2][1]["usage"] == {"output_tokens": 0}
    assert translator.finish() == []
    assert translator.done
    names = [name for name, _ in events + closing]
    assert names.count("message_start") == 1 and names.count("message_stop") == 1
    assert names.count("content_block_start") == names.count("content_block_stop") == 2


def test_finish_without_any_chunk_emits_a_whole_empty_message() -> None:
    events = StreamTranslator(model="m").finish()
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[0][1]["message"]["id"].startswith("msg_")


def test_whitespace_between_streamed_tool_calls_makes_no_text_block() -> None:
    # What parsers stream between "</tool_call>" and the next "<tool_call>" (and after the last):
    # a whole answer has no content there, and a text block of it would come back with the
    # history as text before the turn's calls. Whitespace with text after it is still text.
    def call(index: int, name: str) -> dict[str, Any]:
        return chunk({"tool_calls": [{"index": index, "id": f"t{index}", "type": "function",
                                      "function": {"name": name, "arguments": "{}"}}]})

    events = run_stream([chunk({"role": "assistant", "content": ""}), call(0, "Bash"), chunk({"content": "\n"}),
                         chunk({"content": " "}), call(1, "Read"), chunk({"content": "\n"}),
                         chunk({}, finish_reason="tool_calls"), usage_chunk()])
    blocks = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert blocks == ["tool_use", "tool_use"]
    assert [data["index"] for name, data in events if name == "content_block_start"] == [0, 1]
    whole = from_chat_response(vllm_completion({"content": None, "tool_calls": [
        {"id": "t0", "type": "function", "function": {"name": "Bash", "arguments": "{}"}},
        {"id": "t1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]}, "tool_calls"),
        model="m")
    assert [block["type"] for block in whole["content"]] == blocks

    events = run_stream([call(0, "Bash"), chunk({"content": "\n"}), chunk({"content": "Done."}),
                         chunk({}, finish_reason="stop"), usage_chunk()])
    text = "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta" and data["delta"]["type"] == "text_delta")
    assert text == "\nDone."
    assert [data["content_block"]["type"] for name, data in events if name == "content_block_start"] == \
        ["tool_use", "text"]


def test_arguments_for_a_tool_call_whose_block_stopped_are_dropped_and_the_rest_stays_json() -> None:
    # Engines do not interleave calls, but should one: the first call's arguments went out whole
    # when the second call's block began, and a later fragment of it would make them no JSON.
    def call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
        function = {"arguments": arguments} | ({"name": name} if name else {})
        return chunk({"tool_calls": [{"index": index, "type": "function", "function": function}]})

    events = run_stream([call(0, '{"a": 1}', "Bash"), call(1, "{}", "Read"), call(0, "}"),
                         chunk({}, finish_reason="tool_calls"), usage_chunk()])
    arguments: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_delta":
            arguments[data["index"]] = arguments.get(data["index"], "") + data["delta"]["partial_json"]
    assert {index: json.loads(text) for index, text in arguments.items()} == {0: {"a": 1}, 1: {}}
    assert [name for name, _ in events].count("content_block_stop") == 2


def test_stream_tool_call_whose_name_comes_late_is_held_back() -> None:
    events = run_stream([
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"arguments": '{"a"'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "Echo", "arguments": ": 1}"}}]}),
        chunk({}, finish_reason="tool_calls"),
        usage_chunk(),
    ])
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    assert events[1][1]["content_block"]["name"] == "Echo"
    assert events[2][1]["delta"]["partial_json"] == '{"a": 1}'


def test_stream_engine_error_becomes_an_error_event() -> None:
    translator = StreamTranslator(model="m")
    translator.feed(chunk({"role": "assistant", "content": ""}))
    events = translator.feed({"error": {"message": "engine overloaded", "type": "InternalServerError", "code": 500}})
    assert events == [("error", {"type": "error", "error": {"type": "api_error", "message": "engine overloaded"}})]
    assert translator.done and translator.finish() == []


def test_sse_encode_and_error_helpers() -> None:
    assert sse_encode("message_stop", {"type": "message_stop"}) == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert error_event("boom") == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
    assert error_body(400, "bad", "invalid_request_error") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert error_body(429, "slow down")["error"]["type"] == "rate_limit_error"
    assert error_body(418, "teapot")["error"]["type"] == "invalid_request_error"
    assert error_body(503, "down")["error"]["type"] == "api_error"


@pytest.mark.parametrize(("status", "given", "sent"), [
    (504, "api_error", "timeout_error"),  # the proxy's engine timeout
    (413, "api_error", "request_too_large"),  # a body over the proxy's limit
    (429, "invalid_request_error", "rate_limit_error"),  # an engine that says too many requests
    (502, "api_error", "api_error"),
    (400, "invalid_request_error", "invalid_request_error"),
    (503, "overloaded_error", "overloaded_error"),  # a specific type is kept
])
def test_the_proxys_generic_error_types_give_way_to_the_statuss_own(status: int, given: str, sent: str) -> None:
    assert error_body(status, "m", given)["error"]["type"] == sent


# ---------------------------------------------------------------------- the official SDK as the client


def sdk_client(handler: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="sk-ant-test", base_url="http://proxy.test", max_retries=0,
                               http_client=sdk_http.Client(transport=sdk_http.MockTransport(handler)))


def sse_response(chunks: list[dict[str, Any]], model: str, thinking: ThinkingDisplay | None = None) -> sdk_http.Response:
    translator = StreamTranslator(model=model, thinking=thinking)
    events = [event for c in chunks for event in translator.feed(c)] + translator.finish()
    body = b"".join(sse_encode(name, data) for name, data in events)
    return sdk_http.Response(200, headers={"content-type": "text/event-stream"}, content=body)


def test_stream_accumulates_into_final_message_against_sdk_parser() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: sdk_http.Request) -> sdk_http.Response:
        body = json.loads(request.content)
        seen.append(to_chat_request(body))
        return sse_response(tool_call_chunks(), model=body["model"])

    client = sdk_client(handler)
    with client.messages.stream(
        model="qwen3-policy", max_tokens=1024,
        messages=[{"role": "user", "content": "List the files, then read the README."}],
        tools=[{"name": "Bash", "input_schema": BASH_SCHEMA}, {"name": "Read", "input_schema": READ_SCHEMA}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()

    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert text == "I'll list the files."
    assert final.id == "msg_chatcmpl-s1" and final.model == "qwen3-policy"
    assert final.stop_reason == "tool_use"
    assert [block.type for block in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "I'll list the files."  # type: ignore[union-attr]
    bash, read = final.content[1], final.content[2]
    assert isinstance(bash, anthropic.types.ToolUseBlock) and isinstance(read, anthropic.types.ToolUseBlock)
    assert (bash.id, bash.name, bash.input) == ("chatcmpl-tool-a1", "Bash", {"command": "ls -la", "timeout": 5000})
    assert (read.id, read.name, read.input) == ("chatcmpl-tool-b2", "Read", {"file_path": "/repo/README.md"})
    assert (final.usage.input_tokens, final.usage.output_tokens) == (1200, 31)


@pytest.mark.parametrize(("fragments", "given"), [
    (["{'path': ", "'a'}"], {"_raw": "{'path': 'a'}"}),  # a model that wrote Python, not JSON
    (["[1, ", "2]"], {"_raw": "[1, 2]"}),  # JSON, but not an object
    (['{"path": ', '"a"}'], {"path": "a"}),
])
def test_streamed_tool_arguments_that_are_not_a_json_object_reach_the_sdk_as_raw_text_against_sdk_parser(
        fragments: list[str], given: dict[str, Any]) -> None:
    """The SDK parses input_json_delta as it streams and drops the whole message at the first
    fragment that cannot be JSON; a whole answer gives such arguments as {"_raw": ...}, and so
    does a stream now."""
    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "Read"}}]}),
              *[chunk({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}) for f in fragments],
              chunk({}, finish_reason="tool_calls"), usage_chunk(10, 4)]
    client = sdk_client(lambda request: sse_response(chunks, model="m"))
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                tools=[{"name": "Read", "input_schema": READ_SCHEMA}]) as stream:
        final = stream.get_final_message()
    [block] = final.content
    assert isinstance(block, anthropic.types.ToolUseBlock) and block.input == given
    whole = from_chat_response(vllm_completion({"content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": "".join(fragments)}}]},
        "tool_calls"), model="m")
    assert whole["content"][0]["input"] == given  # the same as a whole answer


def test_truncated_stream_still_parses_against_sdk_parser() -> None:
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Half an ans"})]
    client = sdk_client(lambda request: sse_response(chunks, model="m"))
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason is None
    assert final.content[0].text == "Half an ans"  # type: ignore[union-attr]


def test_stream_error_event_raises_against_sdk_parser() -> None:
    def handler(request: sdk_http.Request) -> sdk_http.Response:
        translator = StreamTranslator(model="m")
        events = translator.feed(chunk({"role": "assistant", "content": ""}))
        events += translator.feed(chunk({"content": "par"}))
        events += translator.feed({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
        body = b"".join(sse_encode(name, data) for name, data in events)
        return sdk_http.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = sdk_client(handler)
    with pytest.raises(anthropic.APIStatusError, match="engine died"):
        with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()


def test_non_streaming_message_against_sdk_parser() -> None:
    def handler(request: sdk_http.Request) -> sdk_http.Response:
        body = json.loads(request.content)
        chat = to_chat_request(body)
        assert chat["stream"] is False and chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
        answer = vllm_completion({"content": None, "tool_calls": [
            {"id": "chatcmpl-tool-9", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"pwd"}'}},
        ]}, "stop")
        return sdk_http.Response(200, json=from_chat_response(answer, model=body["model"]))

    message = sdk_client(handler).messages.create(
        model="claude-haiku-4-5", max_tokens=256, messages=[{"role": "user", "content": "where am I?"}],
        tools=[{"name": "Bash", "input_schema": BASH_SCHEMA}], tool_choice={"type": "tool", "name": "Bash"},
    )
    assert message.stop_reason == "tool_use"
    assert message.content[0].input == {"command": "pwd"}  # type: ignore[union-attr]


def test_error_body_is_raised_by_the_sdk_against_sdk_parser() -> None:
    def handler(request: sdk_http.Request) -> sdk_http.Response:
        try:
            to_chat_request(json.loads(request.content))
        except UnsupportedFeatureError as exc:
            return sdk_http.Response(exc.status_code, json=error_body(exc.status_code, exc.message, exc.error_type))
        raise AssertionError("expected the request to be refused")

    client = sdk_client(handler)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        ]}])
    assert info.value.status_code == 400
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "unsupported field messages[0].content[1].type: the engine reads no documents; "
                   "send their text as text blocks (OPENFORGE_PROXY_IMAGES=placeholder sends each as a line "
                   "of text saying it was left out)"}}


def test_claude_codes_attribution_block_never_reaches_the_engine() -> None:
    """Anthropic's API takes the block out of the prompt; the engine must not see it either."""
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.18b; cc_entrypoint=cli;"},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}]}
    chat = to_chat_request(body)
    assert chat["messages"][0] == {"role": "system", "content": "You are a Claude agent."}
    only = {**body, "system": body["system"][:1]}
    assert [m["role"] for m in to_chat_request(only)["messages"]] == ["user"]
    # Only the line goes: a prompt written into the same block after it stays.
    joined = {**body, "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli;"
                                                          "\nYou are a Claude agent."}]}
    assert to_chat_request(joined)["messages"][0] == {"role": "system", "content": "You are a Claude agent."}


def test_arguments_that_arrive_after_their_block_ended_are_dropped_not_appended_against_sdk_parser() -> None:
    """An engine that interleaves (text between a call's argument fragments) ends the tool block
    early; its arguments went out whole then, and a late fragment after them would not be JSON."""
    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "Read", "arguments": '{"x": '}}]}),
              chunk({"content": "interleaved text"}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
              chunk({}, finish_reason="tool_calls"), usage_chunk(10, 4)]
    events = run_stream(chunks)
    stopped = next(i for i, (name, data) in enumerate(events) if name == "content_block_stop" and data["index"] == 0)
    assert not [e for e in events[stopped:] if e[0] == "content_block_delta" and e[1]["index"] == 0]
    client = sdk_client(lambda request: sse_response(chunks, model="m"))
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                tools=[{"name": "Read", "input_schema": READ_SCHEMA}]) as stream:
        final = stream.get_final_message()
    tool = final.content[0]
    assert isinstance(tool, anthropic.types.ToolUseBlock) and tool.input == {"_raw": '{"x": '}


def test_a_tool_result_with_no_tool_use_before_it_is_refused_by_name() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "b"}]},
    ]}
    with pytest.raises(InvalidRequestError, match=r"messages\[3\].*'toolu_9'.*no tool_use"):
        to_chat_request(body)
    body["messages"] = body["messages"][:3]
    assert [m["role"] for m in to_chat_request(body)["messages"]] == ["user", "assistant", "tool"]


def test_consecutive_messages_of_one_role_make_one_turn_as_anthropic_combines_them() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "list the files"},
        {"role": "user", "content": [{"type": "text", "text": "then count them"}]},
        {"role": "assistant", "content": "I will look."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"c": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a b"}]},
        {"role": "user", "content": "and now?"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "two"},
    ]}
    messages = to_chat_request(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user", "system", "user"]
    assert messages[0]["content"] == "list the files\nthen count them"
    assert messages[1]["content"] == "I will look." and messages[1]["tool_calls"][0]["id"] == "toolu_1"
    assert (messages[2]["content"], messages[3]["content"]) == ("a b", "and now?")


def test_a_prefill_after_an_assistant_turn_continues_the_combined_turn() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "there"}]},
    ]}
    chat = to_chat_request(body)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert chat["messages"][1]["content"] == "Hello\nthere" and chat["continue_final_message"] is True


def test_an_error_in_a_combined_turn_names_the_message_it_is_in() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]},
    ]}
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\.content\[1\]\.text"):
        to_chat_request(body)


# ---------------------------------------------------------------------------------------- reasoning

THOUGHT = ["The user wants", " the files listed."]


def thinking_chunks(field: str = "reasoning") -> list[dict[str, Any]]:
    """vLLM's stream for a reasoning model: its thinking (vLLM's reasoning parser), then text and calls."""
    return [chunk({"role": "assistant", "content": ""}),
            *(chunk({field: piece}) for piece in THOUGHT),
            *tool_call_chunks()[1:]]


@pytest.mark.parametrize(("field", "thinking"), [
    ("reasoning", {"type": "enabled", "budget_tokens": 512}),
    ("reasoning_content", {"type": "enabled", "budget_tokens": 512}),  # vLLM's name before it renamed it
    ("reasoning", {"type": "adaptive", "display": "omitted"}),  # as Claude Code asks on most calls
])
def test_a_thinking_models_stream_gives_a_signed_thinking_block_that_goes_back_as_reasoning_against_sdk_parser(
        field: str, thinking: dict[str, Any]) -> None:
    requests: list[dict[str, Any]] = []

    def handler(request: sdk_http.Request) -> sdk_http.Response:
        body = json.loads(request.content)
        requests.append(to_chat_request(body))
        return sse_response(thinking_chunks(field), model=body["model"], thinking=thinking_display(body))

    client = sdk_client(handler)
    asked: list[Any] = [{"role": "user", "content": "List the files, then read the README."}]
    tools: list[Any] = [{"name": "Bash", "input_schema": BASH_SCHEMA}, {"name": "Read", "input_schema": READ_SCHEMA}]
    with client.messages.stream(model="m", max_tokens=1024, messages=asked, thinking=thinking,  # type: ignore[arg-type]
                                tools=tools) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    block = final.content[0]
    assert isinstance(block, anthropic.types.ThinkingBlock) and block.signature.startswith("openforge-1.")
    # Shown, or left out as Anthropic leaves it out for "omitted" (the signature still carries it).
    assert block.thinking == ("" if thinking.get("display") == "omitted" else "".join(THOUGHT))

    # The harness sends the turn back as it got it: the engine sees its own thinking where it wrote it.
    history = [b.model_dump(exclude_none=True) for b in final.content]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
               for b in final.content if isinstance(b, anthropic.types.ToolUseBlock)]
    client.messages.create(model="m", max_tokens=64, thinking=thinking,  # type: ignore[arg-type]
                           messages=[*asked, {"role": "assistant", "content": history},
                                     {"role": "user", "content": results}], tools=tools, stream=True).close()
    turn = requests[1]["messages"][1]
    assert turn["role"] == "assistant" and turn["reasoning"] == "".join(THOUGHT)
    assert turn["content"] == "I'll list the files." and len(turn["tool_calls"]) == 2


def test_the_engine_gets_its_thinking_back_from_the_signature_and_never_another_models() -> None:
    thought = "".join(THOUGHT)

    def turn(*blocks: dict[str, Any]) -> dict[str, Any]:
        chat = to_chat_request({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [*blocks, {"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "bye"}]})
        return chat["messages"][1]  # type: ignore[no-any-return]

    assert turn({"type": "thinking", "thinking": thought, "signature": signature(thought)})["reasoning"] == thought
    # Exactly as the engine wrote it, whatever a client did to the shown text.
    assert turn({"type": "thinking", "thinking": thought.strip() + " (edited)",
                 "signature": signature(thought)})["reasoning"] == thought
    assert turn({"type": "thinking", "thinking": "", "signature": signature("é\n ")})["reasoning"] == "é\n "
    # Claude's own thinking, a mangled signature, redacted thinking: not this model's tokens.
    for foreign in ("EqQBCkgIARABGAIiQL", "openforge-1.%%%", "openforge-1.__8", None):
        assert "reasoning" not in turn({"type": "thinking", "thinking": thought, "signature": foreign}), foreign
    two = turn({"type": "thinking", "thinking": "first", "signature": signature("first")},
               {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
               {"type": "thinking", "thinking": "", "signature": signature("second")})
    assert two["reasoning"] == "first\nsecond"


def test_reasoning_is_left_out_when_the_request_did_not_turn_thinking_on_against_sdk_parser() -> None:
    client = sdk_client(lambda request: sse_response(thinking_chunks(), model="m",
                                                     thinking=thinking_display(json.loads(request.content))))
    for thinking in ({"type": "disabled"}, None):
        extra = {"thinking": thinking} if thinking else {}
        with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                    **extra) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["text", "tool_use", "tool_use"]


@pytest.mark.parametrize("thinking", ["summarized", "omitted", None])
def test_a_whole_answers_reasoning_is_a_thinking_block_first_against_sdk_parser(thinking: ThinkingDisplay | None) -> None:
    answer = vllm_completion({"reasoning": "Where? pwd says.", "content": "Let me check.", "tool_calls": [
        {"id": "chatcmpl-tool-9", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"pwd"}'}},
    ]}, "tool_calls")
    client = sdk_client(lambda request: sdk_http.Response(200, json=from_chat_response(answer, model="m",
                                                                                      thinking=thinking)))
    message = client.messages.create(model="m", max_tokens=256, messages=[{"role": "user", "content": "where am I?"}])
    kinds = [block.type for block in message.content]
    assert kinds == (["thinking", "text", "tool_use"] if thinking else ["text", "tool_use"])
    if thinking:
        block = message.content[0]
        assert isinstance(block, anthropic.types.ThinkingBlock)
        assert block.thinking == ("Where? pwd says." if thinking == "summarized" else "")
        assert block.signature == signature("Where? pwd says.")


def test_the_adapter_turns_thinking_on_from_the_request() -> None:
    adapter = AnthropicAdapter()
    answer = vllm_completion({"reasoning": "hmm", "content": "Hi."}, "stop")
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert [b["type"] for b in adapter.from_chat(answer, body | {"thinking": {"type": "adaptive"}}, {})["content"]] \
        == ["thinking", "text"]
    assert [b["type"] for b in adapter.from_chat(answer, body, {})["content"]] == ["text"]
    stream = adapter.stream(body | {"thinking": {"type": "enabled", "budget_tokens": 64}}, {})
    out = stream.feed(chunk({"role": "assistant", "content": ""})) + stream.feed(chunk({"reasoning": "hmm"}))
    assert b'"thinking_delta"' in out
    omitted = adapter.stream(body | {"thinking": {"type": "adaptive", "display": "omitted"}}, {})
    out = omitted.feed(chunk({"role": "assistant", "content": ""})) + omitted.feed(chunk({"reasoning": "hmm"}))
    assert b'"thinking"' in out and b'"thinking_delta"' not in out
    assert signature("hmm").encode() in omitted.finish()


@pytest.mark.parametrize("thinking", ["omitted", "summarized"])
def test_keepalives_reach_the_client_as_events_that_change_nothing_against_sdk_parser(
        thinking: ThinkingDisplay) -> None:
    """The SDKs drop ``ping`` before their caller sees it, so it resets no harness's idle watchdog
    (Claude Code's aborts a stream after five minutes without an event). A keep-alive is an empty
    delta of the open block, or ``message_start`` before the first token: the message the SDK
    builds is the same as without them."""
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "Let me look."}),
              chunk({"reasoning": " Then read."}), *tool_call_chunks()[1:]]
    plain = StreamTranslator(model="m", thinking=thinking, message_id="msg_1")
    plain_events = [event for c in chunks for event in plain.feed(c)] + plain.finish()
    kept = StreamTranslator(model="m", thinking=thinking, message_id="msg_1")
    kept_events = kept.keepalive()  # a long queue before the first token
    assert [name for name, _ in kept_events] == ["message_start"]
    sent: list[tuple[str, dict[str, Any]]] = []
    for c in chunks:
        kept_events += kept.feed(c)
        sent += kept.keepalive()
        kept_events += sent[-1:]
    kept_events += kept.finish()
    assert kept.keepalive() == []  # none after the end
    deltas = {data["delta"]["type"] for name, data in sent if name == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    assert all(data["delta"].get("partial_json", data["delta"].get("text", data["delta"].get("thinking"))) == ""
               for name, data in sent if name == "content_block_delta")
    assert ("ping", {"type": "ping"}) in sent  # between blocks (the tool call's name not in yet, or usage awaited)

    def final(events: list[tuple[str, dict[str, Any]]]) -> anthropic.types.Message:
        body = b"".join(sse_encode(name, data) for name, data in events)
        client = sdk_client(lambda request: sdk_http.Response(200, headers={"content-type": "text/event-stream"},
                                                               content=body))
        with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
            return stream.get_final_message()

    assert final(kept_events).model_dump() == final(plain_events).model_dump()


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"id": 18446744073709551616}', {"id": 18446744073709551616}),  # 2**64: past orjson's integers
    ('{"id": -9223372036854775809, "f": 1.5}', {"id": -9223372036854775809, "f": 1.5}),
    ('{"digits": "12345678901234567890"}', {"digits": "12345678901234567890"}),  # long digits in a string
    ('{"id": 12345678901234567890, "x": NaN}', {"_raw": '{"id": 12345678901234567890, "x": NaN}'}),  # not JSON
    # What orjson refuses is refused on this path too, not read and then unwritable (a 500):
    ('{"ts": 1234567890123456789, "x": 1e400}', {"_raw": '{"ts": 1234567890123456789, "x": 1e400}'}),
    ('{"id": "1234567890123456789", "s": "\\ud800"}', {"_raw": '{"id": "1234567890123456789", "s": "\\ud800"}'}),
    ('[' * 5000 + '1234567890123456789' + ']' * 5000, {"_raw": '[' * 5000 + '1234567890123456789' + ']' * 5000}),
])
def test_tool_arguments_keep_integers_past_64_bits_exactly(arguments: str, expected: dict[str, Any]) -> None:
    chat = vllm_completion({"content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Lookup", "arguments": arguments}},
    ]}, "tool_calls")
    [block] = from_chat_response(chat, model="m")["content"]
    assert block["input"] == expected
    assert all(type(block["input"][k]) is type(v) for k, v in expected.items())  # an int, not a float equal to it
