"""Responses API <-> chat completions translation, checked against the openai SDK's own models.

Tests whose names end in ``_against_sdk_parser`` serve translated events through
``httpx.MockTransport`` to the official openai client: the transport is simulated, the
SDK's request building and stream parsing are real.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from proxy.errors import InvalidRequestError, UnsupportedFeatureError
from proxy.media import IMAGE_PLACEHOLDER
from proxy.responses.translate import (
    StreamTranslator,
    UpstreamFormatError,
    error_body,
    from_chat_response,
    sse_encode,
    to_chat_request,
)

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
PLAN_TOOL = {
    "type": "function",
    "name": "update_plan",
    "description": "Updates the task plan.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"plan": {"type": "array"}}, "required": ["plan"]},
}
APPLY_PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the apply_patch tool to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" LF'},
}
SHELL_ARGS = '{"command": ["bash", "-lc", "ls -la"], "workdir": "/repo"}'


def codex_request(**overrides: Any) -> dict[str, Any]:
    """A request shaped like Codex CLI's second call of a turn."""
    body: dict[str, Any] = {
        "model": "qwen-tiny",
        "instructions": "You are a coding agent running in the Codex CLI.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions instructions>sandbox off"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files in the repo."}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Listing files."}],
                "encrypted_content": "gAAAA-opaque",
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look."}],
            },
            {"type": "function_call", "name": "shell", "arguments": SHELL_ARGS, "call_id": "call_a"},
            {
                "type": "function_call",
                "name": "update_plan",
                "arguments": '{"plan": []}',
                "call_id": "call_b",
            },
            {"type": "function_call_output", "call_id": "call_a", "output": "README.md\nsrc\n"},
            {"type": "function_call_output", "call_id": "call_b", "output": "Plan updated"},
        ],
        "tools": [SHELL_TOOL, PLAN_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0198-session",
        "text": {"verbosity": "medium"},
    }
    body.update(overrides)
    return body


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")},
    }


# --------------------------------------------------------------------------- requests


def test_codex_like_request_becomes_the_expected_chat_body() -> None:
    assert to_chat_request(codex_request()) == {
        "model": "qwen-tiny",
        "messages": [
            {"role": "system", "content": "You are a coding agent running in the Codex CLI."},
            {"role": "system", "content": "<permissions instructions>sandbox off"},
            {"role": "user", "content": "List the files in the repo."},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": SHELL_ARGS}},
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "update_plan", "arguments": '{"plan": []}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "README.md\nsrc\n"},
            {"role": "tool", "tool_call_id": "call_b", "content": "Plan updated"},
        ],
        "tools": [chat_tool(SHELL_TOOL), chat_tool(PLAN_TOOL)],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_tool_choice_required_and_named_function() -> None:
    assert to_chat_request(codex_request(tool_choice="required"))["tool_choice"] == "required"
    named = to_chat_request(codex_request(tool_choice={"type": "function", "name": "shell"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "shell"}}
    with pytest.raises(InvalidRequestError, match="tool_choice names function tool 'nope'"):
        to_chat_request(codex_request(tool_choice={"type": "function", "name": "nope"}))


def test_function_call_without_assistant_text_starts_an_assistant_message() -> None:
    chat = to_chat_request(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c1"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    assert chat["stream"] is False and "stream_options" not in chat and "tools" not in chat


def test_plain_string_input_and_sampling_fields() -> None:
    chat = to_chat_request(
        {
            "model": "m",
            "input": "Say hi",
            "max_output_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "tool_choice": "auto",
            "metadata": {"k": "v"},
            "user": "u",
            "service_tier": "auto",
            "truncation": "disabled",
        }
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "stream": False,
    }


def test_custom_tool_becomes_a_function_with_one_string_argument() -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    chat = to_chat_request(
        codex_request(
            tools=[SHELL_TOOL, APPLY_PATCH_TOOL],
            tool_choice={"type": "custom", "name": "apply_patch"},
            input=[
                {"role": "user", "content": "add a file"},
                {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": patch},
                {"type": "custom_tool_call_output", "call_id": "c9", "output": "Done!"},
            ],
        )
    )
    function = chat["tools"][1]["function"]
    assert function["name"] == "apply_patch"
    assert function["parameters"]["required"] == ["input"]
    assert function["parameters"]["properties"]["input"]["type"] == "string"
    assert 'start: "*** Begin Patch" LF' in function["parameters"]["properties"]["input"]["description"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    call = chat["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": patch}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c9", "content": "Done!"}


def test_json_schema_text_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = to_chat_request(
        codex_request(text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }
    assert "response_format" not in to_chat_request(codex_request(text={"format": {"type": "text"}}))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"tools": [SHELL_TOOL, {"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools[1].type"),
        ({"tools": [SHELL_TOOL], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        # Required, with only a hosted tool (left out): the tool is what cannot be translated.
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "local_shell"}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "what is this?"},
                            {"type": "input_file", "file_url": "https://example.com/a.pdf"},
                        ],
                    }
                ]
            },
            "input[0].content[1].type",
        ),
        ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1].type"),
        ({"input": [{"type": "web_search_call", "id": "ws", "status": "completed"}]}, "input[0].type"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
        ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include"),
    ],
)
def test_unsupported_features_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedFeatureError) as caught:
        to_chat_request(codex_request(**overrides))
    assert caught.value.field == field
    assert field in caught.value.message


def test_previous_response_id_message_says_the_proxy_is_stateless() -> None:
    with pytest.raises(UnsupportedFeatureError, match="stateless"):
        to_chat_request(codex_request(previous_response_id="resp_1"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": None}, "model is required"),
        ({"input": 42}, "input must be a string or a list"),
        ({"input": [], "instructions": None}, "input is required"),
        ({"input": ["hello"]}, r"input\[0\] must be an object"),
        ({"input": [{"role": "robot", "content": "x"}]}, r"input\[0\]\.role must be one of"),
        ({"input": [{"type": "function_call", "name": "shell", "arguments": "{}"}]}, r"input\[0\]\.call_id"),
        ({"max_output_tokens": "100"}, "max_output_tokens must be a positive integer"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"stream": "yes"}, "stream must be a boolean"),
        ({"tools": [{"type": "function", "description": "no name"}]}, r"tools\[0\]\.name"),
        ({"tools": [SHELL_TOOL, SHELL_TOOL]}, r"tools\[1\]\.name: tool name 'shell' is used twice"),
        ({"tools": [], "tool_choice": "required"}, 'tool_choice "required" needs at least one tool'),
    ],
)
def test_invalid_requests_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        to_chat_request(codex_request(**overrides))
    assert not isinstance(caught.value, UnsupportedFeatureError)


# --------------------------------------------------------------------------- answers


def chat_completion(message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-7f3a",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "/models/policy-step-12",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
    }


def test_text_answer_validates_as_an_sdk_response() -> None:
    request = codex_request(stream=False)
    body = from_chat_response(chat_completion({"role": "assistant", "content": "Hello there."}), request=request)
    response = Response.model_validate(body)
    assert response.id == "resp_7f3a"
    assert response.model == "qwen-tiny" and response.created_at == 1_700_000_000
    assert response.status == "completed"
    assert response.output_text == "Hello there."
    assert response.output[0].id == "msg_7f3a"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (120, 30, 150)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.parallel_tool_calls is False
    assert [tool.type for tool in response.tools] == ["function", "function"]
    assert (
        from_chat_response(chat_completion({"role": "assistant", "content": "x"}), request=request)["id"] == body["id"]
    )


def test_tool_call_answer_gives_function_call_items() -> None:
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "shell", "arguments": SHELL_ARGS}},
            {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "update_plan", "arguments": "{}"}},
        ],
    }
    body = from_chat_response(chat_completion(message, "tool_calls"), request=codex_request())
    response = Response.model_validate(body)
    assert response.output_text == "Checking."
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments, c.id, c.status) for c in calls] == [
        ("chatcmpl-tool-1", "shell", SHELL_ARGS, "fc_7f3a_0", "completed"),
        ("chatcmpl-tool-2", "update_plan", "{}", "fc_7f3a_1", "completed"),
    ]


def test_length_finish_is_incomplete_with_max_output_tokens() -> None:
    body = from_chat_response(chat_completion({"role": "assistant", "content": "Once upon"}, "length"), request={})
    response = Response.model_validate(body)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


@pytest.mark.parametrize("arguments", [
    json.dumps({"input": "*** Begin Patch\n*** End Patch"}),
    '{"input": "*** Begin Patch\n*** End Patch"}',  # line breaks written into the string as they are
], ids=["escaped", "raw-line-breaks"])
def test_custom_tool_answer_gives_custom_tool_call_item(arguments: str) -> None:
    patch = "*** Begin Patch\n*** End Patch"
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_p",
                "type": "function",
                "function": {"name": "apply_patch", "arguments": arguments},
            }
        ],
    }
    request = codex_request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL])
    response = Response.model_validate(from_chat_response(chat_completion(message, "tool_calls"), request=request))
    (item,) = response.output
    assert item.type == "custom_tool_call"
    assert (item.call_id, item.name, item.input, item.id) == ("call_p", "apply_patch", patch, "ctc_7f3a_0")


def test_answer_without_choices_is_an_upstream_error() -> None:
    with pytest.raises(UpstreamFormatError):
        from_chat_response({"id": "chatcmpl-1", "choices": []}, request={})


# --------------------------------------------------------------------------- streaming


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-9b1c",
        "object": "chat.completion.chunk",
        "created": 1_700_000_001,
        "model": "qwen-tiny",
        "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk() -> dict[str, Any]:
    return {
        "id": "chatcmpl-9b1c",
        "object": "chat.completion.chunk",
        "created": 1_700_000_001,
        "model": "qwen-tiny",
        "choices": [],
        "usage": {"prompt_tokens": 200, "completion_tokens": 25, "total_tokens": 225},
    }


def tool_call_chunks() -> list[dict[str, Any]]:
    """What the engine streams for text followed by one tool call split over chunks."""
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk(
            {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-5", "type": "function", "function": {"name": "shell"}}]}
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": ["bash", '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"-lc", "ls -la"], '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"workdir": "/repo"}'}}]}),
        chunk({}, "tool_calls"),
        usage_chunk(),
    ]


def translate(chunks: list[dict[str, Any]], request: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    translator = StreamTranslator(request=request)
    events = [event for c in chunks for event in translator.feed(c)]
    return events + translator.finish()


def test_stream_event_order_and_sequence_numbers() -> None:
    events = translate(tool_call_chunks(), codex_request())
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)

    arguments_deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    (done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert arguments_deltas == done["arguments"] == SHELL_ARGS
    assert done["output_index"] == 1 and done["item_id"] == "fc_9b1c_0"
    assert done["name"] == "shell"  # newer SDKs declare it on this event

    final = Response.model_validate(events[-1][1]["response"])
    assert final.status == "completed"
    assert final.output_text == "Let me check."
    assert final.usage is not None and final.usage.total_tokens == 225
    assert final.output[1].type == "function_call"
    assert (final.output[1].call_id, final.output[1].arguments) == ("chatcmpl-tool-5", SHELL_ARGS)
    # The terminal event comes with the usage chunk, so finish() has nothing left to say.
    translator = StreamTranslator(request=codex_request())
    for c in tool_call_chunks():
        translator.feed(c)
    assert translator.terminated and translator.finish() == []


def test_whitespace_between_two_tool_calls_of_one_turn_makes_no_message_item() -> None:
    # What parsers stream between "</tool_call>" and the next "<tool_call>": as a message item
    # it would split the turn in two when the harness sends its history back. Whitespace with
    # text after it is still the model's text.
    def call(index: int, name: str) -> list[dict[str, Any]]:
        return [chunk({"tool_calls": [{"index": index, "id": f"t{index}", "type": "function",
                                        "function": {"name": name, "arguments": "{}"}}]})]

    chunks = [*call(0, "shell"), chunk({"content": "\n"}), chunk({"content": " "}), *call(1, "read"),
              chunk({"content": "\n"}), chunk({}, "tool_calls"), usage_chunk()]
    final = translate(chunks, codex_request())[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["function_call", "function_call"]
    chunks = [*call(0, "shell"), chunk({"content": "\n"}), chunk({"content": "Done."}), chunk({}, "stop"),
              usage_chunk()]
    final = translate(chunks, codex_request())[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["function_call", "message"]
    assert final["output"][1]["content"][0]["text"] == "\nDone."


def test_tool_calls_without_an_index_are_told_apart_by_their_place_in_the_chunk() -> None:
    # vLLM numbers its calls; an engine that does not, sending two calls in one chunk, still
    # made two calls (the Messages stream reads them the same way).
    calls = [{"id": f"t{n}", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for n, name in enumerate(("shell", "read"))]
    final = translate([chunk({"tool_calls": calls}), chunk({}, "tool_calls"), usage_chunk()],
                      codex_request())[-1][1]["response"]
    assert [(item["type"], item["call_id"], item["name"]) for item in final["output"]] == [
        ("function_call", "t0", "shell"), ("function_call", "t1", "read")]


def test_streamed_and_unstreamed_answers_agree() -> None:
    events = translate(tool_call_chunks(), codex_request())
    streamed = events[-1][1]["response"]
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"id": "chatcmpl-tool-5", "type": "function", "function": {"name": "shell", "arguments": SHELL_ARGS}}
        ],
    }
    chat = chat_completion(message, "tool_calls") | {"id": "chatcmpl-9b1c", "created": 1_700_000_001}
    unstreamed = from_chat_response(chat, request=codex_request())
    assert streamed["output"] == unstreamed["output"]
    assert streamed["id"] == unstreamed["id"] == "resp_9b1c"


def test_after_a_length_cut_only_the_last_item_is_incomplete_streamed_or_not() -> None:
    # The reasoning ended when the text began: only the text was cut off, in both forms.
    chunks = [chunk({"reasoning": "Think."}), chunk({"content": "Once upon"}), chunk({}, "length"), usage_chunk()]
    streamed = translate(chunks, codex_request())[-1][1]["response"]
    chat = chat_completion({"role": "assistant", "reasoning": "Think.", "content": "Once upon"}, "length")
    chat |= {"id": "chatcmpl-9b1c", "created": 1_700_000_001}
    unstreamed = from_chat_response(chat, request=codex_request())
    assert [(item["type"], item["status"]) for item in unstreamed["output"]] == [
        ("reasoning", "completed"), ("message", "incomplete")]
    assert streamed["output"] == unstreamed["output"]
    assert streamed["status"] == unstreamed["status"] == "incomplete"



@pytest.mark.parametrize("finish_reason", ["tool_calls", "length"])
def test_a_custom_tool_call_before_another_item_is_the_same_streamed_or_not(finish_reason: str) -> None:
    # A custom tool call has no status in the API, in neither form.
    arguments = json.dumps({"input": "*** Begin Patch\n*** End Patch"})
    request = codex_request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL])
    chunks = [chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "apply_patch",
                                                                           "arguments": arguments}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "shell", "arguments": "{}"}}]}),
              chunk({}, finish_reason), usage_chunk()]
    streamed = translate(chunks, request)[-1][1]["response"]
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": args}}
             for k, (name, args) in enumerate([("apply_patch", arguments), ("shell", "{}")])]
    chat = chat_completion({"role": "assistant", "content": None, "tool_calls": calls}, finish_reason)
    chat |= {"id": "chatcmpl-9b1c", "created": 1_700_000_001}
    unstreamed = from_chat_response(chat, request=request)
    assert [item["type"] for item in unstreamed["output"]] == ["custom_tool_call", "function_call"]
    assert "status" not in unstreamed["output"][0]
    assert streamed["output"] == unstreamed["output"]


def test_every_stream_event_validates_against_the_sdk_union() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for name, data in translate(tool_call_chunks(), codex_request()):
        assert adapter.validate_python(data).type == name


def test_parallel_tool_calls_close_one_after_another() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function", "function": {"name": "shell"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": ["pwd"]}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "c1", "type": "function", "function": {"name": "update_plan"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"plan": []}'}}]}),
        chunk({}, "tool_calls"),
    ]
    events = translate(chunks, codex_request())  # no usage chunk: finish() ends it
    names = [name for name, _ in events]
    assert names[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1][1]["response"])
    assert [(item.type, getattr(item, "call_id", None)) for item in final.output] == [
        ("function_call", "c0"),
        ("function_call", "c1"),
    ]
    assert final.usage is None


def test_tool_call_continuing_after_the_next_started_is_an_upstream_error() -> None:
    translator = StreamTranslator(request={})
    opened = translator.feed(chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "x"}}]}))
    opened += translator.feed(chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "y"}}]}))
    events = translator.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    assert events[-1][0] == "response.failed" and "tool call 0" in (translator.failure or "")
    every = opened + events
    assert [data["sequence_number"] for _, data in every] == list(range(len(every)))
    assert translator.feed(chunk({"content": "more"})) == [] and translator.finish() == []


@pytest.mark.parametrize("bad", [
    {"id": "chatcmpl-abc", "choices": "oops"},  # the very first chunk
    {"choices": [{"index": 0, "delta": "not an object"}]},
])
def test_a_chunk_that_cannot_be_translated_ends_the_stream_well_formed_against_sdk_parser(
        bad: dict[str, Any]) -> None:
    """What came before the bad chunk is kept, numbered without gaps, and the SDK sees a failed response."""
    before = tool_call_chunks()[:5] if "id" not in bad else []
    client = sdk_client([*before, bad], [])
    events = list(client.responses.create(model="qwen-tiny", input="List files", tools=[SHELL_TOOL],  # type: ignore[list-item]
                                          stream=True))
    client.close()
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = {e.item.id for e in events if e.type == "response.output_item.added"}  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert {item.id for item in failed.output} == added  # nothing listed that was never announced
    assert all(item.status == "incomplete" for item in failed.output if item.type == "function_call")


def test_a_tool_call_the_engine_never_named_is_an_upstream_error() -> None:
    nameless = {"tool_calls": [{"index": 0, "id": "c0", "function": {"arguments": "{}"}}]}
    translator = StreamTranslator(request={})
    events = translator.feed(chunk(nameless)) + translator.feed(chunk({}, "tool_calls")) + translator.finish()
    assert events[-1][0] == "response.failed" and "no name" in (translator.failure or "")
    assert not [e for e in events if e[0] == "response.output_item.done"]
    message = {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
                                                                      "function": {"arguments": "{}"}}]}
    with pytest.raises(UpstreamFormatError, match="no name"):
        from_chat_response(chat_completion(message, "tool_calls"), request={})


def test_an_answer_without_an_end_fails_and_says_so() -> None:
    translator = StreamTranslator(request={})
    events = translator.feed(chunk({"content": "Hel"})) + translator.finish()
    assert events[-1][0] == "response.failed" and translator.failure is not None


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "hi", "tools": [{"type": ["function"], "name": "x"}]},
    {"model": "m", "input": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]},
])
def test_a_type_that_is_not_a_string_is_refused_by_name(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match=r"\.type is required and must be a string"):
        to_chat_request(body)


def test_length_finish_streams_response_incomplete() -> None:
    events = translate([chunk({"content": "Once upon"}), chunk({}, "length"), usage_chunk()], codex_request())
    name, data = events[-1]
    assert name == "response.incomplete"
    response = Response.model_validate(data["response"])
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


@pytest.mark.parametrize("tool", ["shell", "apply_patch"])
def test_a_tool_call_the_output_limit_cut_off_gets_no_done_event(tool: str) -> None:
    # Codex runs a call at its output_item.done, whatever its status: a command or a patch cut
    # short by max_output_tokens must not run. The text before it ended and is done as usual.
    arguments = '{"command": ["rm", "-rf", "bu' if tool == "shell" else '{"input": "*** Begin Patch\\n*** Add'
    chunks = [chunk({"content": "Cleaning up."}),
              chunk({"tool_calls": [{"index": 0, "id": "c0", "function": {"name": tool, "arguments": arguments}}]}),
              chunk({}, "length"), usage_chunk()]
    events = translate(chunks, codex_request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL]))
    names = [name for name, _ in events]
    assert names.count("response.output_item.added") == 2 and names.count("response.output_item.done") == 1
    assert not [n for n in names if n.endswith(("arguments.done", "input.done"))]
    assert names[-1] == "response.incomplete"
    final = Response.model_validate(events[-1][1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call" if tool == "shell" else "custom_tool_call"]
    assert final.output[0].status == "completed"
    assert tool != "shell" or final.output[1].status == "incomplete"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))


def test_upstream_ending_early_still_gives_one_terminal_event() -> None:
    translator = StreamTranslator(request=codex_request())
    events = translator.feed(chunk({"content": "Partial"}))
    events += translator.feed(chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "shell"}}]}))
    events += translator.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"comm'}}]}))
    tail = translator.finish()
    # No done event for a cut-off item: Codex runs a function call at its output_item.done,
    # whatever its status, and the command here is cut short.
    assert [name for name, _ in tail] == ["response.failed"]
    failed = Response.model_validate(tail[-1][1]["response"])
    assert failed.status == "failed"
    assert failed.error is not None and "ended before" in failed.error.message
    # The text ended when the call began (the harness saw it done); the call did not.
    assert [(item.type, item.status) for item in failed.output] == [("message", "completed"),
                                                                    ("function_call", "incomplete")]
    sequence = [data["sequence_number"] for _, data in events + tail]
    assert sequence == list(range(len(sequence)))
    assert translator.finish() == []
    assert translator.feed(usage_chunk()) == []
    assert translator.failed_event("again") == []


def test_stream_with_no_chunks_at_all_is_well_formed() -> None:
    translator = StreamTranslator(request={"model": "m"}, response_id="resp_given")
    events = translator.finish()
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.failed"]
    assert {data["response"]["id"] for _, data in events} == {"resp_given"}


def test_engine_error_chunk_becomes_response_failed() -> None:
    translator = StreamTranslator(request=codex_request())
    translator.feed(chunk({"content": "Hi"}))
    events = translator.feed({"error": {"message": "engine overloaded", "type": "InternalServerError"}})
    assert [name for name, _ in events] == ["response.failed"]
    assert events[0][1]["response"]["error"] == {"code": "server_error", "message": "engine overloaded"}
    assert translator.finish() == []


def test_failed_event_mid_stream_is_the_only_terminal_event() -> None:
    translator = StreamTranslator(request=codex_request())
    translator.feed(chunk({"content": "Hi"}))
    (failed,) = translator.failed_event("upstream connection reset")
    assert failed[0] == "response.failed"
    assert Response.model_validate(failed[1]["response"]).status == "failed"
    assert translator.finish() == []


def test_custom_tool_call_streams_its_decoded_input() -> None:
    patch = '*** Begin Patch\n*** Add File: "q.txt"\n+hi\n*** End Patch'
    encoded = json.dumps({"input": patch})
    chunks = [
        chunk({"tool_calls": [{"index": 0, "id": "call_p", "function": {"name": "apply_patch", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": encoded[:20]}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": encoded[20:]}}]}),
        chunk({}, "tool_calls"),
        usage_chunk(),
    ]
    events = translate(chunks, codex_request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL]))
    assert [name for name, _ in events][2:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2][1]["item"]["type"] == "custom_tool_call"
    assert events[3][1]["delta"] == events[4][1]["input"] == patch
    final = Response.model_validate(events[-1][1]["response"])
    (item,) = final.output
    assert item.type == "custom_tool_call" and item.input == patch


# --------------------------------------------------------------------------- through the official SDK


def sdk_client(chunks: list[dict[str, Any]], seen: list[dict[str, Any]]) -> openai.OpenAI:
    """An openai client whose transport translates the request and streams translated events."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/responses"
        body = json.loads(request.content)
        seen.append(to_chat_request(body))
        translator = StreamTranslator(request=body)
        events = [event for c in chunks for event in translator.feed(c)] + translator.finish()
        payload = b"".join(sse_encode(name, data) for name, data in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=payload)

    http_client = httpx.Client(transport=httpx.MockTransport(handler))
    return openai.OpenAI(base_url="http://proxy.test/v1", api_key="sk-test", http_client=http_client)


def test_stream_get_final_response_against_sdk_parser() -> None:
    seen: list[dict[str, Any]] = []
    client = sdk_client(tool_call_chunks(), seen)
    with client.responses.stream(
        model="qwen-tiny",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "List files"}]}],
        tools=[SHELL_TOOL],  # type: ignore[list-item]
        tool_choice="required",
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    client.close()

    assert deltas == ["Let me ", "check."]
    assert final.output_text == "Let me check."
    call = final.output[1]
    assert call.type == "function_call"
    assert (call.name, call.call_id, json.loads(call.arguments)["command"]) == (
        "shell",
        "chatcmpl-tool-5",
        ["bash", "-lc", "ls -la"],
    )
    (chat,) = seen
    assert chat["stream"] is True and chat["tool_choice"] == "required"
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}


def test_create_stream_events_against_sdk_parser() -> None:
    seen: list[dict[str, Any]] = []
    client = sdk_client(tool_call_chunks(), seen)
    stream = client.responses.create(model="qwen-tiny", input="List files", tools=[SHELL_TOOL], stream=True)  # type: ignore[list-item]
    events = list(stream)
    client.close()
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response  # type: ignore[union-attr]
    assert completed.output_text == "Let me check."
    assert completed.output[1].type == "function_call"
    assert completed.output[1].arguments == SHELL_ARGS


def test_custom_tool_stream_against_sdk_parser() -> None:
    patch = "*** Begin Patch\n*** Delete File: old.txt\n*** End Patch"
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_p", "function": {"name": "apply_patch"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": json.dumps({"input": patch})}}]}),
        chunk({}, "tool_calls"),
        usage_chunk(),
    ]
    client = sdk_client(chunks, [])
    with client.responses.stream(model="qwen-tiny", input="delete old.txt", tools=[APPLY_PATCH_TOOL]) as stream:  # type: ignore[list-item]
        final = stream.get_final_response()
    client.close()
    (item,) = final.output
    assert item.type == "custom_tool_call"
    assert (item.name, item.call_id, item.input) == ("apply_patch", "call_p", patch)


def test_early_end_surfaces_as_failed_event_against_sdk_parser() -> None:
    client = sdk_client([chunk({"content": "Par"})], [])
    events = list(client.responses.create(model="qwen-tiny", input="hi", stream=True))
    client.close()
    assert [e.type for e in events][-1] == "response.failed"
    assert events[-1].response.error is not None  # type: ignore[union-attr]


def relay_with_a_lost_record(chunks: list[dict[str, Any]]) -> bytes:
    """What the proxy sends for ``chunks`` when the call's record is then lost: what it sent
    before the answer finished, then, instead of what it held back, the session's failure."""
    from proxy.responses.adapter import ResponsesAdapter

    session = ResponsesAdapter().stream(codex_request(stream=True), {})
    sent: list[bytes] = []
    finished = False
    for c in chunks:
        if "error" in c and not c.get("choices"):
            session.fail("the engine failed")
            session.hold()
            break
        finished = finished or any(choice.get("finish_reason") for choice in c["choices"])
        out = session.feed(c)
        if finished:
            session.hold()
        else:
            sent.append(out)
    else:
        session.finish()
    return b"".join(sent) + session.unrecorded("the call could not be recorded; send it again")


def sdk_events(payload: bytes) -> list[Any]:
    """``payload`` read by the openai SDK as a Responses stream."""
    transport = httpx.MockTransport(
        lambda _: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=payload))
    client = openai.OpenAI(base_url="http://proxy.test/v1", api_key="sk-test", http_client=httpx.Client(transport=transport))
    try:
        return list(client.responses.create(model="qwen-tiny", input="hi", stream=True))
    finally:
        client.close()


def test_a_stream_whose_record_is_lost_fails_in_place_of_its_held_end() -> None:
    events = sdk_events(relay_with_a_lost_record(tool_call_chunks()))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds
    assert "response.completed" not in kinds and "response.function_call_arguments.done" not in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))  # no gap where the held ones were
    assert events[-1].response.error.message == "the call could not be recorded; send it again"  # type: ignore[union-attr]
    # The failed response shows the items the harness saw announced, as it saw them: the
    # message ended when the tool call began (sent); the tool call's end was held back.
    output = events[-1].response.output  # type: ignore[union-attr]
    announced = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [item.id for item in output] == announced
    assert [(item.type, item.status) for item in output] == [("message", "completed"),
                                                             ("function_call", "incomplete")]


def test_a_lost_record_leaves_out_the_items_announced_only_in_the_held_part() -> None:
    events = sdk_events(relay_with_a_lost_record([chunk({"role": "assistant", "content": ""}),
                                                  chunk({"content": "Hi"}, "stop"), usage_chunk()]))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.output == []  # type: ignore[union-attr]


def test_a_stream_held_from_its_first_event_opens_its_failure_again() -> None:
    events = sdk_events(relay_with_a_lost_record([{"error": {"message": "engine overloaded"}}]))
    assert [(e.type, e.sequence_number) for e in events] == [
        ("response.created", 0), ("response.in_progress", 1), ("response.failed", 2)]
    assert events[-1].response.error.message == "the call could not be recorded; send it again"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- wire helpers


def test_sse_encode_frames_one_event() -> None:
    encoded = sse_encode("response.output_text.delta", {"type": "response.output_text.delta", "delta": "é\n"})
    assert (
        encoded
        == 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"é\\n"}\n\n'.encode()
    )


def test_error_body_has_openai_shape() -> None:
    assert error_body(400, "unsupported field tools[0].type: no", "invalid_request_error") == {
        "error": {
            "message": "unsupported field tools[0].type: no",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert error_body(502, "engine down", "")["error"]["type"] == "api_error"
    assert error_body(429, "slow down", "")["error"]["type"] == "rate_limit_error"
    # An engine's status through the proxy's generic failure path keeps its own type.
    assert error_body(429, "slow down", "invalid_request_error")["error"]["type"] == "rate_limit_error"
    assert error_body(404, "no such model", "invalid_request_error")["error"]["type"] == "not_found_error"
    assert error_body(503, "overloaded", "overloaded_error")["error"]["type"] == "overloaded_error"  # a specific one stays


SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}
NAMESPACE_TOOL = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agent tools.",
                  "tools": [SPAWN, {"type": "function", "name": "close_agent",
                                    "parameters": {"type": "object", "properties": {}}}]}


def test_codex_default_tools_namespace_flattened_and_web_search_left_out() -> None:
    """Codex's default request: a ``namespace`` of sub-agent tools and hosted web search."""
    chat = to_chat_request(codex_request(
        tools=[SHELL_TOOL, NAMESPACE_TOOL, {"type": "web_search", "external_web_access": True}],
        tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}))
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__close_agent"]
    assert chat["tools"][1]["function"]["parameters"] == SPAWN["parameters"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "multi_agent_v1__spawn_agent"}}


def test_namespaced_history_call_renders_the_flat_name() -> None:
    chat = to_chat_request(codex_request(tools=[NAMESPACE_TOOL], input=[
        {"type": "message", "role": "user", "content": "delegate"},
        {"type": "function_call", "call_id": "c1", "namespace": "multi_agent_v1", "name": "spawn_agent",
         "arguments": '{"message":"go"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
    ]))
    assert chat["messages"][-2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    with pytest.raises(InvalidRequestError, match=r"input\[0\]\.namespace"):
        to_chat_request(codex_request(input=[{"type": "function_call", "call_id": "c", "namespace": 3,
                                              "name": "x", "arguments": "{}"}]))


def test_namespaced_tool_call_answer_restores_name_and_namespace() -> None:
    request = codex_request(tools=[SHELL_TOOL, NAMESPACE_TOOL])
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"message": "hi"}'}}]}
    item = from_chat_response(chat_completion(message, "tool_calls"), request=request)["output"][0]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert item["arguments"] == '{"message": "hi"}'

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                               "function": {"name": "multi_agent_v1__spawn_agent"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"message": "hi"}'}}]}),
        chunk({}, "tool_calls"),
        usage_chunk(),
    ]
    events = translate(chunks, request)
    added = [d["item"] for t, d in events if t == "response.output_item.added"]
    done = [d["item"] for t, d in events if t == "response.output_item.done"]
    assert [(i["name"], i.get("namespace")) for i in added + done] == [("spawn_agent", "multi_agent_v1")] * 2
    final = next(d for t, d in events if t == "response.completed")["response"]["output"][0]
    assert (final["name"], final["namespace"]) == ("spawn_agent", "multi_agent_v1")


def test_an_output_with_no_call_before_it_is_refused_by_name() -> None:
    body = {"model": "m", "input": [
        {"role": "user", "content": "list"},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
        {"type": "function_call_output", "call_id": "zzz", "output": "b"},
    ]}
    with pytest.raises(InvalidRequestError, match=r"input\[3\]\.call_id.*'zzz'"):
        to_chat_request(body)
    body["input"] = body["input"][:3]
    assert [m["role"] for m in to_chat_request(body)["messages"]] == ["user", "assistant", "tool"]


# --------------------------------------------------------------------------- reasoning

THOUGHT = ["The user wants ", "a listing."]


def thinking_chunks(field: str = "reasoning") -> list[dict[str, Any]]:
    """A reasoning model's stream: its thinking (vLLM's reasoning parser), then text and a tool call."""
    return [chunk({"role": "assistant", "content": ""}), *(chunk({field: piece}) for piece in THOUGHT),
            *tool_call_chunks()[1:]]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])  # vLLM's name now, and before
def test_a_thinking_models_stream_gives_a_reasoning_item_that_goes_back_to_the_engine_against_sdk_parser(
        field: str) -> None:
    seen: list[dict[str, Any]] = []
    client = sdk_client(thinking_chunks(field), seen)
    with client.responses.stream(model="qwen-tiny", input="List files", tools=[SHELL_TOOL]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:7] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta", "response.reasoning_text.done"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.id == "rs_9b1c" and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content or []] == [("reasoning_text", "".join(THOUGHT))]
    assert final.output_text == "Let me check."

    # Codex keeps the items and sends them back after the tool's output: the engine sees its thinking
    # on the assistant turn it belongs to.
    history = [item.model_dump(exclude_none=True) for item in final.output]
    client.responses.create(model="qwen-tiny", tools=[SHELL_TOOL], stream=True, input=[  # type: ignore[list-item]
        {"role": "user", "content": "List files"}, *history,
        {"type": "function_call_output", "call_id": "chatcmpl-tool-5", "output": "README.md"}]).close()
    client.close()
    turn = seen[1]["messages"][1]
    assert turn["role"] == "assistant" and turn["reasoning"] == "".join(THOUGHT)
    assert turn["content"] == "Let me check." and turn["tool_calls"][0]["id"] == "chatcmpl-tool-5"


def test_streamed_and_unstreamed_reasoning_agree_and_validate() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events = translate(thinking_chunks(), codex_request())
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert adapter.validate_python(data).type == name
    message = {"role": "assistant", "reasoning": "".join(THOUGHT), "content": "Let me check.", "tool_calls": [
        {"id": "chatcmpl-tool-5", "type": "function", "function": {"name": "shell", "arguments": SHELL_ARGS}}]}
    chat = chat_completion(message, "tool_calls") | {"id": "chatcmpl-9b1c", "created": 1_700_000_001}
    unstreamed = from_chat_response(chat, request=codex_request())
    assert events[-1][1]["response"]["output"] == unstreamed["output"]
    assert Response.model_validate(unstreamed).output[0].type == "reasoning"


def test_reasoning_items_reach_the_engine_only_with_their_text_and_only_on_the_models_turn() -> None:
    def turn(*items: dict[str, Any]) -> list[dict[str, Any]]:
        messages = to_chat_request(codex_request(input=[{"role": "user", "content": "go"}, *items]))["messages"]
        return messages[2:]  # after the instructions and the user's message

    def thinking(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": "rs_x", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    call = {"type": "function_call", "name": "shell", "arguments": SHELL_ARGS, "call_id": "c1"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    # Before a call, and again before the next call after its output: each on its own turn.
    assert [m.get("reasoning") for m in turn(thinking("one"), call, output, thinking("two"),
                                             call | {"call_id": "c2"})] == ["one", None, "two"]
    # OpenAI's own reasoning (a summary and encrypted content, no text) is another model's: dropped.
    foreign = {"type": "reasoning", "id": "rs_o", "summary": [{"type": "summary_text", "text": "Listing."}],
               "encrypted_content": "gAAAA-opaque"}
    assert "reasoning" not in turn(foreign, call)[0]
    # Reasoning with no answer of the model after it (the harness cut the turn) is not rendered anywhere.
    assert all("reasoning" not in m for m in turn(thinking("lost"), {"role": "user", "content": "again"}))
    # Two reasoning items before one answer are joined as vLLM joins a reasoning item's parts.
    assert turn(thinking("a"), thinking("b"), {"role": "assistant", "content": "Hi."})[0]["reasoning"] == "a\nb"
    with pytest.raises(InvalidRequestError, match=r"input\[1\]\.content\[0\]"):
        turn({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": 3}]})


def test_a_lost_record_after_a_think_shows_the_reasoning_the_harness_saw_end() -> None:
    events = sdk_events(relay_with_a_lost_record(thinking_chunks()))
    assert events[-1].type == "response.failed"
    output = events[-1].response.output  # type: ignore[union-attr]
    assert [(item.type, item.status) for item in output] == [("reasoning", "completed"), ("message", "completed"),
                                                             ("function_call", "incomplete")]
    assert output[0].content[0].text == "".join(THOUGHT)


PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAA"
           "BJRU5ErkJggg==")


def test_input_images_become_chat_image_parts_in_their_place() -> None:
    chat = to_chat_request(codex_request(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                     {"type": "input_image", "image_url": PNG_URL, "detail": "low"}]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path":"a.png"}'},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": PNG_URL, "detail": "original"}]},
    ]), images="inline")
    user, _, tool = chat["messages"][-3:]
    assert user["content"] == [{"type": "text", "text": "what is this?"},
                               {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}}]
    # "original" has no chat counterpart: the engine's default stands.
    assert tool == {"role": "tool", "tool_call_id": "c1",
                    "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]}


def test_input_images_are_a_line_of_text_in_their_place_under_placeholder() -> None:
    chat = to_chat_request(codex_request(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                     {"type": "input_image", "image_url": "https://example.com/a.png"}]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path":"a.png"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": PNG_URL}]},
    ]), images="placeholder")
    user, _, tool = chat["messages"][-3:]
    assert user["content"] == [{"type": "text", "text": "what is this?"}, {"type": "text", "text": IMAGE_PLACEHOLDER}]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": IMAGE_PLACEHOLDER}


def test_an_input_image_is_refused_by_default() -> None:
    with pytest.raises(UnsupportedFeatureError, match="OPENFORGE_PROXY_IMAGES=inline") as caught:
        to_chat_request(codex_request(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": PNG_URL}]}]))
    assert caught.value.field == "input[0].content[0].type"


@pytest.mark.parametrize(("item", "error", "message"), [
    ({"role": "assistant", "content": [{"type": "input_image", "image_url": PNG_URL}]}, InvalidRequestError,
     "input[0].content[0].type input_image is only allowed in user messages and tool outputs"),
    ({"role": "user", "content": [{"type": "input_image"}]}, InvalidRequestError,
     "input[0].content[0].image_url is required"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL, "detail": "max"}]},
     InvalidRequestError, "input[0].content[0].detail must be one of auto, high, low, original"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}, UnsupportedFeatureError,
     "input[0].content[0].file_id"),
    # The engine would fetch it, from inside the cluster, at an address the rollout chose.
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://10.0.0.1/admin"}]},
     UnsupportedFeatureError, "input[0].content[0].image_url: image URLs are refused"),
])
def test_a_malformed_or_misplaced_input_image_names_its_field(item: dict[str, Any], error: type[Exception],
                                                              message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        to_chat_request(codex_request(input=[item]), images="inline")


def test_keepalives_open_the_response_before_the_first_token_and_change_nothing_against_sdk_parser() -> None:
    """Codex aborts a stream after five minutes without an event. Before the engine's first
    token (a queue, a long prefill) the keep-alive opens the response, as the API does at once;
    after, it is a repeated ``response.in_progress``. The SDK's final response is the same."""
    seen: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        translator = StreamTranslator(request=json.loads(request.content), response_id="resp_k")
        events = translator.keepalive()
        for c in tool_call_chunks():
            events += translator.feed(c) + translator.keepalive()
        events += translator.finish()
        assert translator.keepalive() == []  # none after the end
        seen.append([name for name, _ in events])
        payload = b"".join(sse_encode(name, data) for name, data in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=payload)

    client = openai.OpenAI(base_url="http://proxy.test/v1", api_key="sk-test",
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    with client.responses.stream(model="qwen-tiny", input="List files", tools=[SHELL_TOOL]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    client.close()
    assert seen[0][:3] == ["response.created", "response.in_progress", "response.in_progress"]
    assert seen[0].count("response.created") == 1 and seen[0][-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.id == "resp_k" and final.output_text == "Let me check."
    assert final.output[1].type == "function_call" and final.output[1].arguments == SHELL_ARGS
