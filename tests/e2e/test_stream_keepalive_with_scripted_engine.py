"""A model that thinks before it answers, or an engine that goes silent: the harness hears from the proxy all the while.

The engine's reasoning reaches a harness in its API's own place (a thinking block, a reasoning
item) as it streams. An Anthropic harness that did not turn thinking on gets no thinking
block, so a long think used to send it nothing at all, and harnesses abort a silent stream
(Claude Code and Codex after five minutes) and send the call again. Claude Code's watchdog sees
only the events its SDK passes on, and the SDKs drop Anthropic's ``ping``: inside an open block
the keep-alive is an empty delta of that block. An engine that sends nothing (a request in its
queue, a pause for new weights) gets the same, as does the time before its first token.
The engine is the scripted one (:mod:`scripted_engine`), because it can think or stall for a set
time; every other part is real, and the official SDKs read the streams.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from netutil import free_port
from proxy_helpers import proxy_in_front_of, read_events
from scripted_engine import THOUGHT, ScriptedEngine, tokenize

from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

THINKING = (8, 0.25)  # eight chunks of reasoning, a quarter of a second apart: two seconds of silence
KEEPALIVE_S = 0.4


async def test_a_long_think_reaches_the_harness_as_thinking_or_as_keepalives_and_the_answer_is_unchanged(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    engine = ScriptedEngine(command="true", reasoning=THINKING)
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path, stream_keepalive_s=KEEPALIVE_S) as proxy:
        token = proxy.token("r-think")
        # The SDKs skip Anthropic's pings, so the stream is read raw first, as a harness's socket sees it.
        async def raw_events(**extra: object) -> list[tuple[str, float]]:
            """Each event's name and when it arrived; an empty delta (a keep-alive) is named ``empty``."""
            return [("empty" if _empty_delta(data) else kind, at)
                    for kind, data, at in await _raw_anthropic(proxy.base("r-think"), token, **extra)]

        def pinged_until(kinds: list[tuple[str, float]], until: str, keepalive: str = "ping") -> None:
            """Two seconds of thinking: keep-alives at most 0.4 s apart while it lasted, none after ``until``."""
            assert kinds[0][0] == "message_start" and kinds[-1][0] == "message_stop"
            pings = [at for kind, at in kinds if kind == keepalive]
            end = next(at for kind, at in kinds if kind == until)
            assert len(pings) >= 3 and all(at < end for at in pings), kinds
            gaps = [b - a for a, b in zip([kinds[0][1], *pings], [*pings, end], strict=True)]
            assert max(gaps) < KEEPALIVE_S + THINKING[1] + 0.3, gaps

        # Thinking off: nothing of it is sent, and no block is open to carry a keep-alive (pings).
        pinged_until(await raw_events(), "content_block_start")
        # Thinking on but its text omitted (as Claude Code asks): the block opens, and only its
        # signature comes when the thinking ends; empty thinking deltas fill the silence between.
        omitted = await raw_events(thinking={"type": "adaptive", "display": "omitted"})
        assert [kind for kind, _ in omitted if kind != "empty"][:3] == [
            "message_start", "content_block_start", "content_block_delta"], omitted
        assert "ping" not in [kind for kind, _ in omitted]
        pinged_until(omitted, "content_block_delta", keepalive="empty")
        # And the SDK reads the same stream into the answer the engine gave.
        async with anthropic.AsyncAnthropic(base_url=proxy.base("r-think"), api_key=token, max_retries=0) as claude, \
                claude.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
            message = await stream.get_final_message()
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == "OpenForge scripted engine reply." and message.stop_reason == "end_turn"
        # Asked for, the thinking streams as a thinking block (no pings needed), signed by the proxy.
        async with anthropic.AsyncAnthropic(base_url=proxy.base("r-think"), api_key=token, max_retries=0) as claude, \
                claude.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                       thinking={"type": "enabled", "budget_tokens": 32}) as stream:
            kinds_seen = [event.type async for event in stream]
            message = await stream.get_final_message()
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking = message.content[0]
        assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == THOUGHT * THINKING[0]
        assert thinking.signature.startswith("openforge-1.") and kinds_seen.count("thinking") == THINKING[0]

        openai_client = openai.AsyncOpenAI(base_url=f"{proxy.base('r-think')}/v1", api_key=token, max_retries=0)
        types: list[str] = []
        numbers: list[int] = []
        async with openai_client, openai_client.responses.stream(model="m", input="hi") as events:
            async for event in events:
                types.append(event.type)
                numbers.append(event.sequence_number)
            response = await events.get_final_response()
        assert response.status == "completed" and response.output_text == "OpenForge scripted engine reply."
        assert numbers == list(range(len(numbers)))  # no gap, no repeat
        # The thinking streams as a reasoning item, delta by delta: the harness is never left silent.
        # (A machine slow enough to hold a chunk past the keep-alive interval adds a keep-alive,
        # response.in_progress, between them: harmless, and left out of the order checked here.)
        said = [t for t in types[2:] if t != "response.in_progress"]
        assert types[:2] == ["response.created", "response.in_progress"], types
        assert said[:2] == ["response.output_item.added", "response.content_part.added"], types
        assert said[-1] == "response.completed" and said.count("response.reasoning_text.delta") == THINKING[0], types
        reasoning = response.output[0]
        assert reasoning.type == "reasoning" and [part.text for part in reasoning.content or []] == [THOUGHT * THINKING[0]]

        async with openai.AsyncOpenAI(base_url=f"{proxy.base('r-think')}/v1", api_key=token, max_retries=0) as chat:
            chunks = [chunk async for chunk in await chat.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True)]
        thought = [c for c in chunks if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning")]
        assert len(thought) == THINKING[0]  # chat completions pass the reasoning on as the engine sent it

    # Capture is token-exact whatever the harness saw: the reasoning's tokens are the answer's first.
    events = sorted(await read_events(kafka_settings, topics, CALLS, expect=6), key=lambda e: e.timings.started_at)
    for event, seen in zip(events, engine.seen, strict=True):
        ids = list(event.choices[0].completion_token_ids)
        assert ids == seen.completion_token_ids and ids[:len(tokenize(THOUGHT))] == tokenize(THOUGHT)


def _empty_delta(data: dict[str, Any]) -> bool:
    delta = data.get("delta") if data.get("type") == "content_block_delta" else None
    return isinstance(delta, dict) and "" in (delta.get("text"), delta.get("thinking"), delta.get("partial_json"))


async def _raw_anthropic(base: str, token: str, **extra: object) -> list[tuple[str, dict[str, Any], float]]:
    """A streamed Messages call read raw, as a harness's socket sees it: each event, its data, when it came."""
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}], **extra}
    events: list[tuple[str, dict[str, Any], float]] = []
    kind = ""
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream("POST", f"{base}/v1/messages", json=body, headers={"x-api-key": token}) as raw:
        async for line in raw.aiter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line[5:]), time.monotonic()))
    return events


QUEUE_S = STALL_S = 1.5


async def test_an_engine_silent_before_its_first_token_or_mid_answer_keeps_the_harness_hearing(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    # The engine sends its headers, then nothing for 1.5 s (a queue, a prefill), then the first
    # chunk; after its second chunk (inside a tool call's arguments) nothing for 1.5 s again (a
    # pause for new weights). Before, the proxy sent nothing while the engine sent nothing.
    engine = ScriptedEngine(command="ls", queue_s=QUEUE_S, stall_s=STALL_S)
    tools = [{"name": "Bash", "description": "Run a command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka_settings, topics, tmp_path, stream_keepalive_s=KEEPALIVE_S) as proxy:
        token = proxy.token("r-silent")
        began = time.monotonic()
        events = await _raw_anthropic(proxy.base("r-silent"), token, tools=tools)
        kinds = [kind for kind, _, _ in events]
        # message_start comes while the engine is still silent, as Anthropic sends it at once.
        assert kinds[0] == "message_start" and events[0][2] - began < QUEUE_S, (events[0][2] - began, kinds)
        tool_block = next(data["index"] for kind, data, _ in events
                          if kind == "content_block_start" and data["content_block"]["type"] == "tool_use")
        held = [at for kind, data, at in events if kind == "content_block_delta" and data["index"] == tool_block
                and data["delta"] == {"type": "input_json_delta", "partial_json": ""}]
        assert len(held) >= 2, kinds  # the stall inside the arguments is filled with empty deltas
        times = [at for _, _, at in events]
        assert max(b - a for a, b in itertools.pairwise([began, *times])) < 2 * KEEPALIVE_S + 0.5, kinds
        # The SDK reads the same stream into the call the engine made.
        async with anthropic.AsyncAnthropic(base_url=proxy.base("r-silent"), api_key=token, max_retries=0) as claude, \
                claude.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                       tools=tools) as stream:  # type: ignore[arg-type]
            message = await stream.get_final_message()
        [call] = [block for block in message.content if block.type == "tool_use"]
        assert call.input == {"command": "ls"} and message.stop_reason == "tool_use"

        # Responses: the response opens while the engine is silent, and in_progress fills the stall.
        openai_client = openai.AsyncOpenAI(base_url=f"{proxy.base('r-silent')}/v1", api_key=token, max_retries=0)
        seen: list[tuple[str, float]] = []
        began = time.monotonic()
        async with openai_client, openai_client.responses.stream(
                model="m", input="hi", tools=[{"type": "function", "name": "shell", "parameters": {
                    "type": "object", "properties": {"command": {"type": "string"}}}}]) as stream:  # type: ignore[list-item]
            seen = [(event.type, time.monotonic()) async for event in stream]
            response = await stream.get_final_response()
        assert seen[0][0] == "response.created" and seen[0][1] - began < QUEUE_S, seen
        assert [kind for kind, _ in seen].count("response.in_progress") >= 3, seen
        assert response.status == "completed" and response.output[-1].type == "function_call"
    assert len(engine.seen) == 3  # raw, through the SDK, and Responses: no call sent again
