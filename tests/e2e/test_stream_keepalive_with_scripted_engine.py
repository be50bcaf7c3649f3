"""A model that thinks before it answers: the harness hears from the proxy all the while.

The engine's reasoning reaches a harness in its API's own place (a thinking block, a reasoning
item) as it streams. An Anthropic harness that did not turn thinking on gets no thinking
block, so a long think used to send it nothing at all, and harnesses abort a silent stream
(Claude Code and Codex after five minutes) and send the call again; it gets Anthropic's pings.
The engine is the scripted one (:mod:`scripted_engine`), because it can think for a set time;
every other part is real, and the official SDKs read the streams.
"""

from __future__ import annotations

import time
from pathlib import Path

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
            """Each event's name and when it arrived."""
            body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "hi"}],
                    **extra}
            async with httpx.AsyncClient(timeout=30) as client, \
                    client.stream("POST", f"{proxy.base('r-think')}/v1/messages", json=body,
                                  headers={"x-api-key": token}) as raw:
                return [(line[6:].strip(), time.monotonic()) async for line in raw.aiter_lines()
                        if line.startswith("event:")]

        def pinged_until(kinds: list[tuple[str, float]], until: str) -> None:
            """Two seconds of thinking: pings at most 0.4 s apart while it lasted, none after ``until``."""
            assert kinds[0][0] == "message_start" and kinds[-1][0] == "message_stop"
            pings = [at for kind, at in kinds if kind == "ping"]
            end = next(at for kind, at in kinds if kind == until)
            assert len(pings) >= 3 and all(at < end for at in pings), kinds
            gaps = [b - a for a, b in zip([kinds[0][1], *pings], [*pings, end], strict=True)]
            assert max(gaps) < KEEPALIVE_S + THINKING[1] + 0.3, gaps

        pinged_until(await raw_events(), "content_block_start")  # thinking off: nothing of it is sent
        # Thinking on but its text omitted (as Claude Code asks): the block opens, and only its
        # signature comes when the thinking ends; pings fill the silence in between.
        omitted = await raw_events(thinking={"type": "adaptive", "display": "omitted"})
        assert [kind for kind, _ in omitted if kind != "ping"][:3] == [
            "message_start", "content_block_start", "content_block_delta"], omitted
        pinged_until(omitted, "content_block_delta")
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
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"] and types[-1] == "response.completed", types
        assert types.count("response.reasoning_text.delta") == THINKING[0] and "response.in_progress" not in types[2:]
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
