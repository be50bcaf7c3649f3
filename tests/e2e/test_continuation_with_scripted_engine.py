"""The scripted engine's token-in/token-out endpoints, through the real proxy in continuation mode.

The harness tests (``test_harness_report_with_scripted_engine``) drive these endpoints with real CLIs,
which all stream. Here the OpenAI SDK plays the harness, whole and streamed, on the script's tool
conversation, so both generate paths are checked: the proxy probes the engine, serves every call by
render, generate and derender, and each later prompt begins with exactly the earlier prompt and
sampled ids (the tool call the model sampled as word pieces, where the template writes one id).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import openai
import pytest
from netutil import free_port
from proxy_helpers import calls_of, proxy_in_front_of
from scripted_engine import ADDED, TOOL_OPEN, WEIGHT_VERSION, ScriptedEngine

from schemas.call.v1 import CallStatus
from stream import KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

TOOL_CALLS = 3
TOOLS = [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


async def _ask(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
    """One call; the assistant message as a harness sends it back."""
    request: dict[str, Any] = {"model": "policy", "messages": messages, "tools": TOOLS}
    if not stream:
        message = (await client.chat.completions.create(**request)).choices[0].message
        return message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
    content, calls = "", {}
    async for chunk in await client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                slot = calls.setdefault(delta.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = delta.id or slot["id"]
                if delta.function is not None:
                    slot["function"]["name"] += delta.function.name or ""
                    slot["function"]["arguments"] += delta.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = list(calls.values())
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_each_turn_extends_the_exact_ids_of_the_one_before(
        stream: bool, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    engine = ScriptedEngine(command="echo hi", exact_turns=True, token_endpoints=True, tool_turns=TOOL_CALLS)
    rollout_id = "continued"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run it three times, then tell me."}]
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path) as proxy:
        async with openai.AsyncOpenAI(base_url=f"{proxy.base(rollout_id)}/v1", api_key=proxy.token(rollout_id),
                                      max_retries=0) as client:
            for turn in range(TOOL_CALLS + 1):
                message = await _ask(client, messages, stream=stream)
                messages.append(message)
                if turn < TOOL_CALLS:
                    assert [c["function"]["name"] for c in message["tool_calls"]] == ["Bash"], message
                    messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                     "content": f"hi {turn}"})
        calls = await calls_of(proxy, expect=TOOL_CALLS + 1)
    assert messages[-1]["content"] == f"Done. The command printed: hi {TOOL_CALLS - 1}"
    assert [(s.endpoint, s.streamed) for s in engine.seen] == [("generate", stream)] * (TOOL_CALLS + 1)
    for seen, call in zip(engine.seen, calls, strict=True):
        choice = call.choices[0]
        assert call.status is CallStatus.OK and call.drift_reason is None
        assert list(call.prompt_token_ids) == seen.prompt_token_ids
        assert list(choice.completion_token_ids) == seen.completion_token_ids
        assert [(v.version, v.start, v.end) for v in choice.weight_versions] == \
            [(WEIGHT_VERSION, 0, len(seen.completion_token_ids))]
    for earlier, later in itertools.pairwise(calls):
        before = [*earlier.prompt_token_ids, *earlier.choices[0].completion_token_ids]
        assert list(later.prompt_token_ids[:len(before)]) == before
    # The sampled tool calls are in the last prompt as pieces; the template's one-id tag never is.
    assert ADDED[TOOL_OPEN] not in calls[-1].prompt_token_ids
