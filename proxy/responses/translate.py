"""Pure translation between OpenAI Responses requests/answers and chat completions.

The proxy serves harnesses that speak only the Responses API, while the engine reports
token ids and logprobs only on its chat-completions endpoint. Every Responses request is
therefore rewritten as a chat-completions request, and the engine's answer (a JSON body
or a stream of chunks) is rewritten as a Responses ``response`` object or as the
Responses server-sent events. Nothing here does I/O: the HTTP layer feeds parsed JSON in
and writes what comes out.

Mapping decisions, with the reasons:

* ``developer`` messages become ``system`` messages. The Responses API added the
  developer role for OpenAI's own models; open-weight chat templates only know
  ``system``, and an unknown role either fails to render or is silently dropped by them.
  ``instructions`` becomes a leading system message for the same reason. Messages are
  never merged, so the rendered prompt follows the harness's item order one to one.
* The engine's reasoning (vLLM's reasoning parser) is returned as a ``reasoning`` item
  before the answer, its text as ``reasoning_text`` content, the shape vLLM's own
  Responses server gives it (streamed as ``response.reasoning_text.delta`` events). A
  ``reasoning`` input item with such content goes back to the engine as the
  ``reasoning`` of the assistant message that follows it, so the chat template renders
  the model's thinking where it wrote it (see :mod:`proxy.reasoning`). Reasoning items
  with no text content (OpenAI's, holding only ``encrypted_content`` and summaries) are
  dropped: they are another model's. No reasoning item breaks the merge of an assistant
  message with the function calls that follow it.
* Custom (freeform) tools, which Codex uses for ``apply_patch``, become function tools
  with one string argument named ``input`` (:data:`CUSTOM_TOOL_ARGUMENT`). The grammar
  of a ``grammar`` format is put in that argument's description: the engine cannot
  constrain one tool's argument by a Lark grammar, so the model is told instead, and the
  harness still validates what it receives. Calls of those functions are turned back
  into ``custom_tool_call`` items carrying the decoded string, and ``custom_tool_call``
  history items are re-encoded as ``{"input": ...}`` arguments.
* ``text.format``: ``text`` needs nothing; ``json_schema`` and ``json_object`` become the
  chat ``response_format``, which the engine enforces by structured decoding.
  ``text.verbosity`` is a soft hint with no engine counterpart and is ignored.
* Stateful features are refused, since the proxy keeps no state between calls:
  ``previous_response_id``, ``conversation``, ``background`` and stored ``prompt``
  templates. Hosted tools (file search, computer use, code interpreter, image generation,
  MCP, ``local_shell``) and their call items are refused too: the engine cannot run them.
  Hosted web search is the exception: it is left out of the engine's tool list rather than
  refused, because harnesses offer it by default as an optional extra (Codex does) and a
  model without it still does the task; a ``tool_choice`` that forces it is refused.
* ``namespace`` tools (Codex groups its sub-agent tools as ``multi_agent_v1``) become
  plain function tools named ``<namespace>__<name>`` (:data:`NAMESPACE_SEPARATOR`), the
  form chat tool names allow; calls of them come back as ``function_call`` items with
  ``name`` and ``namespace`` restored, and namespaced history items are flattened the
  same way, so the prompt renders the names the model saw. Codex sends ``local_shell`` only for OpenAI's codex-mini
  models and a ``shell`` function tool otherwise.
* Ignored because they do not change what the engine samples: ``store``, ``metadata``,
  ``user``, ``safety_identifier``, ``include``, ``prompt_cache_key``,
  ``prompt_cache_retention``, ``service_tier``, ``stream_options``, ``max_tool_calls``
  (it counts hosted tool calls, which are refused) and ``reasoning`` (effort and summary
  settings: each model family encodes effort differently, if at all, and the engine
  validates a narrower set of levels than harnesses send, so the chat template's default
  is kept). ``truncation: "auto"`` is accepted but not performed: a prompt that does not
  fit fails at the engine instead of being shortened. Unknown top-level fields are also
  ignored so that a newer harness keeps working.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from proxy.errors import InvalidRequestError, UnsupportedFeatureError
from proxy.media import IMAGE_PLACEHOLDER, ImagePolicy, inline_image, refuse_images
from proxy.reasoning import engine_reasoning
from proxy.stream_state import ChunkTranslator, ToolCall

__all__ = [
    "CUSTOM_TOOL_ARGUMENT",
    "NAMESPACE_SEPARATOR",
    "StreamTranslator",
    "UpstreamFormatError",
    "error_body",
    "from_chat_response",
    "sse_encode",
    "to_chat_request",
]

Event = tuple[str, dict[str, Any]]
"""One Responses server-sent event: its type and its JSON data (which repeats the type)."""

CUSTOM_TOOL_ARGUMENT: Final = "input"
"""The single string argument of the function a custom (freeform) tool is mapped to."""

NAMESPACE_SEPARATOR: Final = "__"
"""Joins a namespace and a tool name into one chat function name (chat names allow only
letters, digits, ``_`` and ``-``)."""

_DROPPED_HOSTED_TOOLS: Final = frozenset(
    {"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11"}
)

_ROLES: Final = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
_MEDIA_PARTS: Final = frozenset({"input_file", "input_audio"})
_CHAT_IMAGE_DETAILS: Final = frozenset({"low", "high", "auto"})
_IMAGE_DETAILS: Final = _CHAT_IMAGE_DETAILS | {"original"}

_HOSTED_TOOLS: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

_UNSUPPORTED_ITEMS: Final = {
    "item_reference": "item references point at responses stored by the server; this proxy is stateless, "
    "send the referenced items themselves",
    "web_search_call": "web search is a hosted tool the engine cannot run",
    "file_search_call": "file search is a hosted tool the engine cannot run",
    "computer_call": "computer use is a hosted tool the engine cannot run",
    "computer_call_output": "computer use is a hosted tool the engine cannot run",
    "local_shell_call": "the local_shell tool is not supported; use a function tool for the shell",
    "local_shell_call_output": "the local_shell tool is not supported; use a function tool for the shell",
    "code_interpreter_call": "code interpreter is a hosted tool the engine cannot run",
    "image_generation_call": "image generation is a hosted tool the engine cannot run",
    "compaction": "compacted history is encrypted by another server and cannot be read by the engine",
}

_UNUSED_ID_PREFIXES: Final = ("chatcmpl-", "chatcmpl_", "resp_", "resp-")


class UpstreamFormatError(ValueError):
    """The engine's answer does not have the chat-completions shape this module expects.

    The HTTP layer reports it as a bad gateway (or, mid-stream, through
    :meth:`StreamTranslator.failed_event`) rather than as the client's fault.
    """


# --------------------------------------------------------------------------- requests


def to_chat_request(body: dict[str, Any], *, images: ImagePolicy = "refuse") -> dict[str, Any]:
    """Translate a Responses ``POST /v1/responses`` body into a chat-completions body.

    Args:
        body: The parsed JSON body the harness sent.
        images: Whether images go to the engine (:data:`proxy.media.ImagePolicy`).

    Returns:
        The chat-completions body for the engine. Fields the proxy adds for itself (token
        ids, logprobs) are not set here.

    Raises:
        InvalidRequestError: A field has the wrong type or a required one is missing.
        UnsupportedFeatureError: The request uses something the engine cannot do; its
            ``field`` is the JSON path of the offending part, such as ``tools[2].type``.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    _refuse_stateful_fields(body)

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model is required and must be a non-empty string")

    tools, tool_names = _translate_tools(body.get("tools"))

    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(_translate_input(body.get("input"), images))
    if not messages:
        raise InvalidRequestError("input is required: give a string or a non-empty list of input items")

    chat: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        chat["tools"] = tools
    dropped = [t["type"] for t in body.get("tools") or ()
               if isinstance(t, dict) and t.get("type") in _DROPPED_HOSTED_TOOLS]
    tool_choice = _translate_tool_choice(body.get("tool_choice"), tool_names, dropped)
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequestError("parallel_tool_calls must be a boolean")
        if tools:
            # The engine ties tool settings to a tool list; without tools the flag means nothing.
            chat["parallel_tool_calls"] = parallel

    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if not _is_int(max_output_tokens) or max_output_tokens < 1:
            raise InvalidRequestError("max_output_tokens must be a positive integer")
        chat["max_tokens"] = max_output_tokens
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not _is_number(value):
                raise InvalidRequestError(f"{name} must be a number")
            chat[name] = value

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError("stream must be a boolean")
    if stream:
        chat["stream"] = True
        # The terminal response.completed event carries usage, which chat streams only
        # report when asked to.
        chat["stream_options"] = {"include_usage": True}
    else:
        chat["stream"] = False

    response_format = _translate_text(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format

    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise InvalidRequestError('truncation must be "auto" or "disabled"')
    return chat


def _refuse_stateful_fields(body: dict[str, Any]) -> None:
    """Refuse fields whose meaning depends on state or features the proxy does not have."""
    if body.get("previous_response_id") is not None:
        raise UnsupportedFeatureError(
            "previous_response_id",
            "this proxy is stateless and keeps no earlier responses; send the whole conversation in input "
            "(with store: false, as Codex does)",
        )
    if body.get("conversation") is not None:
        raise UnsupportedFeatureError(
            "conversation", "this proxy is stateless and keeps no conversations; send the items in input"
        )
    if body.get("background"):
        raise UnsupportedFeatureError(
            "background", "background responses need server-side storage, which this proxy does not have"
        )
    if body.get("prompt") is not None:
        raise UnsupportedFeatureError(
            "prompt", "stored prompt templates live on OpenAI's servers; send instructions and input instead"
        )
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and top_logprobs != 0:
        raise UnsupportedFeatureError("top_logprobs", "logprobs are not returned through the Responses API")
    include = body.get("include")
    # Other values (Codex asks for reasoning.encrypted_content) name parts of the output this
    # proxy never makes, so they change nothing; logprobs it would silently answer as none.
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        raise UnsupportedFeatureError("include", "logprobs are not returned through the Responses API")


def _translate_input(value: Any, images: ImagePolicy) -> list[dict[str, Any]]:
    """Turn ``input`` (a string or a list of items) into chat messages."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequestError("input must be a string or a list of input items")

    messages: list[dict[str, Any]] = []
    called: set[str] = set()  # call ids so far
    thought: str | None = None  # reasoning items' text, for the assistant message that follows
    for i, item in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{path} must be an object")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"  # Easy input messages may leave out the type.
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{path}.type is required and must be a string")

        if kind == "message":
            messages.append(_translate_message(item, path, images))
            _give_reasoning(messages[-1], thought)
            thought = None
        elif kind in ("function_call", "custom_tool_call"):
            call = (_translate_function_call if kind == "function_call" else _translate_custom_tool_call)(item, path)
            called.add(call["id"])
            _append_tool_call(messages, call)
            _give_reasoning(messages[-1], thought)
            thought = None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            thought = None  # reasoning with no answer of the model after it is not rendered
            output = _translate_tool_output(item, path, images)
            if output["tool_call_id"] not in called:
                # OpenAI refuses an output with no call before it; a chat template would render
                # it as the result of a call the model never made.
                raise InvalidRequestError(f"{path}.call_id: no function call with call_id "
                                          f"{output['tool_call_id']!r} comes before this output")
            messages.append(output)
        elif kind == "reasoning":
            text = _reasoning_text(item, path)
            if text:
                thought = text if thought is None else f"{thought}\n{text}"
        else:
            detail = _UNSUPPORTED_ITEMS.get(kind, f"input items of type {kind!r} cannot be translated")
            raise UnsupportedFeatureError(f"{path}.type", detail)
    return messages


def _reasoning_text(item: dict[str, Any], path: str) -> str:
    """The text a ``reasoning`` item's content holds, parts joined by newlines as vLLM joins them.

    Summaries and ``encrypted_content`` are not this model's tokens and are left out.
    """
    content = item.get("content")
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path}.content must be a list of reasoning text parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{path}.content[{j}] must be an object with a string text")
        if part.get("type") in ("reasoning_text", "text"):
            texts.append(part["text"])
    return "\n".join(texts)


def _give_reasoning(message: dict[str, Any], thought: str | None) -> None:
    """Put the reasoning items' text on ``message`` if it is the model's; others drop it."""
    if thought and message["role"] == "assistant":
        earlier = message.get("reasoning")
        message["reasoning"] = f"{earlier}\n{thought}" if earlier else thought


def _translate_message(item: dict[str, Any], path: str, images: ImagePolicy) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidRequestError(f"{path}.role must be one of user, assistant, system, developer")
    return {"role": _ROLES[role],
            "content": _translate_content(item.get("content"), f"{path}.content",
                                          images=images if role == "user" else None)}


def _translate_content(content: Any, path: str, *, images: ImagePolicy | None) -> str | list[dict[str, Any]]:
    """Translate message content: a string, or a list of text (and, where ``images`` allows, image) parts.

    One text part becomes a plain string and several stay a list of chat text parts, so
    the engine joins them exactly as it would for a chat-completions client. Images let through
    go on as chat ``image_url`` parts in their place; ``images`` None: none may be here at all.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path} must be a string or a list of content parts")
    parts = [_part(part, f"{path}[{j}]", images) for j, part in enumerate(content)]
    if len(parts) == 1 and isinstance(parts[0], str):
        return parts[0]
    if not parts:
        return ""
    return [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]


def _image_part(part: dict[str, Any], path: str, images: ImagePolicy) -> dict[str, Any] | str:
    """An ``input_image`` part as a chat ``image_url`` part, if ``images`` allows (see :mod:`proxy.media`).

    Under ``placeholder`` it is the placeholder's text, whatever its source.
    """
    if images == "placeholder":
        return IMAGE_PLACEHOLDER
    if images != "inline":
        raise refuse_images(f"{path}.type")
    if part.get("file_id") is not None:
        raise UnsupportedFeatureError(f"{path}.file_id", "files uploaded to OpenAI's Files API are not reachable "
                                      "from the engine; send the image as a data URL")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{path}.image_url is required and must be a data URL")
    image = inline_image(url, f"{path}.type", f"{path}.image_url", images)
    detail = part.get("detail")
    if detail is not None and detail not in _IMAGE_DETAILS:
        raise InvalidRequestError(f"{path}.detail must be one of {', '.join(sorted(_IMAGE_DETAILS))}, got {detail!r}")
    if detail in _CHAT_IMAGE_DETAILS:  # "original" has no chat counterpart: the engine's default then
        image["image_url"]["detail"] = detail
    return image


def _part(part: Any, path: str, images: ImagePolicy | None) -> str | dict[str, Any]:
    if not isinstance(part, dict):
        raise InvalidRequestError(f"{path} must be an object")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{path}.type is required and must be a string")
    if kind == "input_image":
        if images is None:
            raise InvalidRequestError(f"{path}.type input_image is only allowed in user messages and tool outputs")
        return _image_part(part, path, images)
    return _part_text(part, path)


def _part_text(part: dict[str, Any], path: str) -> str:
    kind = part["type"]
    if kind in _TEXT_PARTS:
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{path}.text must be a string")
        return text
    if kind == "refusal":
        # An earlier assistant refusal is still text the model said.
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise InvalidRequestError(f"{path}.refusal must be a string")
        return refusal
    if kind in _MEDIA_PARTS:
        raise UnsupportedFeatureError(
            f"{path}.type", f"{kind} parts are not supported: the engine takes text and images only"
        )
    raise UnsupportedFeatureError(f"{path}.type", f"content parts of type {kind!r} cannot be translated")


def _required_str(item: dict[str, Any], key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{path}.{key} is required and must be a string")
    return value


def _flat_name(item: dict[str, Any], path: str) -> str:
    """The chat function name of a (possibly namespaced) tool or call item."""
    name = _required_str(item, "name", path)
    namespace = item.get("namespace")
    if namespace is None:
        return name
    if not isinstance(namespace, str) or not namespace:
        raise InvalidRequestError(f"{path}.namespace must be a non-empty string")
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _translate_function_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    # Arguments travel as the exact string the model produced, so the next prompt
    # renders the same tokens the engine sampled.
    return {
        "id": _required_str(item, "call_id", path),
        "type": "function",
        "function": {
            "name": _flat_name(item, path),
            "arguments": _required_str(item, "arguments", path),
        },
    }


def _translate_custom_tool_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    arguments = json.dumps({CUSTOM_TOOL_ARGUMENT: _required_str(item, "input", path)}, ensure_ascii=False)
    return {
        "id": _required_str(item, "call_id", path),
        "type": "function",
        "function": {"name": _flat_name(item, path), "arguments": arguments},
    }


def _append_tool_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Attach a tool call to the preceding assistant message, or start one.

    The Responses API lists an assistant turn as separate items (text, then each call);
    chat completions holds them in one assistant message, which is how chat templates
    render a turn.
    """
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _translate_tool_output(item: dict[str, Any], path: str, images: ImagePolicy) -> dict[str, Any]:
    call_id = _required_str(item, "call_id", path)
    output = item.get("output")
    if isinstance(output, str):
        content: str | list[dict[str, Any]] = output
    elif isinstance(output, list):
        content = _translate_content(output, f"{path}.output", images=images)
    else:
        raise InvalidRequestError(f"{path}.output must be a string or a list of content parts")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _translate_tools(value: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Translate ``tools``; also return each tool name with its Responses type."""
    if value is None:
        return [], {}
    if not isinstance(value, list):
        raise InvalidRequestError("tools must be a list")
    tools: list[dict[str, Any]] = []
    names: dict[str, str] = {}

    def add(tool: dict[str, Any], path: str, namespace: str | None) -> None:
        kind = tool.get("type")
        if kind == "function":
            function = _translate_function_tool(tool, path)
        elif kind == "custom":
            function = _translate_custom_tool(tool, path)
        elif not isinstance(kind, str):
            raise InvalidRequestError(f"{path}.type is required and must be a string")
        elif kind in _HOSTED_TOOLS:
            raise UnsupportedFeatureError(
                f"{path}.type", f"{kind} is a hosted tool the engine cannot run; offer it as a function tool"
            )
        else:
            raise UnsupportedFeatureError(f"{path}.type", f"tools of type {kind!r} cannot be translated")
        if namespace is not None:
            function["name"] = f"{namespace}{NAMESPACE_SEPARATOR}{function['name']}"
        name = function["name"]
        if name in names:
            raise InvalidRequestError(f"{path}.name: tool name {name!r} is used twice")
        names[name] = kind
        tools.append({"type": "function", "function": function})

    for k, tool in enumerate(value):
        path = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{path} must be an object")
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{path}.type is required and must be a string")
        if kind in _DROPPED_HOSTED_TOOLS:
            continue
        if kind == "namespace":
            namespace = _required_str(tool, "name", path)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise InvalidRequestError(f"{path}.tools must be a list")
            for j, member in enumerate(members):
                if not isinstance(member, dict):
                    raise InvalidRequestError(f"{path}.tools[{j}] must be an object")
                add(member, f"{path}.tools[{j}]", namespace)
        else:
            add(tool, path, None)
    return tools, names


def _translate_function_tool(tool: dict[str, Any], path: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": _required_str(tool, "name", path)}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise InvalidRequestError(f"{path}.description must be a string")
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{path}.parameters must be a JSON schema object")
        function["parameters"] = parameters
    strict = tool.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise InvalidRequestError(f"{path}.strict must be a boolean")
        function["strict"] = strict
    return function


def _translate_custom_tool(tool: dict[str, Any], path: str) -> dict[str, Any]:
    """Map a custom (freeform text) tool to a function with one string argument."""
    name = _required_str(tool, "name", path)
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{path}.description must be a string")
    argument_doc = "The raw text input for the tool."
    fmt = tool.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise InvalidRequestError(f"{path}.format must be an object")
        fmt_type = fmt.get("type")
        if fmt_type == "grammar":
            syntax = fmt.get("syntax")
            definition = fmt.get("definition")
            if not isinstance(syntax, str) or not isinstance(definition, str):
                raise InvalidRequestError(f"{path}.format needs string syntax and definition")
            argument_doc = f"The raw text input for the tool. It must follow this {syntax} grammar:\n{definition}"
        elif fmt_type != "text":
            raise UnsupportedFeatureError(f"{path}.format.type", f"custom tool format {fmt_type!r} is unknown")
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = {
        "type": "object",
        "properties": {CUSTOM_TOOL_ARGUMENT: {"type": "string", "description": argument_doc}},
        "required": [CUSTOM_TOOL_ARGUMENT],
        "additionalProperties": False,
    }
    return function


def _translate_tool_choice(value: Any, tool_names: dict[str, str],
                           dropped: Sequence[str] = ()) -> str | dict[str, Any] | None:
    """Translate ``tool_choice``.

    Without tools, ``auto`` and ``none`` are dropped: they mean the same as no tools, and
    the engine rejects a tool choice that comes without a tool list. ``dropped`` names the
    hosted tools the request offered that were left out (web search): "required" with only
    those is refused as the untranslatable part it is, not as a request without tools.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise InvalidRequestError('tool_choice must be "auto", "none", "required" or an object')
        if not tool_names:
            if value == "required" and dropped:
                raise UnsupportedFeatureError(
                    "tool_choice", f'"required" with only hosted tools ({", ".join(dropped)}), which the engine '
                    "cannot run and which are left out; offer a function tool")
            if value == "required":
                raise InvalidRequestError('tool_choice "required" needs at least one tool')
            return None
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError('tool_choice must be "auto", "none", "required" or an object')
    kind = value.get("type")
    if kind in ("function", "custom"):
        name = value.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.name is required and must be a string")
        namespace = value.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        if tool_names.get(name) != kind:
            raise InvalidRequestError(f"tool_choice names {kind} tool {name!r}, which is not in tools")
        # Custom tools are functions at the engine, so both become a named function choice.
        return {"type": "function", "function": {"name": name}}
    if not isinstance(kind, str):
        raise InvalidRequestError("tool_choice.type is required and must be a string")
    raise UnsupportedFeatureError("tool_choice.type", f"tool_choice of type {kind!r} cannot be translated")


def _translate_text(value: Any) -> dict[str, Any] | None:
    """Translate ``text`` into a chat ``response_format`` (None for plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("text must be an object")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        name = fmt.get("name")
        schema = fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("text.format.name is required for json_schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("text.format.schema must be a JSON schema object")
        json_schema: dict[str, Any] = {"name": name, "schema": schema}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                json_schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": json_schema}
    if not isinstance(kind, str):
        raise InvalidRequestError("text.format.type is required and must be a string")
    raise UnsupportedFeatureError("text.format.type", f"text format {kind!r} cannot be translated")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --------------------------------------------------------------------------- answers


def from_chat_response(
    chat: dict[str, Any], *, request: dict[str, Any], response_id: str | None = None
) -> dict[str, Any]:
    """Translate a non-streamed chat completion into a Responses ``response`` object.

    Item ids derive from the chat completion's id, so a retried translation of the same
    completion (and the streamed translation, see :class:`StreamTranslator`) yields the
    same ids. The engine's reasoning, if any, comes first as a ``reasoning`` item.

    Args:
        chat: The engine's chat-completion body.
        request: The Responses request the harness sent; echoed where the Responses
            object repeats request settings, and used to recognise custom tools.
        response_id: The id to give the response; derived from the chat id when None.

    Returns:
        The ``response`` object, status ``completed`` or ``incomplete``.

    Raises:
        UpstreamFormatError: The completion has no choice or no message.
    """
    choices = chat.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamFormatError("the chat completion has no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise UpstreamFormatError("the chat completion's first choice has no message")

    ids = _Ids.derive(chat.get("id"), response_id)
    finish_reason = choice.get("finish_reason")
    incomplete_reason = _incomplete_reason(finish_reason)
    status: Literal["completed", "incomplete"] = "incomplete" if incomplete_reason else "completed"
    custom_tools = _tool_names(request)

    output: list[dict[str, Any]] = []
    thought = engine_reasoning(message)
    if thought:
        output.append(_reasoning_item(ids.reasoning(0), thought, status))
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(_message_item(ids.message(0), text, status))
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise UpstreamFormatError("the chat completion's tool_calls is not a list")
    for k, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise UpstreamFormatError(f"tool call {k} is not an object")
        function = call.get("function") or {}
        name = function.get("name") or ""
        if not isinstance(name, str) or not name:
            raise UpstreamFormatError(f"tool call {k} has no name")
        arguments = function.get("arguments") or ""
        call_id = call.get("id") or ids.call(k)
        item_id = ids.custom_tool_call(k) if name in custom_tools.custom else ids.function_call(k)
        output.append(_tool_call_item(item_id, call_id, name, arguments, status, custom_tools))
    # Each item ended when the next began: a cut leaves only the last one unfinished, as the
    # stream reports it. (A custom tool call has no status in the API.)
    for item in output[:-1]:
        if "status" in item:
            item["status"] = "completed"

    return _response_object(
        request,
        response_id=ids.response_id,
        created_at=_created_at(chat),
        model=_model(chat, request),
        status=status,
        output=output,
        usage=_usage(chat.get("usage")),
        incomplete_reason=incomplete_reason,
    )


@dataclass(frozen=True)
class _Ids:
    """Deterministic ids for one response, all derived from one base string."""

    response_id: str
    base: str

    @classmethod
    def derive(cls, chat_id: Any, response_id: str | None) -> _Ids:
        source = response_id if response_id else chat_id
        if isinstance(source, str) and source:
            base = source
            for prefix in _UNUSED_ID_PREFIXES:
                base = base.removeprefix(prefix)
            base = base or source
        else:
            base = uuid.uuid4().hex
        return cls(response_id=response_id or f"resp_{base}", base=base)

    def message(self, n: int) -> str:
        return f"msg_{self.base}" if n == 0 else f"msg_{self.base}_{n}"

    def function_call(self, index: int) -> str:
        return f"fc_{self.base}_{index}"

    def reasoning(self, n: int) -> str:
        return f"rs_{self.base}" if n == 0 else f"rs_{self.base}_{n}"

    def custom_tool_call(self, index: int) -> str:
        return f"ctc_{self.base}_{index}"

    def call(self, index: int) -> str:
        """A call id for a tool call the engine sent without one."""
        return f"call_{self.base}_{index}"


@dataclass(frozen=True)
class _ToolNames:
    """What the engine's flat function names stand for in the harness's request."""

    custom: frozenset[str]
    """Flat names of custom (freeform) tools, whose calls become ``custom_tool_call`` items."""
    namespaced: dict[str, tuple[str, str]]
    """Flat name -> (namespace, name) of tools offered inside a ``namespace`` tool."""


def _tool_names(request: dict[str, Any]) -> _ToolNames:
    custom: set[str] = set()
    namespaced: dict[str, tuple[str, str]] = {}

    def visit(tools: Any, namespace: str | None) -> None:
        if not isinstance(tools, list):
            return
        for tool in tools:
            if not isinstance(tool, dict):
                continue
            name = tool.get("name")
            if tool.get("type") == "namespace" and namespace is None and isinstance(name, str):
                visit(tool.get("tools"), name)
            elif isinstance(name, str):
                flat = name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"
                if namespace is not None:
                    namespaced[flat] = (namespace, name)
                if tool.get("type") == "custom":
                    custom.add(flat)

    visit(request.get("tools"), None)
    return _ToolNames(frozenset(custom), namespaced)


def _custom_input(arguments: str) -> str:
    """Recover a custom tool's freeform input from the arguments of its function call.

    The model is asked for ``{"input": "..."}``. When it strays (another single string
    key, a bare JSON string, text that is not JSON at all), the most plausible string is
    taken rather than failing the turn, since the harness validates the input anyway.
    """
    try:
        # Not strict: models often write a patch's line breaks into the JSON string as they are.
        parsed = json.loads(arguments, strict=False)
    except ValueError:
        return arguments
    if isinstance(parsed, str):
        return parsed
    if isinstance(parsed, dict):
        value = parsed.get(CUSTOM_TOOL_ARGUMENT)
        if isinstance(value, str):
            return value
        if len(parsed) == 1:
            (only,) = parsed.values()
            if isinstance(only, str):
                return only
    return arguments


def _incomplete_reason(finish_reason: Any) -> str | None:
    if finish_reason == "length":
        return "max_output_tokens"
    if finish_reason == "content_filter":
        return "content_filter"
    return None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [_reasoning_part(text)], "status": status}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _tool_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, custom_tools: _ToolNames
) -> dict[str, Any]:
    namespace, local = custom_tools.namespaced.get(name, (None, name))
    item: dict[str, Any]
    if name in custom_tools.custom:
        item = {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": local,
            "input": _custom_input(arguments),
        }
    else:
        item = {
            "id": item_id,
            "type": "function_call",
            "call_id": call_id,
            "name": local,
            "arguments": arguments,
            "status": status,
        }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _usage(usage: Any) -> dict[str, Any] | None:
    """Translate chat usage; None when the engine sent none."""
    if not isinstance(usage, dict):
        return None
    prompt = _int_or_zero(usage.get("prompt_tokens"))
    completion = _int_or_zero(usage.get("completion_tokens"))
    total = usage.get("total_tokens")
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = _int_or_zero(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = _int_or_zero(completion_details.get("reasoning_tokens")) if isinstance(completion_details, dict) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total if _is_int(total) else prompt + completion,
    }


def _int_or_zero(value: Any) -> int:
    return value if _is_int(value) else 0


def _created_at(chat: dict[str, Any]) -> int | float:
    created = chat.get("created")
    if isinstance(created, int | float) and not isinstance(created, bool):
        return created
    return int(time.time())


def _model(chat: dict[str, Any], request: dict[str, Any]) -> str:
    """The model name to answer under: the one the harness asked for, as the proxy does everywhere.

    The engine may serve the policy under another name; a harness compares answers with
    the model it configured, not with the engine's.
    """
    for model in (request.get("model"), chat.get("model")):
        if isinstance(model, str) and model:
            return model
    return ""


def _response_object(
    request: dict[str, Any],
    *,
    response_id: str,
    created_at: int | float,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a Responses ``response`` object, echoing the request's settings."""
    tools = request.get("tools")
    text = request.get("text")
    metadata = request.get("metadata")
    reasoning = request.get("reasoning")
    truncation = request.get("truncation")
    parallel = request.get("parallel_tool_calls")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if status == "incomplete" else None,
        "instructions": request.get("instructions") if isinstance(request.get("instructions"), str) else None,
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": metadata if isinstance(metadata, dict) else {},
        "model": model,
        "output": output,
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "previous_response_id": None,
        "reasoning": reasoning if isinstance(reasoning, dict) else None,
        "temperature": request.get("temperature"),
        "text": text if isinstance(text, dict) else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": tools if isinstance(tools, list) else [],
        "top_p": request.get("top_p"),
        "truncation": truncation if truncation in ("auto", "disabled") else "disabled",
        "usage": usage,
    }


# --------------------------------------------------------------------------- streaming


@dataclass
class _Item:
    """One output item of a streamed response, from its announcement to its end."""

    kind: Literal["message", "reasoning", "function_call", "custom_tool_call"]
    item_id: str = ""
    index: int = 0  # the engine's tool-call index
    output_index: int = -1
    text: str = ""  # the message or reasoning text, or the tool call's arguments so far
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    announced: bool = False
    added_at: int = -1  # the sequence number of its output_item.added
    closed_at: int = -1  # of its first closing event

    @property
    def closed(self) -> bool:
        return self.status != "in_progress"

    def added(self, custom_tools: _ToolNames) -> dict[str, Any]:
        """The item as ``response.output_item.added`` shows it: nothing generated yet."""
        if self.kind == "message":
            return _message_item(self.item_id, "", "in_progress") | {"content": []}
        if self.kind == "reasoning":
            return _reasoning_item(self.item_id, "", "in_progress") | {"content": []}
        return _tool_call_item(self.item_id, self.call_id, self.name, "", "in_progress", custom_tools)

    def snapshot(self, custom_tools: _ToolNames) -> dict[str, Any]:
        """The item with everything generated so far, as final events show it."""
        if self.kind == "message":
            return _message_item(self.item_id, self.text, self.status)
        if self.kind == "reasoning":
            return _reasoning_item(self.item_id, self.text, self.status)
        return _tool_call_item(self.item_id, self.call_id, self.name, self.text, self.status, custom_tools)


class StreamTranslator(ChunkTranslator):
    """Turn a chat-completions chunk stream into Responses server-sent events.

    Feed each parsed chunk to :meth:`feed` and send the events it returns, in order; when
    the engine's stream ends, send what :meth:`finish` returns. Exactly one terminal event
    (``response.completed``, ``response.incomplete`` or ``response.failed``) is produced.

    Text is forwarded delta by delta. Function-call arguments are forwarded as they
    arrive too. A custom tool's input arrives wrapped in the JSON of its function
    arguments and can only be unwrapped once complete, so it is sent as one delta when
    the call ends. An item ends as soon as the next one starts or the engine sends a
    finish reason, so a harness can act on a finished tool call before the stream ends.
    The terminal event needs the token counts, which the engine sends in a last chunk
    without choices; it is produced on that chunk, or by :meth:`finish` when none comes.
    The engine's reasoning is forwarded delta by delta as a ``reasoning`` item's
    ``response.reasoning_text.delta`` events.
    """

    def __init__(self, *, request: dict[str, Any], response_id: str | None = None) -> None:
        super().__init__()
        self._request = request
        self._requested_id = response_id
        self._custom_tools = _tool_names(request)
        self._ids: _Ids | None = None
        self._created_at: int | float = 0
        self._model = ""
        self._sequence = 0
        self._items: list[_Item] = []  # announced items, by output index
        self._messages = 0
        self._reasonings = 0
        self._text: _Item | None = None
        self._thought: _Item | None = None
        self._tool: _Item | None = None
        self._tools: dict[int, _Item] = {}
        self._terminated = False
        self.failure: str | None = None
        """Why the stream ended in ``response.failed`` (None while it has not)."""

    @property
    def response_id(self) -> str | None:
        """The response's id, known once the first chunk (or finish) has been handled."""
        return self._ids.response_id if self._ids else self._requested_id

    @property
    def terminated(self) -> bool:
        """Whether the terminal event has been produced."""
        return self._terminated

    @property
    def next_sequence(self) -> int:
        """The ``sequence_number`` the next event will take."""
        return self._sequence

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """Translate one parsed chat-completions chunk.

        A chunk that breaks the chat-completions stream shape (arguments for a tool call that
        already ended, a delta that is not an object) ends the stream: the events it produced
        before the break, then ``response.failed``, and :attr:`failure` says why. Dropping
        the events already numbered would leave a gap in the sequence numbers, or a failed
        response whose opening events were never sent, which the SDKs refuse.

        Args:
            chunk: One ``data:`` payload of the engine's stream, parsed (not ``[DONE]``).

        Returns:
            The events to send now, possibly none. After the terminal event, always none.
        """
        if self._terminated:
            return []
        events: list[Event] = []
        try:
            self._feed(chunk, events)
        except UpstreamFormatError as exc:
            events.extend(self.failed_event(str(exc)))
        return events

    def _feed(self, chunk: dict[str, Any], events: list[Event]) -> None:
        if not isinstance(chunk, dict):
            raise UpstreamFormatError("a stream chunk is not a JSON object")
        self._start(chunk, events)

        error = chunk.get("error")
        if error is not None or chunk.get("object") == "error":
            source = error if isinstance(error, dict) else chunk
            message = source.get("message")
            events.extend(self.failed_event(message if isinstance(message, str) else "the engine failed"))
            return
        self._read(chunk, events)

    def _malformed(self, what: str) -> None:
        """A chunk that breaks the chat-completions stream's shape fails the stream (see :meth:`feed`)."""
        raise UpstreamFormatError(what)

    def _on_finish(self, choice: dict[str, Any], events: list[Event]) -> None:
        self._close_all(events, self._item_status())

    def _on_last_chunk(self, events: list[Event]) -> None:
        self._terminal(events)

    def finish(self) -> list[Event]:
        """Close open items and produce the terminal event, unless that already happened.

        When the engine's stream ended without a finish reason, the answer was cut off: the
        response fails, which harnesses retry, and its open items are listed in it as
        ``incomplete`` with no ``done`` event of their own. Codex runs a function call, and
        keeps any item in its history, at the item's ``response.output_item.done``, whatever
        its status: a truncated command must not be run.

        Returns:
            The remaining events; none if the terminal event was already produced.
        """
        if self._terminated:
            return []
        events: list[Event] = []
        self._start({}, events)
        try:
            if self._finish_reason is None:
                events.extend(self.failed_event("the engine's stream ended before the answer was finished"))
            else:
                self._close_all(events, self._item_status())
                self._terminal(events)
        except UpstreamFormatError as exc:
            events.extend(self.failed_event(str(exc)))
        return events

    def _idle(self, events: list[Event]) -> None:
        """A ``response.in_progress`` event, once the response is open (before it opens, its opening).

        For a long stretch of engine chunks that make no event (a tool call's arguments held
        until its name comes, an engine that sends empty deltas). The event is the API's own
        and says nothing new, so clients that do not act on it (Codex, the SDKs) skip it.
        """
        self._emit(events, "response.in_progress", response=self._response("in_progress"))

    def _ended(self) -> bool:
        return self._terminated

    def _opened(self) -> bool:
        return self._ids is not None

    def _begin(self, chunk: dict[str, Any], events: list[Event]) -> None:
        self._start(chunk, events)

    def failed_event(self, message: str) -> list[Event]:
        """Produce ``response.failed``, the terminal event for an error mid-stream.

        The events that open a response are produced first if none were, so the stream
        is well formed even when the engine failed before its first chunk.

        Args:
            message: What went wrong, shown to the harness.

        Returns:
            The events to send; none if the terminal event was already produced.
        """
        if self._terminated:
            return []
        events: list[Event] = []
        self._start({}, events)
        for item in self._items:
            if not item.closed:
                item.status = "incomplete"
        error = {"code": "server_error", "message": message}
        response = self._response("failed", error=error)
        self._emit(events, "response.failed", response=response)
        self._terminated = True
        self.failure = message
        return events

    def failed_instead(self, message: str, held_from: int) -> list[Event]:
        """``response.failed`` in place of the events numbered ``held_from`` and later.

        For a stream whose call could not be recorded: those events were held back, never
        sent, and may include the terminal event. The failure takes the first of their
        numbers, so the harness sees no gap; if even the opening events were held, it gets
        them again, opening the failed response. Its output holds the items the harness saw
        announced, as ``incomplete`` unless it saw them end (their text is all the engine made).

        Args:
            message: What went wrong, shown to the harness.
            held_from: The sequence number of the first event not sent.

        Returns:
            The events to send instead of the held ones.
        """
        self._sequence = held_from
        self._terminated = False
        if held_from == 0:  # nothing was sent: open the response afresh
            self._ids = None
            self._messages = self._reasonings = 0
            self._text = self._thought = self._tool = None
            self._tools = {}
        self._items = [item for item in self._items if item.added_at < held_from]
        for item in self._items:
            if item.closed_at >= held_from:
                item.status = "in_progress"  # its end was held back: failed_event makes it incomplete
        return self.failed_event(message)

    # -- internals

    def _emit(self, events: list[Event], event_type: str, **fields: Any) -> None:
        events.append((event_type, {"type": event_type, "sequence_number": self._sequence, **fields}))
        self._sequence += 1

    def _start(self, chunk: dict[str, Any], events: list[Event]) -> _Ids:
        """Open the response on the first chunk: its id derives from the chunk's id."""
        if self._ids is not None:
            return self._ids
        self._ids = ids = _Ids.derive(chunk.get("id"), self._requested_id)
        self._created_at = _created_at(chunk)
        self._model = _model(chunk, self._request)
        response = self._response("in_progress")
        self._emit(events, "response.created", response=response)
        self._emit(events, "response.in_progress", response=response)
        return ids

    def _item_status(self) -> str:
        return "incomplete" if _incomplete_reason(self._finish_reason) else "completed"

    def _response(self, status: str, *, error: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._ids is not None
        final = status != "in_progress"
        return _response_object(
            self._request,
            response_id=self._ids.response_id,
            created_at=self._created_at,
            model=self._model,
            status=status,
            output=[item.snapshot(self._custom_tools) for item in self._items] if final else [],
            usage=_usage(self._usage) if final else None,
            incomplete_reason=_incomplete_reason(self._finish_reason),
            error=error,
        )

    def _announce(self, item: _Item, events: list[Event]) -> None:
        """Give the item its output index and send ``response.output_item.added``."""
        if item.kind in ("function_call", "custom_tool_call"):
            assert self._ids is not None
            if item.name in self._custom_tools.custom:
                item.kind = "custom_tool_call"
                item.item_id = self._ids.custom_tool_call(item.index)
            else:
                item.item_id = self._ids.function_call(item.index)
        item.output_index = len(self._items)
        item.announced = True
        item.added_at = self._sequence
        self._items.append(item)
        self._emit(events, "response.output_item.added", output_index=item.output_index,
                   item=item.added(self._custom_tools))
        if item.kind == "function_call" and item.text:
            self._emit_arguments(item, item.text, events)

    def _on_reasoning(self, text: str, events: list[Event]) -> None:
        for other in (self._text, self._tool):
            if other is not None:
                self._close(other, events, "completed")
        item = self._thought
        if item is None:
            assert self._ids is not None
            item = _Item(kind="reasoning", item_id=self._ids.reasoning(self._reasonings))
            self._reasonings += 1
            self._thought = item
            self._announce(item, events)
            self._emit(events, "response.content_part.added", item_id=item.item_id, output_index=item.output_index,
                       content_index=0, part=_reasoning_part(""))
        item.text += text
        self._emit(events, "response.reasoning_text.delta", item_id=item.item_id, output_index=item.output_index,
                   content_index=0, delta=text)

    def _on_text(self, text: str, events: list[Event]) -> None:
        shown = self._between_calls(text, self._text is not None)
        if shown is None:
            return
        text = shown
        for other in (self._thought, self._tool):
            if other is not None:
                self._close(other, events, "completed")
        item = self._text
        if item is None:
            assert self._ids is not None
            item = _Item(kind="message", item_id=self._ids.message(self._messages))
            self._messages += 1
            self._text = item
            self._announce(item, events)
            self._emit(
                events,
                "response.content_part.added",
                item_id=item.item_id,
                output_index=item.output_index,
                content_index=0,
                part=_text_part(""),
            )
        item.text += text
        self._emit(
            events,
            "response.output_text.delta",
            item_id=item.item_id,
            output_index=item.output_index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _on_tool_call(self, call: ToolCall, fragment: str, new: bool, events: list[Event]) -> None:
        index = call.key
        item = self._tools.get(index)
        if item is None:
            for other in (self._thought, self._text, self._tool):
                if other is not None:
                    self._close(other, events, "completed")
            assert self._ids is not None
            item = _Item(kind="function_call", index=index, call_id=self._ids.call(index))
            self._tools[index] = item
            self._tool = item
        elif item.closed:
            raise UpstreamFormatError(f"tool call {index} continued after the next item had started")

        if not item.announced:
            item.call_id = call.call_id or item.call_id
            item.name = call.name or item.name
        if fragment:
            item.text = call.arguments
            if item.announced and item.kind == "function_call":
                self._emit_arguments(item, fragment, events)
        if not item.announced and item.name:
            # A call's id and name come before its arguments: announce it once they are
            # known (arguments that came early go out in one delta).
            self._announce(item, events)

    def _emit_arguments(self, item: _Item, delta: str, events: list[Event]) -> None:
        self._emit(
            events,
            "response.function_call_arguments.delta",
            item_id=item.item_id,
            output_index=item.output_index,
            delta=delta,
        )

    def _close(self, item: _Item, events: list[Event], status: str) -> None:
        """End an item: send its ``done`` events with the full text or arguments.

        Raises:
            UpstreamFormatError: a tool call the engine never named, which no harness could run.
        """
        if item.closed:
            return
        if item.kind not in ("message", "reasoning") and not item.name:
            raise UpstreamFormatError(f"the engine's tool call {item.index} has no name")
        if not item.announced:
            self._announce(item, events)
        item.status = status
        item.closed_at = self._sequence
        where = {"item_id": item.item_id, "output_index": item.output_index}
        done = item.snapshot(self._custom_tools)
        if item.kind == "message":
            self._emit(events, "response.output_text.done", **where, content_index=0, text=item.text, logprobs=[])
            self._emit(events, "response.content_part.done", **where, content_index=0, part=_text_part(item.text))
            self._text = None
        elif item.kind == "reasoning":
            self._emit(events, "response.reasoning_text.done", **where, content_index=0, text=item.text)
            self._emit(events, "response.content_part.done", **where, content_index=0,
                       part=_reasoning_part(item.text))
            self._thought = None
        else:
            if item.kind == "custom_tool_call":
                text = _custom_input(item.text)
                if text:
                    self._emit(events, "response.custom_tool_call_input.delta", **where, delta=text)
                self._emit(events, "response.custom_tool_call_input.done", **where, input=text)
            else:
                # The call's name too: newer SDKs declare it on this event (Codex reads the item's).
                self._emit(events, "response.function_call_arguments.done", **where, name=done["name"],
                           arguments=item.text)
            self._tool = None
            self.tool_closed = True
        self._emit(events, "response.output_item.done", output_index=item.output_index, item=done)

    def _close_all(self, events: list[Event], status: str) -> None:
        """End the open items; a tool call the output limit cut off gets no ``done`` of its own.

        As for a stream that ends early (:meth:`finish`): Codex runs a call at its
        ``response.output_item.done`` whatever the status, and a command or patch cut short by
        ``max_output_tokens`` must not run. The terminal response lists it as ``incomplete``.
        """
        for item in (self._thought, self._text, self._tool):
            if item is None:
                continue
            if status == "incomplete" and item.kind not in ("message", "reasoning"):
                if not item.name:
                    raise UpstreamFormatError(f"the engine's tool call {item.index} has no name")
                item.status = status
                self._tool = None
                continue
            self._close(item, events, status)

    def _terminal(self, events: list[Event]) -> None:
        status = self._item_status()
        event_type = "response.incomplete" if status == "incomplete" else "response.completed"
        self._emit(events, event_type, response=self._response(status))
        self._terminated = True


# --------------------------------------------------------------------------- wire helpers


def sse_encode(event: str, data: dict[str, Any]) -> bytes:
    """Encode one server-sent event as ``event: X`` and ``data: {json}`` lines.

    Args:
        event: The event name; Responses clients expect it to equal ``data["type"]``.
        data: The event's JSON payload.

    Returns:
        The UTF-8 bytes of the event, ending with the blank line that terminates it.
    """
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, error_type: str) -> dict[str, Any]:
    """Build OpenAI's error JSON, which the openai SDKs and Codex parse.

    Args:
        status: The HTTP status the body goes with; it chooses the type when
            ``error_type`` is empty or one of the two generic ones.
        message: The human-readable message.
        error_type: OpenAI's error type, such as ``invalid_request_error``. The proxy's own
            errors say only "the request" or "the server"; an engine's 429 (or 404, 401) is then
            given its status's own type, as the API gives it.

    Returns:
        ``{"error": {"message", "type", "param": None, "code": None}}``.
    """
    kind = error_type
    if not kind or kind in ("invalid_request_error", "api_error"):
        kind = _ERROR_TYPES.get(status, kind or ("api_error" if status >= 500 else "invalid_request_error"))
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
