"""An engine that aborts an answer part-way (vLLM's ``finish_reason: "abort"``, as when a replica
is paused in its default mode): harnesses of the translated APIs get an error they retry, chat
completions get the answer as the engine sent it, and every such call is recorded as an engine
error with what was sampled.

The engine is the scripted one (:mod:`scripted_engine`) because it can cut an answer at a chosen
point; real vLLM does the same only when a pause lands mid-answer (the vLLM test of the proxy
covers an answer aborted before its first token). Every other part is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from netutil import free_port
from proxy_helpers import proxy_in_front_of, read_events
from scripted_engine import Fault, ScriptedEngine

from proxy.service import ABORTED, ENGINE_ABORTED, ENGINE_UNFINISHED, UNFINISHED
from schemas.call.v1 import CallStatus
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
]


async def _ask_all(engine: ScriptedEngine, kafka: KafkaSettings, topics: TopicRegistry, tmp_path: Path, *,
                   streamed: bool) -> list[httpx.Response]:
    """Each request of :data:`REQUESTS` once, in order, through a proxy in front of ``engine``."""
    async with engine.running(free_port()) as engine_url, \
            proxy_in_front_of(engine_url, kafka, topics, tmp_path) as proxy, \
            httpx.AsyncClient(timeout=30) as client:
        headers = {"authorization": f"Bearer {proxy.token('r-cut')}"}
        return [await client.post(f"{proxy.base('r-cut')}{path}", json={**body, "stream": streamed},
                                  headers=headers) for path, body in REQUESTS]


def _events(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[5:]) for line in body.splitlines()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_an_answer_aborted_part_way_is_retried_by_translated_harnesses_and_recorded(
        streamed: bool, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    engine = ScriptedEngine(command="true", chunk_pieces=1,
                            faults=[Fault(match=lambda _b: True, abort_after=2, times=len(REQUESTS))])
    answers = await _ask_all(engine, kafka_settings, topics, tmp_path, streamed=streamed)
    chat, anthropic, responses = answers
    if streamed:
        assert [a.status_code for a in answers] == [200] * 3  # the stream had started
        finishes = [c["choices"][0]["finish_reason"] for c in _events(chat.content) if c["choices"]]
        assert finishes[-1] == "abort" and chat.content.endswith(b"data: [DONE]\n\n")
        anthropic_events = _events(anthropic.content)
        assert anthropic_events[-1] == {"type": "error", "error": {"type": "api_error", "message": ABORTED}}
        assert "message_delta" not in {e["type"] for e in anthropic_events}
        last = _events(responses.content)[-1]
        assert last["type"] == "response.failed" and last["response"]["error"]["message"] == ABORTED
    else:
        assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "abort"
        assert [anthropic.status_code, responses.status_code] == [502, 502]
        assert anthropic.json()["error"] == {"type": "api_error", "message": ABORTED}
        assert ABORTED in responses.text
    events = await read_events(kafka_settings, topics, CALLS, expect=len(REQUESTS))
    assert [f.fired for f in engine.faults] == [len(REQUESTS)]
    for event, seen in zip(sorted(events, key=lambda e: e.timings.started_at), engine.seen, strict=True):
        assert seen.kind == "aborted" and len(seen.completion_token_ids) > 0
        assert event.status is CallStatus.UPSTREAM_ERROR and event.streamed is streamed
        assert event.error_message == (ENGINE_ABORTED if event.protocol.value == "openai_chat" else ABORTED)
        [choice] = event.choices
        assert choice.finish_reason == "abort"
        assert list(choice.completion_token_ids) == seen.completion_token_ids  # what was sampled is kept
        assert list(choice.logprobs) == seen.logprobs


async def test_a_stream_with_tokens_that_ends_without_a_finish_reason_goes_on_as_it_came(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """Only a stream with no token and no finish reason is vLLM's aborted answer. One with tokens
    comes from an engine that dropped its last chunk: refusing it would fail the same call on
    every retry, so chat and Anthropic harnesses get what was sampled, closed normally, and the
    call is kept. A Responses harness gets ``response.failed`` rather than a tool call that may be
    cut short (see the Responses translator's ``finish``): that call is recorded as failed, so its
    retry is linked to it."""
    engine = ScriptedEngine(command="true", chunk_pieces=1,
                            faults=[Fault(match=lambda _b: True, drop_after=2, done=True, times=len(REQUESTS))])
    answers = await _ask_all(engine, kafka_settings, topics, tmp_path, streamed=True)
    chat, anthropic, responses = answers
    assert [a.status_code for a in answers] == [200] * 3
    assert chat.content.endswith(b"data: [DONE]\n\n")
    assert [e["type"] for e in _events(anthropic.content)][-2:] == ["message_delta", "message_stop"]
    assert "error" not in {e["type"] for e in _events(anthropic.content)}
    assert _events(responses.content)[-1]["type"] == "response.failed"
    events = await read_events(kafka_settings, topics, CALLS, expect=len(REQUESTS))
    ordered = sorted(events, key=lambda e: e.timings.started_at)
    for event, seen in zip(ordered, engine.seen, strict=True):
        assert seen.kind == "dropped" and len(seen.completion_token_ids) > 0
        assert [list(c.completion_token_ids) for c in event.choices] == [seen.completion_token_ids]
        assert event.error_message not in {ENGINE_UNFINISHED, UNFINISHED}
    assert [e.status for e in ordered] == [CallStatus.OK, CallStatus.OK, CallStatus.UPSTREAM_ERROR]
