"""An engine that answers 200 with something that is not a chat completion: the harness gets a
clear 502 in its own API's shape, and the call is still recorded, as an engine error.

The engine is the scripted one (:mod:`scripted_engine`) because real vLLM never sends such an
answer; every other part is real (the proxy on uvicorn, the broker).
"""

from __future__ import annotations

from pathlib import Path

import httpx
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
    async with engine.running(free_port()) as engine_url:
        settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                                 spool_dir=tmp_path / "spool", kafka=kafka_settings, publish_timeout_s=5.0)
        server, task = await serve(settings)
        try:
            token = mint_token(KEY, "r-broken", Role.AGENT, 600)
            async with httpx.AsyncClient(timeout=30) as client:
                answers = [await client.post(f"http://127.0.0.1:{settings.port}/rollouts/r-broken{path}",
                                             json=body, headers={"authorization": f"Bearer {token}"})
                           for _ in BROKEN]
        finally:
            await shutdown(server, task)
    for answer in answers:
        assert answer.status_code == 502, answer.text
        assert "engine answer not understood" in answer.text
    events = await read_events(kafka_settings, topics, CALLS, expect=len(BROKEN))
    assert [e.status for e in events] == [CallStatus.UPSTREAM_ERROR] * len(BROKEN)
    assert all("engine answer not understood" in (e.error_message or "") and not e.choices for e in events)
    assert {e.upstream_status_code for e in events} == {200}  # what the engine said, not what the harness got
