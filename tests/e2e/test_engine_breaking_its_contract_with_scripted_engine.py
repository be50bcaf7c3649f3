"""An engine that answers 200 with something that is not a chat completion, or whose stream ends
in an error: the harness gets a clear error in its own API's shape, and the call is still
recorded, as an engine error.

The engine is the scripted one (:mod:`scripted_engine`) because real vLLM never sends such an
answer; every other part is real (the proxy on uvicorn, the broker).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest
from netutil import free_port
from proxy_helpers import KEY, read_events, serve, shutdown
from scripted_engine import Fault, ScriptedEngine

from proxy.settings import ProxySettings
from schemas.call.v1 import CallStatus
from schemas.credentials import Role, mint_token
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

BROKEN = [b'["not", "an", "object"]', b'{"choices": [7]}', b'{"choices": [{"message": "text, not an object"}]}',
          b'{"usage": "not an object", "choices": [7]}']


async def _calls_through_proxy(engine: ScriptedEngine, kafka: KafkaSettings, tmp_path: Path, path: str,
                              bodies: list[dict[str, object]]) -> list[httpx.Response]:
    """``bodies`` posted one after another to ``path`` of a proxy in front of ``engine``."""
    async with engine.running(free_port()) as engine_url:
        settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                                 spool_dir=tmp_path / "spool", kafka=kafka, publish_timeout_s=5.0)
        server, task = await serve(settings)
        try:
            token = mint_token(KEY, "r-broken", Role.AGENT, 600)
            async with httpx.AsyncClient(timeout=30) as client:
                return [await client.post(f"http://127.0.0.1:{settings.port}/rollouts/r-broken{path}", json=body,
                                          headers={"authorization": f"Bearer {token}"}) for body in bodies]
        finally:
            await shutdown(server, task)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
])
async def test_an_answer_that_is_not_a_chat_completion_is_a_502_and_still_recorded(
        path: str, body: dict[str, object], kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, status=200, body=broken, times=1)
                                                    for broken in BROKEN])
    answers = await _calls_through_proxy(engine, kafka_settings, tmp_path, path, [body] * len(BROKEN))
    for answer in answers:
        assert answer.status_code == 502, answer.text
        assert "engine answer not understood" in answer.text
    events = await read_events(kafka_settings, topics, CALLS, expect=len(BROKEN))
    assert [e.status for e in events] == [CallStatus.UPSTREAM_ERROR] * len(BROKEN)
    assert all("engine answer not understood" in (e.error_message or "") and not e.choices for e in events)
    assert {e.upstream_status_code for e in events} == {200}  # what the engine said, not what the harness got


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
])
async def test_a_stream_the_engine_ends_in_an_error_tells_the_harness_its_message(
        path: str, body: dict[str, object], kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    """vLLM ends a stream whose generation raised with ``data: {"error": {...}}`` and ``[DONE]``:
    the harness reads the engine's message in its protocol's error (not the error object's
    Python repr), and the call is recorded as an engine error with what was sampled."""
    message = "scripted engine: generation raised"
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, drop_after=2, error_chunk=True,
                                                          message=message)])
    [answer] = await _calls_through_proxy(engine, kafka_settings, tmp_path, path, [body])
    assert answer.status_code == 200
    last = [orjson.loads(line[5:]) for line in answer.content.splitlines()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"][-1]
    assert (last["response"] if path == "/v1/responses" else last)["error"]["message"] == message, answer.text
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.UPSTREAM_ERROR and message in (event.error_message or "")
    assert len(event.choices[0].completion_token_ids) > 0  # what was sampled before the error
