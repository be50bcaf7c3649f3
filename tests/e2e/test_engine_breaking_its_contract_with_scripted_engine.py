"""An engine that answers 200 with something that is not a chat completion, or whose stream ends
in an error or breaks: the harness gets a clear error in its own API's shape, and the call is
still recorded, as an engine error. Also the stream shapes real vLLM sends only rarely (a break
after the answer's end, two tool calls in one answer), which the proxy must neither fail nor relay
before their time.

The engine is the scripted one (:mod:`scripted_engine`) because real vLLM never sends such an
answer; every other part is real (the proxy on uvicorn, the broker).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from inloop_server import InLoopServer
from netutil import free_port
from proxy_helpers import KEY, read_events, serve, shutdown
from scripted_engine import Fault, ScriptedEngine

from proxy.app import build_app
from proxy.service import PROXY_STOPPED
from proxy.settings import ProxySettings
from schemas.call.v1 import CallStatus
from schemas.credentials import Role, mint_token
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

BROKEN = [b'["not", "an", "object"]', b'{"choices": [7]}', b'{"choices": [{"message": "text, not an object"}]}',
          b'{"usage": "not an object", "choices": [7]}']


async def _calls_through_proxy(engine: ScriptedEngine, kafka: KafkaSettings, tmp_path: Path, path: str,
                              bodies: list[dict[str, object]], **extra: Any) -> list[httpx.Response]:
    """``bodies`` posted one after another to ``path`` of a proxy in front of ``engine``."""
    async with engine.running(free_port()) as engine_url:
        settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                                 spool_dir=tmp_path / "spool", kafka=kafka, publish_timeout_s=5.0, **extra)
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


async def test_a_chat_call_hiding_its_reasoning_is_still_captured_token_exact_and_shows_none(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """vLLM withholds an answer's token ids and logprobs when its reasoning is hidden
    (``include_reasoning: false``): the engine is asked to include it, and the proxy takes it out."""
    engine = ScriptedEngine(command="true", reasoning=(2, 0.0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "include_reasoning": False}
    # Asking for the tokens too: before, each reasoning token's logprob entry spelled out the
    # hidden reasoning (vLLM shows none of an answer's tokens when it hides its reasoning).
    asking = {**body, "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "seed": 1}
    answers = await _calls_through_proxy(engine, kafka_settings, tmp_path, "/v1/chat/completions", [body, asking])
    for answer in answers:
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        assert "reasoning" not in message and "reasoning_content" not in message
    assert answers[1].json()["choices"][0]["logprobs"] is None and answers[1].json()["choices"][0]["token_ids"] is None
    assert "logprobs" not in answers[0].json()["choices"][0]
    assert engine.seen[-1].body["include_reasoning"] is True
    events = await read_events(kafka_settings, topics, CALLS, expect=2)
    for event, seen in zip(events, engine.seen, strict=True):
        assert event.status is CallStatus.OK and event.request.extra["include_reasoning"] is False
        assert list(event.choices[0].completion_token_ids) == seen.completion_token_ids
        assert len(event.choices[0].logprobs) == len(seen.completion_token_ids)


async def test_top_logprobs_without_logprobs_is_refused_as_the_engine_would(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """The proxy turns logprobs on for capture and takes them out again: without this refusal the
    harness got a 200 and none of the logprobs it asked for."""
    engine = ScriptedEngine(command="true")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}
    [answer] = await _calls_through_proxy(engine, kafka_settings, tmp_path, "/v1/chat/completions", [body])
    assert answer.status_code == 400 and "logprobs must be set to true" in answer.text
    assert not engine.seen


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


def _chunk(choices: list[dict[str, object]], **extra: object) -> bytes:
    return orjson.dumps({"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": choices, **extra})


def _piece(text: str, token: int, *, index: int = 0, finish: str | None = None) -> dict[str, object]:
    return {"index": index, "delta": {"role": "assistant", "content": text} if text else {},
            "logprobs": {"content": [{"token": text, "logprob": -0.5, "bytes": None, "top_logprobs": []}]},
            "finish_reason": finish, "token_ids": [token]}


def _data(answer: httpx.Response) -> list[dict[str, object]]:
    return [orjson.loads(line[5:]) for line in answer.content.splitlines()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]


STREAMED = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMED)
async def test_a_stream_chunk_that_is_not_a_chat_completion_chunk_is_an_engine_error_the_harness_is_told(
        path: str, body: dict[str, object], kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    """JSON of the wrong shape mid-stream is the engine's fault, as broken JSON is: the harness
    gets its protocol's error event at the end of a well-formed stream, and the call is recorded
    as an engine error (before the fix: a cut connection, and the proxy's own fault)."""
    opening = _chunk([_piece("Hel", 11)], prompt_token_ids=[1, 2, 3])
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, stream=[opening, broken])
                                                    for broken in (b"null", b"[1, 2]", b'{"choices": [7]}')])
    answers = await _calls_through_proxy(engine, kafka_settings, tmp_path, path, [body] * 3)
    for answer in answers:
        assert answer.status_code == 200
        last = _data(answer)[-1]
        failure = last["response"]["error"] if path == "/v1/responses" else last["error"]  # type: ignore[index]
        assert "not a chat completion chunk" in failure["message"], answer.text  # type: ignore[index]
    events = await read_events(kafka_settings, topics, CALLS, expect=3)
    assert [e.status for e in events] == [CallStatus.UPSTREAM_ERROR] * 3
    assert all("not a chat completion chunk" in (e.error_message or "") for e in events)
    assert all(e.choices[0].completion_token_ids == [11] for e in events)  # what came before the break


@pytest.mark.parametrize(("path", "body"), STREAMED[1:])
async def test_a_translated_stream_whose_engine_breaks_after_its_usage_chunk_is_a_whole_answer(
        path: str, body: dict[str, object], kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    """Anthropic and Responses streams end on the engine's usage chunk; a stream that breaks
    after it (here a line that is not JSON, where ``[DONE]`` belongs) takes nothing from the
    harness, whose answer already ended: no error event after the end, and the call is recorded
    as the ok answer it was."""
    script: list[bytes | float] = [
        _chunk([_piece("Hello", 11)], prompt_token_ids=[1, 2, 3]), _chunk([_piece("", 12, finish="stop")]),
        _chunk([], usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}), b"not json"]
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, stream=script)])
    [answer] = await _calls_through_proxy(engine, kafka_settings, tmp_path, path, [body])
    assert answer.status_code == 200
    types = [d["type"] for d in _data(answer)]
    assert types[-1] == ("message_stop" if path == "/v1/messages" else "response.completed"), types
    assert "error" not in types and "response.failed" not in types
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.OK, event.error_message
    assert event.choices[0].completion_token_ids == [11, 12] and event.usage is not None


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_answer_the_engine_began_and_did_not_end_in_time_is_a_timeout(
        streamed: bool, kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """The engine's deadline covers the whole answer: one that stalls after its first bytes is a
    504 (a whole answer) or the stream's error event, and is recorded as a timeout, not as an
    engine that broke its contract."""
    script: list[bytes | float] = [_chunk([_piece("Hel", 11)], prompt_token_ids=[1, 2, 3]), 5.0, b"[DONE]"]
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, stream=script)])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": streamed}
    [answer] = await _calls_through_proxy(engine, kafka_settings, tmp_path, "/v1/chat/completions", [body],
                                          upstream_timeout_s=1.0)
    if streamed:
        assert answer.status_code == 200 and "timed out" in _data(answer)[-1]["error"]["message"]  # type: ignore[index]
    else:
        assert answer.status_code == 504, answer.text
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.UPSTREAM_TIMEOUT, (event.status, event.error_message)


async def test_a_whole_answer_still_waited_for_when_the_proxy_stops_is_recorded(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """A proxy told to stop waits for the answers in flight for its drain time, then cuts them:
    a whole answer cut so is still recorded (before the fix it left no event), as a stream is."""
    script: list[bytes | float] = [_chunk([_piece("Hel", 11)], prompt_token_ids=[1, 2, 3]), 30.0, b"[DONE]"]
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, stream=script)])
    async with engine.running(free_port()) as engine_url:
        settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                                 spool_dir=tmp_path / "spool", kafka=kafka_settings, drain_s=1)
        server = InLoopServer(uvicorn.Config(build_app(settings), host="127.0.0.1", port=settings.port,
                                             log_level="warning", lifespan="on",
                                             timeout_graceful_shutdown=settings.drain_s))
        serving = asyncio.create_task(server.serve())
        token = mint_token(KEY, "r-stop", Role.AGENT, 600)
        async with httpx.AsyncClient(timeout=60) as client:
            while not server.started:
                await asyncio.sleep(0.05)
            waiting = asyncio.create_task(client.post(
                f"http://127.0.0.1:{settings.port}/rollouts/r-stop/v1/chat/completions",
                headers={"authorization": f"Bearer {token}"},
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            while not engine.seen:  # the engine has the call
                await asyncio.sleep(0.05)
            server.should_exit = True
            await asyncio.wait_for(serving, 30)
            with contextlib.suppress(httpx.HTTPError):  # cut: the connection closed, or a bare 500
                assert (await waiting).status_code == 500
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.INTERNAL_ERROR and event.error_message == PROXY_STOPPED
    assert event.rollout_id == "r-stop"


async def test_a_whole_answers_tool_input_keeps_integers_past_64_bits(
        kafka_settings: KafkaSettings, topics: TopicRegistry, tmp_path: Path) -> None:
    """A model may write an integer past 64 bits into a tool call (an id, a hash as a number). The
    streamed Messages answer passes the arguments' text on as it is; the whole one parses them into
    ``input``, and orjson, which reads such an integer as a float and cannot write one back, made it
    another number (or, written back, a failure after the call was recorded)."""
    arguments = '{"id": 1234567890123456789012345678901, "small": 7, "ratio": 0.25, "name": "x"}'
    answer = {"id": "chatcmpl-big", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6, 7],
                           "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": None,
                                                     "top_logprobs": []}] * 3},
                           "message": {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "call_big", "type": "function",
                                "function": {"name": "Lookup", "arguments": arguments}}]}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}, "prompt_token_ids": [1, 2, 3]}
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, status=200,
                                                          body=orjson.dumps(answer))])
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "look it up"}],
            "tools": [{"name": "Lookup", "input_schema": {"type": "object"}}]}
    [reply] = await _calls_through_proxy(engine, kafka_settings, tmp_path, "/v1/messages", [body])
    assert reply.status_code == 200, reply.text
    [block] = reply.json()["content"]  # the standard decoder, as the anthropic SDK reads answers
    assert block["input"] == {"id": 1234567890123456789012345678901, "small": 7, "ratio": 0.25, "name": "x"}
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.OK and list(event.choices[0].completion_token_ids) == [5, 6, 7]


def _tool_piece(call: int, call_id: str, arguments: str, token: int) -> dict[str, object]:
    return {"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": call, "id": call_id, "type": "function", "function": {"name": "get", "arguments": arguments}}]},
        "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": None, "top_logprobs": []}]},
        "finish_reason": None, "token_ids": [token]}


def _journal_bytes(spool: Path) -> int:
    return sum(segment.stat().st_size for segment in (spool / "journal").glob("*.log"))


@pytest.mark.parametrize(("path", "body", "closes_first_call"), [
    ("/v1/messages", {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "go"}],
                      "tools": [{"name": "get", "input_schema": {"type": "object"}}]},
     lambda event: event.get("type") == "content_block_stop" and event.get("index") == 0),
    ("/v1/responses", {"model": "m", "input": "go", "stream": True,
                       "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}]},
     lambda event: event.get("type") == "response.output_item.done" and event["item"]["type"] == "function_call"),
])
async def test_a_tool_call_s_closing_event_waits_for_the_call_s_record(
        path: str, body: dict[str, object], closes_first_call: Any, kafka_settings: KafkaSettings,
        topics: TopicRegistry, tmp_path: Path) -> None:
    """A harness runs a tool on its call's closing event, not on the answer's end: that event waits
    until the call's record is durable, as the terminal events do. The engine closes the first of
    two calls by beginning the second, then pauses before the answer's end: the first call's
    closing event went out during that pause, before anything of the call was recorded."""
    script: list[bytes | float] = [
        _chunk([_tool_piece(0, "call_a", '{"a": 1}', 11)], prompt_token_ids=[1, 2, 3]),
        _chunk([_tool_piece(1, "call_b", '{"b": 2}', 12)]), 1.0,
        _chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls", "token_ids": [13],
                 "logprobs": {"content": [{"token": "e", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}}]),
        _chunk([], usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}), b"[DONE]"]
    engine = ScriptedEngine(command="true", faults=[Fault(match=lambda _b: True, stream=script)])
    spool = tmp_path / "spool"
    async with engine.running(free_port()) as engine_url:
        settings = ProxySettings(port=free_port(), upstreams=[engine_url], credential_key=KEY.decode(),
                                 spool_dir=spool, kafka=kafka_settings, publish_timeout_s=5.0)
        server, task = await serve(settings)
        try:
            token = mint_token(KEY, "r-tools", Role.AGENT, 600)
            before = _journal_bytes(spool)
            recorded_at_close: int | None = None
            types: list[str] = []
            async with httpx.AsyncClient(timeout=30) as client, client.stream(
                    "POST", f"http://127.0.0.1:{settings.port}/rollouts/r-tools{path}", json=body,
                    headers={"authorization": f"Bearer {token}"}) as answer:
                assert answer.status_code == 200
                async for line in answer.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    event = orjson.loads(line[5:])
                    types.append(event.get("type"))
                    if recorded_at_close is None and closes_first_call(event):
                        recorded_at_close = _journal_bytes(spool)  # what the journal holds as the harness acts
        finally:
            await shutdown(server, task)
    assert recorded_at_close is not None, types
    assert recorded_at_close > before, "the tool call's closing event came before the call's record"
    [event] = await read_events(kafka_settings, topics, CALLS, expect=1)
    assert event.status is CallStatus.OK and event.choices[0].completion_token_ids == [11, 12, 13]
