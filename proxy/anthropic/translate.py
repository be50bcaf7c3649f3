"""Translation between the Anthropic Messages API and OpenAI chat completions.

The engine (vLLM) returns prompt and completion token ids, logprobs and weight versions only on its
chat-completions endpoint, so a harness that speaks the Messages API (Claude Code always streams
``POST /v1/messages``) is served by translating its request to a chat-completions request, and the
engine's answer (a completion or a stream of chunks) back into a Message or Anthropic's SSE events.

Everything here is pure: JSON-like dicts in, JSON-like dicts out, no I/O. Malformed requests raise
:class:`~proxy.errors.InvalidRequestError`; requests that are well formed but ask for something the
engine cannot do (documents, server tools, MCP servers; images unless the proxy is set to pass
them, see :mod:`proxy.media`) raise
:class:`~proxy.errors.UnsupportedFeatureError` naming the JSON path, so a harness author sees at once
what to turn off.

Decisions worth knowing (each is explained where it is made):

* The engine's reasoning becomes a ``thinking`` block when the request turned thinking on (its
  text left out with ``display: "omitted"``), and the harness's thinking blocks that this proxy
  made go back to the engine as the assistant message's ``reasoning`` (:mod:`proxy.reasoning`);
  other thinking and ``redacted_thinking`` blocks are dropped. The ``thinking`` configuration
  itself changes nothing upstream.
* ``tool_result`` blocks become ``role: tool`` messages; ``is_error`` leaves the text unchanged.
* Tool-call arguments from the engine that are not valid JSON objects are handed to the harness as
  ``{"_raw": "<arguments>"}``.
* Unknown top-level request fields are ignored so that a harness upgrade adding a new optional field
  does not break every call; unknown *content block* types are refused, because dropping content
  would silently change what the model sees.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Final, Literal

import orjson

from proxy import exact_json
from proxy.errors import InvalidRequestError, ProxyError, UnsupportedFeatureError
from proxy.media import DOCUMENT_PLACEHOLDER, IMAGE_PLACEHOLDER, ImagePolicy, inline_image, refuse_images
from proxy.reasoning import engine_reasoning, signature, signed_thought
from proxy.stream_state import ChunkTranslator, ToolCall

logger = logging.getLogger(__name__)

__all__ = [
    "SSEEvent",
    "StreamTranslator",
    "error_body",
    "error_event",
    "from_chat_response",
    "sse_encode",
    "thinking_display",
    "to_chat_request",
]

SSEEvent = tuple[str, dict[str, Any]]
"""One Anthropic server-sent event: the ``event:`` name and the ``data:`` object."""

EMPTY_ERROR_RESULT_TEXT: Final = "Error"
"""Text of a ``tool_result`` that has ``is_error`` set but no content.

An empty tool message would leave the model no way to tell that the call failed; this is the only
case in which the translation adds words the harness did not write.
"""

RAW_ARGUMENTS_KEY: Final = "_raw"
"""Key under which tool-call arguments that are not a JSON object reach the harness."""

# Top-level fields that ask for work only Anthropic's servers can do. Ignoring them would make the
# harness believe e.g. remote MCP tools were offered to the model, so the call is refused instead.
_UNHONOURABLE_FIELDS: Final = {
    "mcp_servers": "remote MCP servers are run by Anthropic's servers; the engine cannot reach them",
    "container": "code-execution containers are run by Anthropic's servers; the engine has none",
}

# Content block types that carry content the engine cannot take (no document parsing) or results of
# server tools that never ran here. Images are the proxy's images policy's (proxy/media.py).
_UNSUPPORTED_BLOCKS: Final = {
    "document": "the engine reads no documents; send their text as text blocks (OPENFORGE_PROXY_IMAGES=placeholder "
                "sends each as a line of text saying it was left out)",
    "search_result": "search-result blocks with citations are not supported",
    "container_upload": "code-execution containers are not supported",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
    "web_fetch_tool_result": "server tools are not supported",
    "code_execution_tool_result": "server tools are not supported",
    "bash_code_execution_tool_result": "server tools are not supported",
    "text_editor_code_execution_tool_result": "server tools are not supported",
    "tool_search_tool_result": "server tools are not supported",
    "mcp_tool_use": "remote MCP servers are not supported",
    "mcp_tool_result": "remote MCP servers are not supported",
}

_THINKING_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})

_GENERIC_ERROR_TYPES: Final = frozenset({"invalid_request_error", "api_error"})

_STATUS_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


# --------------------------------------------------------------------------------------------------
# small helpers


def _dumps(value: Any) -> str:
    """Compact JSON (no spaces, UTF-8 kept), the form OpenAI-style tool-call arguments take."""
    return orjson.dumps(value).decode()


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _expect_dict(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{path} must be an object, got {_type_name(value)}")
    return value


def _expect_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{path} must be an array, got {_type_name(value)}")
    return value


def _expect_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{path} must be a string, got {_type_name(value)}")
    return value


def _expect_number(value: Any, path: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{path} must be a number, got {_type_name(value)}")
    return value


def _block_type(block: Any, path: str) -> str:
    block = _expect_dict(block, path)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{path}.type must be a string, got {_type_name(kind)}")
    return kind


def _refuse_block(kind: str, path: str) -> UnsupportedFeatureError:
    detail = _UNSUPPORTED_BLOCKS.get(kind, f"unknown content block type {kind!r}")
    return UnsupportedFeatureError(f"{path}.type", detail)


def _join_text(parts: list[str]) -> str:
    """Join several text blocks of one message into one string.

    A newline is what vLLM itself puts between text parts when it flattens list content for a chat
    template, so the engine sees the same prompt whichever way the harness split its text.
    """
    return "\n".join(parts)


def _text_only(content: Any, path: str) -> str:
    """Text of a ``system`` field or system-role message: a string or a list of text blocks.

    ``cache_control`` and ``citations`` on the blocks are ignored: the engine's prefix cache works
    without hints, and citations are metadata about the text, not part of it.
    """
    if isinstance(content, str):
        return content
    blocks = _expect_list(content, path)
    parts: list[str] = []
    for j, block in enumerate(blocks):
        block_path = f"{path}[{j}]"
        kind = _block_type(block, block_path)
        if kind != "text":
            if kind in _THINKING_BLOCKS or kind in {"tool_use", "tool_result", "image"}:
                raise InvalidRequestError(f"{block_path}.type must be 'text' here, got {kind!r}")
            raise _refuse_block(kind, block_path)
        parts.append(_expect_str(block.get("text"), f"{block_path}.text"))
    return _join_text(parts)


# --------------------------------------------------------------------------------------------------
# request: Messages -> chat completions


_IMAGE_MEDIA_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def _image_part(block: dict[str, Any], path: str, images: ImagePolicy) -> dict[str, Any] | str:
    """An ``image`` block as a chat ``image_url`` part (its data as a data URL), if ``images`` allows.

    Refused by default (see :mod:`proxy.media`). Let through, a vision model sees the image, as
    the harness meant (Claude Code reads screenshots and image files into tool results), and a
    text-only model's engine refuses it with its own 400, which reaches the harness as
    Anthropic's error. Under ``placeholder`` it is the placeholder's text, whatever its source.
    """
    if images == "placeholder":
        return IMAGE_PLACEHOLDER
    if images != "inline":
        raise refuse_images(f"{path}.type")
    source = _expect_dict(block.get("source"), f"{path}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type = _expect_str(source.get("media_type"), f"{path}.source.media_type")
        if media_type not in _IMAGE_MEDIA_TYPES:
            raise InvalidRequestError(f"{path}.source.media_type must be one of "
                                      f"{', '.join(sorted(_IMAGE_MEDIA_TYPES))}, got {media_type!r}")
        url = f"data:{media_type};base64,{_expect_str(source.get('data'), f'{path}.source.data')}"
    elif kind == "url":
        url = _expect_str(source.get("url"), f"{path}.source.url")
    elif kind == "file":
        raise UnsupportedFeatureError(f"{path}.source.type", "files uploaded to Anthropic's Files API are not "
                                      "reachable from the engine; send the image as base64 data")
    else:
        raise InvalidRequestError(f"{path}.source.type must be 'base64', 'url' or 'file', got {kind!r}")
    return inline_image(url, f"{path}.type", f"{path}.source.url", images)


def _parts_content(parts: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content from its text and image parts, in order.

    Text alone stays one string (see :func:`_join_text`), so a text-only prompt is the same
    whichever way the harness split it; with an image the content is a list of chat parts, each
    text block a text part, which vLLM renders as it would for a chat-completions client.
    """
    if all(isinstance(part, str) for part in parts):
        return _join_text([part for part in parts if isinstance(part, str)])
    return [{"type": "text", "text": part} if isinstance(part, str) else part for part in parts]


def _tool_result_message(block: dict[str, Any], path: str, images: ImagePolicy) -> dict[str, Any]:
    """A ``tool_result`` block as a ``role: tool`` chat message.

    ``is_error`` has no counterpart in chat completions and chat templates have no slot for it. The
    text is passed on unchanged rather than prefixed: harnesses already say what went wrong in the
    text (Claude Code wraps failures in ``<tool_use_error>`` or reports the exit code), and a marker
    the harness never wrote would be a proxy invention the trained policy learns to depend on. Only
    an error result with no content at all gets :data:`EMPTY_ERROR_RESULT_TEXT`, so the failure is
    not invisible. The flag itself stays on the message as ``is_error: true``, which templates do not
    render (the engine's prompt is the same) and the recorded call keeps for the assembler's
    error-recovery annotations.
    """
    tool_use_id = _expect_str(block.get("tool_use_id"), f"{path}.tool_use_id")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequestError(f"{path}.is_error must be a boolean, got {_type_name(is_error)}")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts: list[str | dict[str, Any]] = []
        for k, inner in enumerate(_expect_list(content, f"{path}.content")):
            inner_path = f"{path}.content[{k}]"
            kind = _block_type(inner, inner_path)
            if kind == "text":
                parts.append(_expect_str(inner.get("text"), f"{inner_path}.text"))
            elif kind == "image":
                parts.append(_image_part(inner, inner_path, images))
            elif kind == "document" and images == "placeholder":
                parts.append(DOCUMENT_PLACEHOLDER)
            else:
                raise _refuse_block(kind, inner_path)
        joined = _parts_content(parts)
        if not isinstance(joined, str):
            return {"role": "tool", "tool_call_id": tool_use_id, "content": joined,
                    **({"is_error": True} if is_error else {})}
        text = joined
    if is_error and not text:
        text = EMPTY_ERROR_RESULT_TEXT
    message: dict[str, Any] = {"role": "tool", "tool_call_id": tool_use_id, "content": text}
    if is_error:
        message["is_error"] = True
    return message


def _user_messages(blocks: list[tuple[Any, str]], called: set[str], images: ImagePolicy) -> list[dict[str, Any]]:
    """A user turn (its blocks, each with its path for errors) as chat messages, keeping block order.

    Chat completions carry tool results as separate ``role: tool`` messages, so a user turn is cut
    into runs: each ``tool_result`` becomes a tool message and each run of text blocks between them a
    user message. The usual Anthropic shape (results first, then text) thus becomes the tool
    messages followed by one user message, which is what chat templates expect after an assistant
    turn with tool calls.

    Anthropic refuses a ``tool_result`` whose ``tool_use_id`` is not in ``called`` (the ids of
    the earlier assistant turns' tool calls), and so does this: a chat template would render it as
    the answer to a call the model never made.
    """
    out: list[dict[str, Any]] = []
    pending: list[str | dict[str, Any]] = []
    for block, block_path in blocks:
        kind = _block_type(block, block_path)
        if kind == "text":
            pending.append(_expect_str(block.get("text"), f"{block_path}.text"))
        elif kind == "image":
            pending.append(_image_part(block, block_path, images))
        elif kind == "document" and images == "placeholder":
            pending.append(DOCUMENT_PLACEHOLDER)
        elif kind == "tool_result":
            if pending:
                out.append({"role": "user", "content": _parts_content(pending)})
                pending = []
            result = _tool_result_message(block, block_path, images)
            if result["tool_call_id"] not in called:
                raise InvalidRequestError(f"{block_path}: a tool_result's tool_use_id {result['tool_call_id']!r} "
                                          "matches no tool_use in an earlier assistant message")
            out.append(result)
        elif kind == "tool_use" or kind in _THINKING_BLOCKS:
            raise InvalidRequestError(f"{block_path}.type {kind!r} is only allowed in assistant messages")
        else:
            raise _refuse_block(kind, block_path)
    if pending or not out:
        out.append({"role": "user", "content": _parts_content(pending)})
    return out


def _tool_call(block: dict[str, Any], path: str) -> dict[str, Any]:
    tool_id = _expect_str(block.get("id"), f"{path}.id")
    name = _expect_str(block.get("name"), f"{path}.name")
    tool_input = _expect_dict(block.get("input"), f"{path}.input")
    return {"id": tool_id, "type": "function", "function": {"name": name, "arguments": _dumps(tool_input)}}


def _assistant_message(blocks: list[tuple[Any, str]]) -> dict[str, Any]:
    """An assistant turn as one chat message with text, ``tool_calls`` and ``reasoning``.

    A ``thinking`` block this proxy made (its signature says so, and carries the text) is the
    engine's own reasoning and goes back as the message's ``reasoning``, which the chat template
    renders where the model wrote it (see :mod:`proxy.reasoning`). Other ``thinking`` and all
    ``redacted_thinking`` blocks were written by another model (they carry Anthropic's signatures,
    or are encrypted) and are dropped: they are not this model's tokens.

    Text and tool calls go into separate fields of the chat message, so text written after a tool
    call is moved before it. The engine's tool-call parsers produce that order in the first place.
    """
    texts: list[str] = []
    thoughts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for block, block_path in blocks:
        kind = _block_type(block, block_path)
        if kind == "text":
            texts.append(_expect_str(block.get("text"), f"{block_path}.text"))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block, block_path))
        elif kind == "thinking":
            thought = signed_thought(block.get("signature"))
            if thought:
                thoughts.append(thought)
        elif kind in _THINKING_BLOCKS:
            continue
        elif kind in {"tool_result", "image"}:
            raise InvalidRequestError(f"{block_path}.type {kind!r} is only allowed in user messages")
        else:
            raise _refuse_block(kind, block_path)
    message: dict[str, Any] = {"role": "assistant"}
    if tool_calls:
        message["content"] = _join_text(texts) if texts else None
        message["tool_calls"] = tool_calls
    else:
        message["content"] = _join_text(texts)
    if thoughts:
        message["reasoning"] = "\n".join(thoughts)
    return message


BILLING_LINE = "x-anthropic-billing-header:"
"""How the attribution block Claude Code puts first in ``system`` begins."""


def _without_billing_line(system: Any) -> Any:
    """``system`` without Claude Code's attribution block, which Anthropic's API takes out of the prompt.

    Claude Code (seen in 2.1.332) sends ``x-anthropic-billing-header: cc_version=...;
    cc_entrypoint=...;`` as the first text block of ``system``. The real API consumes it: no
    model sees it. Passed on, it would put a line into the engine's prompt that the model
    never sees behind Anthropic's API, and since it names the harness's version, every Claude
    Code upgrade would change the prompt's first tokens and miss the engine's prefix cache.
    Only that line goes: a harness (or a gateway in front of one) that writes its prompt into the
    same block after it keeps the prompt, which dropping the block lost without a word.
    """
    if not isinstance(system, list):
        return system
    out = []
    for block in system:
        if (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
                and block["text"].startswith(BILLING_LINE)):
            rest = block["text"].partition("\n")[2]
            if not rest:
                continue
            block = {**block, "text": rest}
        out.append(block)
    return out


def _chat_messages(body: dict[str, Any], images: ImagePolicy) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _without_billing_line(body.get("system"))
    if system is not None:
        text = _text_only(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = _expect_list(body.get("messages"), "messages")
    if not raw:
        raise InvalidRequestError("messages must contain at least one message")
    called: set[str] = set()  # tool_use ids so far
    for role, blocks in _turns(raw):
        if role == "user":
            out += _user_messages(blocks, called, images)
        elif role == "assistant":
            turn = _assistant_message(blocks)
            called.update(call["id"] for call in turn.get("tool_calls") or ())
            out.append(turn)
        else:
            out.append({"role": "system", "content": blocks[0][0]["text"]})
    return out


_Turn = tuple[str, list[tuple[Any, str]]]
"""A turn's role and its content blocks, each with its path for errors (a system turn: its text)."""


def _turns(raw: list[Any]) -> list[_Turn]:
    """The request's messages as turns: consecutive user or assistant messages make one turn.

    Anthropic's API combines such messages into a single turn, so harnesses may send them (a
    user message after a tool result, a prefill after an assistant message). Passed on apart,
    they would reach the chat template as two turns of one role, which strict templates refuse
    ("roles must alternate") and others render differently from the turn the harness meant.
    A system-role message (Claude Code sends them) stays on its own, as a ``system`` turn whose
    only block is its text.
    """
    turns: list[_Turn] = []
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        message = _expect_dict(message, path)
        role = message.get("role")
        if "content" not in message:
            raise InvalidRequestError(f"{path}.content is required")
        content = message["content"]
        if role == "system":
            # Not part of the public API, but Claude Code sends it; it means what it says.
            text = _text_only(content, f"{path}.content")
            turns.append(("system", [({"type": "text", "text": text}, f"{path}.content")]))
            continue
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{path}.role must be 'user', 'assistant' or 'system', got {role!r}")
        if isinstance(content, str):
            blocks = [({"type": "text", "text": content}, f"{path}.content")]
        else:
            blocks = [(block, f"{path}.content[{j}]")
                      for j, block in enumerate(_expect_list(content, f"{path}.content"))]
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    return turns


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools as chat ``function`` tools.

    Server tools (``web_search_20250305``, ``bash_20250124``, ``text_editor_…``, ``computer_…``, …)
    are executed by Anthropic's servers or follow schemas only Claude was trained on; the engine can
    do neither, so they are refused rather than passed on as if they were ordinary functions.
    """
    out: list[dict[str, Any]] = []
    for k, tool in enumerate(_expect_list(tools, "tools")):
        path = f"tools[{k}]"
        tool = _expect_dict(tool, path)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise UnsupportedFeatureError(
                f"{path}.type", f"server tool {kind!r} cannot run on the engine; offer a custom tool instead"
            )
        name = _expect_str(tool.get("name"), f"{path}.name")
        schema = _expect_dict(tool.get("input_schema"), f"{path}.input_schema")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            function["description"] = _expect_str(description, f"{path}.description")
        function["parameters"] = schema
        strict = tool.get("strict")
        if isinstance(strict, bool):
            function["strict"] = strict
        out.append({"type": "function", "function": function})
    return out


def _apply_tool_choice(choice: Any, has_tools: bool, chat: dict[str, Any]) -> None:
    """Map ``tool_choice``: auto→"auto", any→"required", tool→named function, none→"none"."""
    choice = _expect_dict(choice, "tool_choice")
    kind = choice.get("type")
    mapped: Any
    if kind == "auto":
        mapped = "auto"
    elif kind == "any":
        mapped = "required"
    elif kind == "none":
        mapped = "none"
    elif kind == "tool":
        name = _expect_str(choice.get("name"), "tool_choice.name")
        mapped = {"type": "function", "function": {"name": name}}
    else:
        raise InvalidRequestError(
            f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}"
        )
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None and not isinstance(disable_parallel, bool):
        raise InvalidRequestError(
            f"tool_choice.disable_parallel_tool_use must be a boolean, got {_type_name(disable_parallel)}"
        )
    if not has_tools:
        if kind in ("any", "tool"):
            raise InvalidRequestError(f"tool_choice.type {kind!r} requires tools")
        return  # "auto" or "none" without tools means no tools: nothing to say upstream
    chat["tool_choice"] = mapped
    if disable_parallel:
        chat["parallel_tool_calls"] = False


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured output (``output_format`` or ``output_config.format``) as a chat ``response_format``.

    ``output_config.effort`` is ignored: it tunes how hard Claude thinks, and the engine has no such
    knob.
    """
    path = "output_format"
    fmt = body.get("output_format")
    if fmt is None:
        config = body.get("output_config")
        if config is None:
            return None
        fmt = _expect_dict(config, "output_config").get("format")
        path = "output_config.format"
        if fmt is None:
            return None
    fmt = _expect_dict(fmt, path)
    if fmt.get("type") != "json_schema":
        raise UnsupportedFeatureError(
            f"{path}.type", f"only 'json_schema' is supported, got {fmt.get('type')!r}"
        )
    schema = _expect_dict(fmt.get("schema"), f"{path}.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise InvalidRequestError("max_tokens is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {value!r}")
    return value


ThinkingDisplay = Literal["summarized", "omitted"]
"""How thinking blocks show their text: in full (this proxy has no summaries), or not at all."""


def thinking_display(body: dict[str, Any]) -> ThinkingDisplay | None:
    """How the answer shows thinking blocks; None when the request did not turn thinking on.

    Anthropic's API answers with thinking blocks only when thinking is on, and a client that did
    not ask may not expect them; the engine's reasoning is then left out, as its tokens are still
    captured. With ``display: "omitted"`` a block's text is empty and only its signature carries
    the thinking, to be sent back (Claude Code asks for that on most calls).
    """
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive"):
        return None
    return "omitted" if thinking.get("display") == "omitted" else "summarized"


def _thinking_block(thought: str, display: ThinkingDisplay) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thought if display == "summarized" else "", "signature": signature(thought)}


def to_chat_request(body: dict[str, Any], *, images: ImagePolicy = "refuse") -> dict[str, Any]:
    """Translate an Anthropic Messages request into a chat-completions request for the engine.

    Fields that are ignored, and why:

    * ``thinking``: the engine has no thinking budget, and whether a model reasons is set by how it
      is served (vLLM's reasoning parser, the chat template). Recent Claude Code versions send a
      ``thinking`` configuration (``adaptive`` or ``enabled``) on every call by default, so refusing
      it would make the harness unusable. It only decides whether and how the engine's reasoning
      comes back as a thinking block (:func:`thinking_display`).
    * ``context_management``: Claude Code sends it to have old thinking blocks cleared (or kept);
      the engine gets the thinking of every turn the harness sent back and its chat template
      decides which turns' thinking to render; other edits (clearing old tool results) only save
      Anthropic-side context, and the engine is given the full history the harness sent.
    * ``metadata``, ``service_tier``, ``cache_control``, ``output_config.effort`` and any unknown
      field: accounting and hints with no effect on the answer.

    ``mcp_servers`` and ``container`` are refused, since the model would be told about tools or a
    sandbox that do not exist.

    When the last message is from the assistant, Anthropic continues that text (prefill). vLLM does
    the same with ``continue_final_message``, so that is asked for.

    Args:
        body: The parsed JSON body of ``POST /v1/messages``.
        images: Whether images go to the engine (:data:`proxy.media.ImagePolicy`).

    Returns:
        The chat-completions request body (``model``, ``messages``, sampling, tools, streaming).

    Raises:
        InvalidRequestError: A field is missing or has the wrong type.
        UnsupportedFeatureError: A field asks for something the engine cannot do; ``field`` names it.
    """
    body = _expect_dict(body, "request body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(f"model must be a non-empty string, got {model!r}")
    max_tokens = _max_tokens(body)
    for field, why in _UNHONOURABLE_FIELDS.items():
        if body.get(field) not in (None, [], {}):
            raise UnsupportedFeatureError(field, why)

    messages = _chat_messages(body, images)
    chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}

    last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" not in last and not last["content"] \
            and not last.get("reasoning") and len(messages) > 1:
        # An empty final assistant turn asks for no prefill (the API ignores it); rendered, it
        # would be a closed turn the model never wrote, before the one it is asked for.
        messages.pop()
        last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" not in last and last["content"]:
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True

    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = _expect_number(body[name], name)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {_type_name(top_k)}")
        chat["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        sequences = [
            _expect_str(s, f"stop_sequences[{k}]") for k, s in enumerate(_expect_list(stop, "stop_sequences"))
        ]
        if sequences:
            chat["stop"] = sequences

    tools = body.get("tools")
    chat_tools = _chat_tools(tools) if tools is not None else []
    if chat_tools:
        chat["tools"] = chat_tools
    if body.get("tool_choice") is not None:
        _apply_tool_choice(body["tool_choice"], bool(chat_tools), chat)

    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError(f"stream must be a boolean, got {_type_name(stream)}")
    if stream:
        chat["stream"] = True
        # Anthropic reports token counts in the stream; chat completions only when asked to.
        chat["stream_options"] = {"include_usage": True}
    else:
        chat["stream"] = False
    return chat


# --------------------------------------------------------------------------------------------------
# response: chat completion -> Message


def _context_full(usage: Any, max_tokens: int | None, context: int | None) -> bool:
    """Whether an answer cut for length stopped at the context's end, short of the harness's ``max_tokens``.

    vLLM lowers a request's ``max_tokens`` to what its context leaves after the prompt (and the
    proxy lowers Claude Code's 32,000 to the context length, see ``CallService._fit_output``).
    Anthropic says ``model_context_window_exceeded`` for an answer that filled the context, and
    Claude Code stops on it as on ``max_tokens`` but reports a full context rather than a spent
    budget. Fewer tokens than asked for is not enough to say so: an engine may cap answers itself
    (``max_new_tokens`` in the model's generation config), so the prompt and the answer must also
    fill the engine's ``context``; unknown, the budget is assumed.
    """
    if not isinstance(usage, dict) or type(max_tokens) is not int or type(context) is not int:
        return False
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return type(prompt) is int and type(completion) is int and completion < max_tokens \
        and prompt + completion >= context


def _stop_reason(finish_reason: Any, engine_stop: Any, has_tool_use: bool,
                 context_full: bool = False) -> tuple[str | None, str | None]:
    """Map a chat ``finish_reason`` (and vLLM's ``stop_reason``) to ``(stop_reason, stop_sequence)``.

    vLLM puts the matched stop string in the choice's ``stop_reason`` (a token id when a stop token
    ended generation), which is how ``stop_sequence`` is told apart from a natural end. When the
    engine is forced to call a tool (``tool_choice`` required or named) it may finish with ``stop``
    while returning tool calls; Anthropic says ``tool_use`` whenever the answer holds tool calls, so
    the presence of tool calls wins over the finish reason. Conversely ``tool_calls`` without any
    parsed call becomes ``end_turn``: a harness told ``tool_use`` would look for a call to run.
    """
    if finish_reason is None:
        return None, None
    if finish_reason == "length":
        return ("model_context_window_exceeded" if context_full else "max_tokens"), None
    if finish_reason == "content_filter":
        return "refusal", None
    if has_tool_use:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def _parse_arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments from the engine as a tool_use ``input`` object.

    Anthropic's ``input`` must be an object, but a model can emit arguments that are not valid JSON
    or not an object. Refusing the whole answer would lose a sample the learner needs (a malformed
    call is exactly what RL should learn not to make), so the text goes to the harness as
    ``{"_raw": "<arguments>"}``; the harness's own input validation then reports the error back to
    the model as a tool result.
    """
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            # orjson reads an integer past 64 bits as a float, which would hand the harness a
            # different number than the model wrote (the stream passes the text on as it is).
            exact = exact_json.LONG_DIGITS.search(arguments)
            parsed = exact_json.loads(arguments) if exact else orjson.loads(arguments)
        except (ValueError, RecursionError):  # both decoders' errors are ValueErrors
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        return {RAW_ARGUMENTS_KEY: arguments}
    return {RAW_ARGUMENTS_KEY: _dumps(arguments)}


def _usage(usage: Any) -> dict[str, int]:
    """Chat ``usage`` as Anthropic usage.

    Anthropic counts prompt tokens served from cache separately (``input_tokens`` excludes them); when
    the engine reports ``prompt_tokens_details.cached_tokens`` the same split is made, so the sum a
    harness shows as context size stays the prompt length.
    """
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens")
    prompt = prompt if isinstance(prompt, int) else 0
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and 0 <= cached <= prompt else 0
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _message_id(chat_id: Any) -> str:
    if isinstance(chat_id, str) and chat_id:
        return f"msg_{chat_id}"
    return f"msg_{uuid.uuid4().hex}"


def from_chat_response(chat: dict[str, Any], *, model: str, max_tokens: int | None = None,
                       context: int | None = None, thinking: ThinkingDisplay | None = None) -> dict[str, Any]:
    """Translate a (non-streaming) chat completion into an Anthropic Message.

    The message id is ``"msg_" + chat id``, so the Message can be matched to the engine's record.
    Tool calls keep the engine's ids, since the harness sends them back as ``tool_use_id``. The
    engine's reasoning (vLLM's reasoning parser) comes first as a signed thinking block when
    ``thinking`` is on (see :mod:`proxy.reasoning`).

    Args:
        chat: The engine's chat-completion JSON.
        model: The model name to report (the one the harness asked for).
        max_tokens: The harness's ``max_tokens``; with ``context``, tells a full context from a
            spent budget (:func:`_context_full`).
        context: The engine's context length, when known.
        thinking: How the request asked for thinking blocks; None for none (:func:`thinking_display`).

    Returns:
        The Message JSON.

    Raises:
        ProxyError: The completion has no choice or no message (an engine fault, status 500).
    """
    choices = chat.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProxyError("the engine's answer has no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ProxyError("the engine's answer has no message")
    message_id = _message_id(chat.get("id"))

    content: list[dict[str, Any]] = []
    thought = engine_reasoning(message) if thinking else ""
    if thought and thinking:
        content.append(_thinking_block(thought, thinking))
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    tool_calls = message.get("tool_calls")
    for position, call in enumerate(tool_calls if isinstance(tool_calls, list) else []):
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        name = function.get("name")
        call_id = call.get("id")
        content.append(
            {
                "type": "tool_use",
                "id": call_id if isinstance(call_id, str) and call_id else f"toolu_{message_id}_{position}",
                "name": name if isinstance(name, str) else "",
                "input": _parse_arguments(function.get("arguments")),
            }
        )
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = _stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), has_tool_use,
        _context_full(chat.get("usage"), max_tokens, context),
    )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.get("usage")),
    }


# --------------------------------------------------------------------------------------------------
# streaming: chat completion chunks -> Anthropic SSE events


def sse_encode(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames it: an ``event:`` line, a ``data:`` line, a blank line."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(message: str) -> SSEEvent:
    """Anthropic's ``error`` event, sent when a stream fails after it has started.

    Once the HTTP status (200) is out, this event is the only way left to tell the harness that the
    answer is broken; SDKs raise it as an API error.
    """
    return "error", error_body(500, message, "api_error")


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """Anthropic's error JSON: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

    Args:
        status: The HTTP status the error goes out with; picks the error type when none is given.
        message: Human-readable explanation.
        error_type: Anthropic's error type (``overloaded_error``, …). The two generic ones,
            ``invalid_request_error`` and ``api_error``, give way to the status's own type.

    Returns:
        The error body.
    """
    if not error_type or error_type in _GENERIC_ERROR_TYPES:
        # The proxy's own errors say only "the request" or "the server"; Anthropic names the
        # status's own type (504 timeout_error, 413 request_too_large, 429 rate_limit_error).
        fallback = error_type or ("invalid_request_error" if 400 <= status < 500 else "api_error")
        error_type = _STATUS_ERROR_TYPES.get(status, fallback)
    return {"type": "error", "error": {"type": error_type, "message": message}}


PING: SSEEvent = ("ping", {"type": "ping"})
"""Anthropic's keep-alive event: its API sends it during a stream, and clients skip it."""


class StreamTranslator(ChunkTranslator):
    """Turns the engine's chat-completion chunks into Anthropic's Messages stream events.

    Anthropic streams ``message_start``; then per content block ``content_block_start``,
    ``content_block_delta`` events and ``content_block_stop`` (a thinking block when asked for,
    text, then one block per tool call); then ``message_delta`` with the stop reason and output
    token count; then ``message_stop``. Feed every parsed ``data:`` chunk to :meth:`feed` and call
    :meth:`finish` when the upstream stream ends (after ``[DONE]`` or early); each returns the
    events to send, in order.

    vLLM sends the finish reason in one chunk and the token counts in a last chunk with no choices,
    so ``message_delta`` waits for that usage chunk (or for :meth:`finish`) to carry both.

    A tool call's ``content_block_start`` needs its name; vLLM sends it in the call's first delta,
    but should a delta come without one, the block waits until the name arrives. A tool call's
    arguments go out whole, as one ``input_json_delta`` just before its ``content_block_stop``:
    the SDKs parse the partial JSON as it streams and give up on the whole message at the first
    fragment that cannot be JSON, so arguments that are not a JSON object go out as
    ``{"_raw": "<arguments>"}``, as in a whole answer (:func:`_parse_arguments`).
    With ``thinking`` on, the engine's reasoning streams as a thinking block (``thinking_delta``
    events unless its display is ``omitted``, then its ``signature_delta`` when it ends); otherwise
    it is not forwarded. Reasoning that resumes after text or a tool call opens another block.
    """

    def __init__(self, *, model: str, message_id: str | None = None, max_tokens: int | None = None,
                 context: int | None = None, thinking: ThinkingDisplay | None = None) -> None:
        super().__init__()
        self.model = model
        self.thinking = thinking
        """How reasoning goes out as a thinking block; None for not at all (:func:`thinking_display`)."""
        self.message_id = message_id
        self.max_tokens = max_tokens
        """The harness's ``max_tokens`` (with :attr:`context`, see :func:`_context_full`)."""
        self.context = context
        """The engine's context length, when known."""
        self._started = False
        self._done = False
        self._next_index = 0
        self._open: int | None = None  # index of the content block now open
        self._text_open = False
        self._thought: list[str] | None = None  # the open thinking block's text, until it stops
        self._open_tool: ToolCall | None = None  # the tool call whose block is open
        self._started_tools: set[int] = set()  # the calls whose content_block_start is out (it waits for a name)
        self._stopped_tools: set[int] = set()  # the calls whose content_block_stop is out
        self._has_tool_use = False
        self._engine_stop: Any = None
        self.prompt_tokens: int | None = None
        """The prompt's length when known before the engine's usage (for ``message_start``)."""

    def _idle(self, events: list[SSEEvent]) -> None:
        """The keep-alive once ``message_start`` is out (before it, ``message_start`` itself).

        The SDKs drop ``ping`` before their caller sees it, so it resets no harness's watchdog.
        Inside an open block the keep-alive is therefore an empty delta of that block, which
        every client adds to the block as nothing: an ``input_json_delta`` while a tool call's
        arguments are held, a ``thinking_delta`` while a think is not shown, a ``text_delta``
        while the engine is silent mid-text. Between blocks, ``ping``. (A ``message_start`` sent
        before the first chunk has an unknown input count (0); ``message_delta`` carries it at
        the end.)
        """
        index = self._open
        if index is None:
            events.append(PING)
        elif self._open_tool is not None:
            events.append(self._json_delta(index, ""))
        else:
            delta = {"type": "thinking_delta", "thinking": ""} if self._thought is not None else {"type": "text_delta",
                                                                                                  "text": ""}
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))

    def _ended(self) -> bool:
        return self._done

    def _opened(self) -> bool:
        return self._started

    def _begin(self, chunk: dict[str, Any], events: list[SSEEvent]) -> None:
        events += self._start(chunk)

    @property
    def upstream_finished(self) -> bool:
        """Whether the engine sent a finish reason (False when its stream ended early)."""
        return self._finish_reason is not None

    @property
    def done(self) -> bool:
        """Whether ``message_stop`` (or an ``error`` event) has been emitted."""
        return self._done

    @property
    def started(self) -> bool:
        """Whether ``message_start`` has been emitted."""
        return self._started

    # ---- block bookkeeping

    def _start(self, chunk: dict[str, Any] | None) -> list[SSEEvent]:
        if self._started:
            return []
        self._started = True
        if self.message_id is None:
            self.message_id = _message_id(chunk.get("id") if chunk else None)
        usage = chunk.get("usage") if chunk else None
        if isinstance(usage, dict):
            self._usage = usage
        start_usage = self._usage
        if start_usage is None and self.prompt_tokens is not None:
            # Anthropic's message_start carries the input count, and harnesses show it as the
            # context size while the answer streams; vLLM's usage comes only with the last chunk.
            start_usage = {"prompt_tokens": self.prompt_tokens}
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(start_usage) | {"output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[SSEEvent]:
        if self._open is None:
            return []
        index, self._open, self._text_open = self._open, None, False
        events: list[SSEEvent] = []
        thought, self._thought = self._thought, None
        if thought is not None:
            # Anthropic sends a thinking block's signature as its last delta; this one carries
            # the whole text, known only now.
            delta = {"type": "signature_delta", "signature": signature("".join(thought))}
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        tool, self._open_tool = self._open_tool, None
        if tool is not None:
            self._stopped_tools.add(tool.key)
            self.tool_closed = True
            text = tool.arguments
            if text:
                parsed = _parse_arguments(text)
                # The engine's own text when it is an object, so the harness gets it byte for byte.
                events.append(self._json_delta(index, text if parsed.get(RAW_ARGUMENTS_KEY) != text
                                               else _dumps(parsed)))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    def _open_block(self, block: dict[str, Any]) -> list[SSEEvent]:
        events = self._close()
        index = self._next_index
        self._next_index += 1
        self._open = index
        start = {"type": "content_block_start", "index": index, "content_block": block}
        events.append(("content_block_start", start))
        return events

    def _on_text(self, text: str, events: list[SSEEvent]) -> None:
        shown = self._between_calls(text, self._text_open)
        if shown is None:
            return
        if not self._text_open:
            events += self._open_block({"type": "text", "text": ""})
            self._text_open = True
        assert self._open is not None
        delta = {"type": "text_delta", "text": shown}
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta})
        )

    def _on_reasoning(self, text: str, events: list[SSEEvent]) -> None:
        if not self.thinking:
            return
        if self._thought is None:
            events += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
            self._thought = []
        assert self._open is not None
        self._thought.append(text)
        if self.thinking == "summarized":
            delta = {"type": "thinking_delta", "thinking": text}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": self._open, "delta": delta})
            )

    @staticmethod
    def _json_delta(index: int, partial: str) -> SSEEvent:
        delta = {"type": "input_json_delta", "partial_json": partial}
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def _start_tool(self, tool: ToolCall) -> list[SSEEvent]:
        call_id = tool.call_id or f"toolu_{self.message_id}_{tool.key}"
        block = {"type": "tool_use", "id": call_id, "name": tool.name or "", "input": {}}
        events = self._open_block(block)
        self._started_tools.add(tool.key)
        self._open_tool = tool
        self._has_tool_use = True
        return events

    def _on_tool_call(self, call: ToolCall, fragment: str, new: bool, events: list[SSEEvent]) -> None:
        key = call.key
        if new:
            # A new tool call ends whatever block is open, even if its own block must wait for a name.
            events += self._close()
        if key not in self._stopped_tools:
            if key not in self._started_tools and call.name is not None:
                events += self._start_tool(call)
        elif fragment:
            # Fragments for a call whose block already stopped (engines do not interleave calls,
            # but should one): its arguments went out whole when it stopped, and text appended
            # to them would not be JSON. The engine's tokens are captured all the same.
            logger.warning("dropped arguments for tool call %d after its block ended", key)

    def _flush_pending_tools(self) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        for tool in self._tool_calls.values():
            if tool.key not in self._started_tools:
                events += self._start_tool(tool)
        return events

    def _end(self) -> list[SSEEvent]:
        events = self._flush_pending_tools() + self._close()
        stop_reason, stop_sequence = _stop_reason(self._finish_reason, self._engine_stop, self._has_tool_use,
                                                  _context_full(self._usage, self.max_tokens, self.context))
        usage = _usage(self._usage)
        delta_usage: dict[str, Any] = {"output_tokens": usage["output_tokens"]}
        if self._usage is not None:
            # Cumulative totals; SDKs overwrite message_start's counts with them.
            delta_usage |= {k: v for k, v in usage.items() if k != "output_tokens"}
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": delta_usage,
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        self._done = True
        return events

    # ---- public

    def feed(self, chunk: dict[str, Any]) -> list[SSEEvent]:
        """Translate one parsed chat-completion chunk.

        Args:
            chunk: One ``data:`` object of the engine's stream (``chat.completion.chunk``, or an
                ``error`` object the engine sends when generation fails mid-stream).

        Returns:
            The Anthropic events this chunk produces, in order (possibly none). An engine error
            becomes an ``error`` event that ends the stream; later calls return nothing.
        """
        if self._done:
            return []
        error = chunk.get("error")
        if error is not None or chunk.get("object") == "error":
            detail = error.get("message") if isinstance(error, dict) else (error or chunk.get("message"))
            self._done = True
            return [error_event(str(detail or "the engine failed while streaming"))]
        events = self._start(chunk)
        self._read(chunk, events)  # what it cannot read it passes over (see _malformed)
        return events

    def _malformed(self, what: str) -> None:
        """Passed over: a Messages stream goes on with what it can read."""

    def _on_finish(self, choice: dict[str, Any], events: list[SSEEvent]) -> None:
        self._engine_stop = choice.get("stop_reason")
        events += self._flush_pending_tools() + self._close()

    def _on_last_chunk(self, events: list[SSEEvent]) -> None:
        events += self._end()

    def finish(self) -> list[SSEEvent]:
        """Close the stream: open blocks, then ``message_delta`` and ``message_stop``, exactly once.

        When the engine's stream ended without a finish reason, ``stop_reason`` is null: the answer
        did not end normally and no reason would be true. :attr:`upstream_finished` tells a caller
        that prefers to send :func:`error_event` instead.

        Returns:
            The closing events (none if the stream was already closed).
        """
        if self._done:
            return []
        return [*self._start(None), *self._end()]
