"""Continuation mode through the proxy, against the real engine, with the OpenAI SDK as the harness.

A three-turn tool conversation: in continuation mode (the default where the engine offers the
token-in/token-out endpoints) the second and third prompts begin with exactly the earlier prompt and
sampled ids, the ``<tool_call>`` the model spelled in BPE pieces included, so the assembler makes
one sample of the rollout whose loss mask is exactly the sampled ids. The same conversation in chat
mode breaks at every turn. A proxy restarted mid-rollout has no history and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from proxy_helpers import RunningProxy, calls_of, serve, shutdown

from consumers.assembler.samples import build_samples
from proxy.settings import ProxySettings
from schemas import DriftReason, ModelCallV1
from schemas.call.v1 import ApiProtocol, CallStatus
from stream import TopicRegistry

pytestmark = pytest.mark.kafka

TOOL_CALL_ID = 4092  # the tiny model's added token for "<tool_call>", the template's spelling

# Strict arguments with an enum and one call per turn: the random model then finishes a tool call
# within max_tokens (scripts/vllm/README.md, "Tools").
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}]

SEEDS = (12, 2, 3)
RESULTS = ("sunny", "rain")


async def _ask(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], seed: int, *,
               stream: bool) -> dict[str, Any]:
    """One call as a harness makes it; the assistant message as it will send it back."""
    request: dict[str, Any] = {"model": "policy", "messages": messages, "tools": TOOLS, "tool_choice": "required",
                               "parallel_tool_calls": False, "max_tokens": 128, "seed": seed}
    calls: dict[int, dict[str, Any]] = {}
    if not stream:
        answer = await client.chat.completions.create(**request)
        message = answer.choices[0].message
        for i, call in enumerate(message.tool_calls or []):
            calls[i] = {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        content = message.content
    else:
        content = ""
        async for chunk in await client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] = delta.id or slot["id"]
                    if delta.function is not None:
                        slot["name"] += delta.function.name or ""
                        slot["arguments"] += delta.function.arguments or ""
    assert calls, f"no tool call in the answer: {content!r}"
    # The SDK user re-serialises the arguments it parsed, as harnesses do.
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": orjson.dumps(orjson.loads(c["arguments"])).decode()}}
        for c in calls.values()]}


async def _conversation(proxy: RunningProxy, rollout_id: str, *, stream: bool, turns: int = 3,
                        messages: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Up to three turns of the weather conversation; the messages so far."""
    messages = messages or [{"role": "user", "content": "What is the weather in Paris?"}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.base(rollout_id)}/v1", api_key=proxy.token(rollout_id),
                                  max_retries=0) as client:
        for turn in range(turns):
            done = sum(m["role"] == "assistant" for m in messages)
            message = await _ask(client, messages, SEEDS[done], stream=stream)
            messages.append(message)
            if turn < turns - 1:
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                 "content": RESULTS[done]})
    return messages


def _extends(call: ModelCallV1, earlier: ModelCallV1) -> bool:
    before = [*earlier.prompt_token_ids, *earlier.choices[0].completion_token_ids]
    return list(call.prompt_token_ids[:len(before)]) == before


async def _conversation_calls(settings: ProxySettings, topics: TopicRegistry, rollout_id: str, *,
                              stream: bool) -> list[ModelCallV1]:
    """The three calls of one tool conversation through a proxy of its own, as the proxy recorded them."""
    server, task = await serve(settings)
    try:
        running = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
        await _conversation(running, rollout_id, stream=stream)
        return await calls_of(running, 3)
    finally:
        await shutdown(server, task)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tool_conversation_extends_the_exact_ids_and_makes_one_sample(
        proxy_settings_factory: Callable[..., ProxySettings], topics: TopicRegistry, stream: bool) -> None:
    settings = proxy_settings_factory()
    assert settings.continuation  # the default
    first, second, third = await _conversation_calls(settings, topics, "r-cont", stream=stream)

    assert all(c.status is CallStatus.OK and c.protocol is ApiProtocol.OPENAI_CHAT for c in (first, second, third))
    assert [c.drift_reason for c in (first, second, third)] == [None, None, None]
    assert [c.streamed for c in (first, second, third)] == [stream] * 3
    assert TOOL_CALL_ID not in first.choices[0].completion_token_ids  # "<tool_call>" sampled as BPE pieces
    assert _extends(second, first) and _extends(third, second)
    for call in (first, second, third):
        [span] = call.choices[0].weight_versions  # the engine's own span, not the proxy's guess
        assert (span.start, span.end) == (0, len(call.choices[0].completion_token_ids))

    built = build_samples([first, second, third])
    [sample] = built.samples
    assert built.stats.breaks == 0 and sample.call_ids == [first.call_id, second.call_id, third.call_id]
    assert list(sample.prompt_ids) == list(first.prompt_token_ids)
    sampled = [list(c.choices[0].completion_token_ids) for c in (first, second, third)]
    expected_mask: list[int] = []
    for call, ids, following in zip((first, second, third), sampled, (second, third, None), strict=True):
        expected_mask += [1] * len(ids)
        if following is not None:  # the bridge and the new messages: not the model's
            expected_mask += [0] * (len(following.prompt_token_ids) - len(call.prompt_token_ids) - len(ids))
    assert list(sample.loss_mask) == expected_mask
    assert [i for i, m in zip(sample.completion_ids, sample.loss_mask, strict=True) if m] == [i for ids in sampled for i in ids]


async def test_the_same_conversation_in_chat_mode_breaks_at_every_turn(
        proxy_settings_factory: Callable[..., ProxySettings], topics: TopicRegistry) -> None:
    settings = proxy_settings_factory(continuation=False)
    first, second, third = await _conversation_calls(settings, topics, "r-chat-mode", stream=False)
    assert not _extends(second, first) and not _extends(third, second)
    assert TOOL_CALL_ID in second.prompt_token_ids[len(first.prompt_token_ids):]  # the template's spelling
    built = build_samples([first, second, third])
    assert len(built.samples) == 3 and built.stats.breaks == 2


async def test_a_restarted_proxy_falls_back_with_state_lost_and_continues_after(
        proxy_settings_factory: Callable[..., ProxySettings], topics: TopicRegistry) -> None:
    settings = proxy_settings_factory()
    server, task = await serve(settings)
    try:
        running = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
        messages = await _conversation(running, "r-restart", stream=False, turns=1)
    finally:
        await shutdown(server, task)
    messages.append({"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"], "content": RESULTS[0]})
    server, task = await serve(settings)  # the same proxy again: its journal, not its memory
    try:
        await _conversation(running, "r-restart", stream=False, turns=2, messages=messages)
        first, second, third = await calls_of(running, 3)
    finally:
        await shutdown(server, task)
    assert [c.drift_reason for c in (first, second, third)] == [None, DriftReason.STATE_LOST, None]
    assert [c.status for c in (first, second, third)] == [CallStatus.OK] * 3
    assert _extends(third, second)



FOLLOW_UPS = ("Tell me more.", "And then?")


async def _anthropic_turns(proxy: RunningProxy, rollout_id: str, *, stream: bool) -> None:
    import anthropic

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
    async with anthropic.AsyncAnthropic(base_url=proxy.base(rollout_id), api_key=proxy.token(rollout_id),
                                        max_retries=0) as client:
        for follow_up in (*FOLLOW_UPS, None):
            request: dict[str, Any] = {"model": "claude-opus-4-7", "max_tokens": 24, "messages": messages}
            if stream:
                async with client.messages.stream(**request) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(**request)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})


async def _responses_turns(proxy: RunningProxy, rollout_id: str, *, stream: bool) -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.base(rollout_id)}/v1", api_key=proxy.token(rollout_id),
                                  max_retries=0) as client:
        for follow_up in (*FOLLOW_UPS, None):
            request: dict[str, Any] = {"model": "gpt-5-codex", "input": items, "max_output_tokens": 24}
            if stream:
                events = [event async for event in await client.responses.create(**request, stream=True)]
                response = events[-1].response  # "response.incomplete" when it ran out of tokens
            else:
                response = await client.responses.create(**request)
            items.extend(item.model_dump(exclude_none=True) for item in response.output)
            if follow_up is not None:
                items.append({"role": "user", "content": follow_up})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["anthropic", "responses"])
async def test_translated_apis_continue_through_the_same_step(
        proxy: RunningProxy, api: str, stream: bool) -> None:
    rollout_id = f"r-{api}-{stream}"
    await (_anthropic_turns if api == "anthropic" else _responses_turns)(proxy, rollout_id, stream=stream)
    first, second, third = await calls_of(proxy, 3)
    assert [c.status for c in (first, second, third)] == [CallStatus.OK] * 3
    assert [c.drift_reason for c in (first, second, third)] == [None, None, None]
    assert _extends(second, first) and _extends(third, second)
    assert len(build_samples([first, second, third]).samples) == 1
