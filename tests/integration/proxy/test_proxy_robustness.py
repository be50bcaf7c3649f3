"""Credentials, bad input, engine failures, disconnects, retries, and Kafka going away."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import logging
import os
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from meters import counter_values, metric_value
from netutil import free_port, free_port_pair
from proxy_helpers import KEY, RunningProxy, calls_of, read_events, rewards_of, serve, shutdown

from producers.journal import Journal
from producers.shipper import spool_path
from proxy.auth import ROLLOUT_HEADER
from schemas import ModelCallV1, RewardV1
from schemas.call.v1 import CallStatus
from schemas.credentials import Role, mint_token
from stream import BrokerSettings, KafkaAdmin, KafkaSettings, LocalBroker, TopicRegistry

pytestmark = pytest.mark.kafka

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# The proxy under test runs in the test's own event loop, so whatever the test does without
# awaiting holds the proxy up too. A new httpx client loads the system's certificate authorities
# (some 150 of them: 20 ms of CPU on an idle machine, seen taking seconds on a loaded one) unless it
# is given a context; these tests speak plain HTTP, so every client shares this one, made once.
PLAIN = ssl.create_default_context()


async def get(url: str, *, token: str | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30, verify=PLAIN) as client:
        return await client.get(url, headers=auth(token) if token else None)


async def post(url: str, *, token: str | None = None, json: object = None, content: bytes | None = None,
               headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60, verify=PLAIN) as client:
        return await client.post(url, json=json, content=content,
                                 headers={**(auth(token) if token else {}), **(headers or {})})


async def test_credentials_are_checked(proxy: RunningProxy) -> None:
    refused_before = counter_values("openforge.proxy.refused").get((("status", 401),), 0)
    url = f"{proxy.base('r-a')}/v1/chat/completions"
    assert (await post(url, json=CHAT)).status_code == 401
    assert (await post(url, json=CHAT, token="sk-not-ours")).status_code == 401
    other = await post(url, json=CHAT, token=proxy.token("r-b"))
    assert other.status_code == 401 and "another rollout" in other.text
    expired = await post(url, json=CHAT, token=mint_token(KEY, "r-a", Role.AGENT, 5, now=time.time() - 10))
    assert expired.status_code == 401 and "expired" in expired.text
    forged = mint_token(b"some-other-signing-key!!", "r-a", Role.AGENT, 600)
    assert (await post(url, json=CHAT, token=forged)).status_code == 401
    # The key also works as x-api-key (Anthropic clients), and the rollout may come from the token alone.
    ok = await post(f"{proxy.url}/v1/chat/completions", json=CHAT, headers={"x-api-key": proxy.token("r-a")})
    assert ok.status_code == 200
    # Or from a header, which must agree with the token.
    named = await post(f"{proxy.url}/v1/chat/completions", json=CHAT, token=proxy.token("r-a"),
                       headers={ROLLOUT_HEADER: "r-a"})
    assert named.status_code == 200
    misnamed = await post(f"{proxy.url}/v1/chat/completions", json=CHAT, token=proxy.token("r-a"),
                          headers={ROLLOUT_HEADER: "r-b"})
    assert misnamed.status_code == 401
    events = await calls_of(proxy, 2)
    assert [e.rollout_id for e in events] == ["r-a", "r-a"]
    # Refusals leave no call event; the metric is where an operator sees them.
    assert counter_values("openforge.proxy.refused").get((("status", 401),), 0) - refused_before == 6


async def test_model_calls_only_from_the_agent(proxy: RunningProxy) -> None:
    # A judge calling the model with the verifier's token would be recorded as the agent's turn.
    verifier = proxy.token("r-j", Role.VERIFIER)
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": CHAT["messages"]}),
                       ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4})):
        refused = await post(f"{proxy.base('r-j')}{path}", json=body, token=verifier)
        assert refused.status_code == 403 and "agent's token" in refused.text, (path, refused.text)
    # Reading the model list and counting tokens record nothing; either token may.
    async with httpx.AsyncClient(timeout=30) as client:
        models = await client.get(f"{proxy.base('r-j')}/v1/models", headers=auth(verifier))
    assert models.status_code == 200
    counted = await post(f"{proxy.base('r-j')}/v1/messages/count_tokens", token=verifier,
                         json={"model": "m", "messages": CHAT["messages"]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    # A tool schema nested past what the call itself may be is refused as the call would be (a 500 before).
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(250):
        schema = {"type": "object", "properties": {"x": schema}}
    deep = await post(f"{proxy.base('r-j')}/v1/messages/count_tokens", token=verifier,
                      json={"model": "m", "messages": CHAT["messages"],
                            "tools": [{"name": "t", "input_schema": schema}]})
    assert deep.status_code == 400 and "nests deeper than 128 levels" in deep.text, deep.text
    agent = await post(f"{proxy.base('r-j')}/v1/chat/completions", json=CHAT, token=proxy.token("r-j"))
    assert agent.status_code == 200
    [event] = await calls_of(proxy, 1)  # the agent's call alone
    assert event.rollout_id == "r-j"


async def test_rewards_only_from_the_verifier(proxy: RunningProxy) -> None:
    url = f"{proxy.url}/rollouts/r-v/reward"
    denied = await post(url, json={"value": 1.0}, token=proxy.token("r-v", Role.AGENT))
    assert denied.status_code == 403
    other = await post(url, json={"value": 1.0}, token=proxy.token("r-w", Role.VERIFIER))
    assert other.status_code == 401 and other.headers["www-authenticate"].startswith("Bearer")
    bad = await post(url, json={"value": "high"}, token=proxy.token("r-v", Role.VERIFIER))
    assert bad.status_code == 400 and "value" in bad.text
    # Strict: numbers in strings and booleans are a verifier's bug, a misspelt field would be lost.
    for loose in ({"value": "0.5"}, {"value": True}, {"value": None}):
        refused = await post(url, json=loose, token=proxy.token("r-v", Role.VERIFIER))
        assert refused.status_code == 400 and "JSON number" in refused.text, (loose, refused.text)
    shown = await post(url, json={"value": True}, token=proxy.token("r-v", Role.VERIFIER))
    assert "got true" in shown.text  # as the verifier wrote it, not as Python spells it
    # Info is an object or absent: an empty list or string is not quietly stored as {}.
    for not_object in ([], "", 0, [1]):
        refused = await post(url, json={"value": 1, "info": not_object}, token=proxy.token("r-v", Role.VERIFIER))
        assert refused.status_code == 400 and "info must be a JSON object" in refused.text, (not_object, refused.text)
    # A body within the route's 1 MiB whose event is over the topic's (the envelope, and numbers
    # written out in full): the verifier's to fix, so a 413 it does not retry, not a 500 it does.
    big = b'{"value":1,"info":{"x":[' + b",".join([b"1e9"] * 120_000) + b"]}}"
    assert len(big) < 1024 * 1024
    too_large = await post(url, content=big, token=proxy.token("r-v", Role.VERIFIER),
                           headers={"content-type": "application/json"})
    assert too_large.status_code == 413 and "too large for its topic" in too_large.text, too_large.text
    # Info nested past what its event is written to: the verifier's to fix (a 500 before).
    deep: Any = 1
    for _ in range(254):
        deep = [deep]
    nested = await post(url, json={"value": 1, "info": {"a": deep}}, token=proxy.token("r-v", Role.VERIFIER))
    assert nested.status_code == 400 and "nests deeper than 128 levels" in nested.text, nested.text
    misspelt = await post(url, json={"value": 1, "infos": {"passed": 3}}, token=proxy.token("r-v", Role.VERIFIER))
    assert misspelt.status_code == 400 and "infos" in misspelt.text
    nan = await post(url, content=b'{"value": NaN}', token=proxy.token("r-v", Role.VERIFIER),
                     headers={"content-type": "application/json"})
    assert nan.status_code == 400
    # Finite, but infinite in the learner's float32 (its group's advantages were all NaN).
    for huge in (b"1e39", b"-1e300", b"1" + b"0" * 30):
        refused = await post(url, content=b'{"value": ' + huge + b"}", token=proxy.token("r-v", Role.VERIFIER),
                             headers={"content-type": "application/json"})
        assert refused.status_code == 400 and "value" in refused.text and "1000000000" in refused.text, refused.text
    accepted = await post(url, json={"value": 0.75, "info": {"passed": 3}},
                          token=proxy.token("r-v", Role.VERIFIER, task_id="t-9"))
    assert accepted.status_code == 202
    # A reward is answered only once Kafka has it (and so the rollout's calls journalled before it).
    assert accepted.json()["stored"] == "kafka"
    [reward] = await rewards_of(proxy, 1)
    assert isinstance(reward, RewardV1)
    assert (reward.rollout_id, reward.task_id, reward.value, reward.info) == ("r-v", "t-9", 0.75, {"passed": 3})
    assert reward.event_id == accepted.json()["event_id"]


async def test_malformed_and_mistyped_requests_get_400_and_are_recorded(proxy: RunningProxy) -> None:
    url = f"{proxy.base('r-bad')}/v1/chat/completions"
    token = proxy.token("r-bad")
    garbage = await post(url, content=b"{not json", token=token, headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and "malformed JSON" in garbage.json()["error"]["message"]
    wrong = await post(url, json={"model": "m", "messages": "hi"}, token=token)
    assert wrong.status_code == 400 and "messages" in wrong.json()["error"]["message"]
    not_object = await post(url, json=[1, 2], token=token)
    assert not_object.status_code == 400
    # Fields the proxy reads itself: before, a bare 500 and no event ("false" as stream was a stream).
    for field, value in (("tools", "x"), ("stream", "false"), ("stream_options", [1])):
        mistyped = await post(url, json={**CHAT, "stream": True, field: value}, token=token)
        assert mistyped.status_code == 400 and field in mistyped.json()["error"]["message"], mistyped.text
    engine_refuses = await post(url, json={**CHAT, "temperature": -1}, token=token)
    assert engine_refuses.status_code == 400  # the engine's own verdict, passed on
    events = await calls_of(proxy, 7)
    assert [e.status for e in events] == [CallStatus.INVALID_REQUEST] * 6 + [CallStatus.UPSTREAM_ERROR]
    assert events[6].upstream_status_code == 400 and events[6].error_message


async def test_oversized_body_gets_413(proxy_settings_factory, topics: TopicRegistry) -> None:
    settings = proxy_settings_factory(max_body_bytes=10_000)
    server, task = await serve(settings)
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}
        answer = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-big/v1/chat/completions", json=big,
                            token=mint_token(KEY, "r-big", Role.AGENT, 60))
        assert answer.status_code == 413 and "10,000" in answer.text
        anthropic = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-big/v1/messages",
                               json={**big, "max_tokens": 4}, token=mint_token(KEY, "r-big", Role.AGENT, 60))
        assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"
        # A compressed body is named as such, not refused as malformed JSON.
        zipped = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-big/v1/messages",
                            content=gzip.compress(orjson.dumps({**CHAT, "max_tokens": 4})),
                            token=mint_token(KEY, "r-big", Role.AGENT, 60),
                            headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert zipped.status_code == 415 and "Content-Encoding 'gzip'" in zipped.json()["error"]["message"]
        # Counting tokens and rewards hold to the same: the body limit (when under the reward's
        # own 1 MiB) and no compressed bodies. Before, both took a compressed body as malformed
        # JSON and a reward ignored the limit.
        counting = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-big/v1/messages/count_tokens",
                              content=gzip.compress(orjson.dumps({**CHAT, "max_tokens": 4})),
                              token=mint_token(KEY, "r-big", Role.AGENT, 60),
                              headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert counting.status_code == 415 and "Content-Encoding 'gzip'" in counting.text, counting.text
        verifier = mint_token(KEY, "r-big", Role.VERIFIER, 60)
        reward_url = f"http://127.0.0.1:{settings.port}/rollouts/r-big/reward"
        zipped_reward = await post(reward_url, content=gzip.compress(b'{"value": 1}'), token=verifier,
                                   headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert zipped_reward.status_code == 415, zipped_reward.text
        big_reward = await post(reward_url, json={"value": 1, "info": {"log": "x" * 20_000}}, token=verifier)
        assert big_reward.status_code == 413 and "10,000" in big_reward.text, big_reward.text
    finally:
        await shutdown(server, task)


async def _raw_exchange(port: int, pieces: list[bytes], pause_s: float = 0.0, *, until_answered: bool = True
                        ) -> bytes:
    """Send ``pieces`` over a plain connection (``until_answered``: no more once an answer came) and read it all."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = bytearray()

    async def read() -> None:
        with contextlib.suppress(ConnectionError):  # a reset after the answer: what came before it counts
            while chunk := await reader.read(65536):
                answer.extend(chunk)

    reading = asyncio.create_task(read())
    try:
        for piece in pieces:
            if reading.done() or (answer and until_answered):  # refused already: writing on would only reset
                break
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(pause_s)
        await asyncio.wait_for(reading, 30)
        return bytes(answer)
    finally:
        writer.close()


async def test_a_request_head_past_its_bound_gets_431_and_the_connection_closes(
        proxy_settings_factory) -> None:
    # The HTTP parser had no bound on a request's head: one 100 MB header, or headers that never
    # end, were read whole into memory, before any credential was looked at (a 100 MB header on
    # /health was answered 200 after the proxy grew by about 200 MB).
    settings = proxy_settings_factory(max_head_bytes=16 * 1024)
    server, task = await serve(settings)
    token = mint_token(KEY, "r-head", Role.AGENT, 600)
    call = (f"POST /rollouts/r-head/v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
            "content-type: application/json\r\nconnection: close\r\n").encode()
    body = orjson.dumps({**CHAT, "max_tokens": 2})
    try:
        # One long header, sent in reads, as a slow client does: refused once past the bound.
        huge = await _raw_exchange(settings.port, [b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: "]
                                   + [b"a" * 8192] * 64, pause_s=0.01)
        assert huge.startswith(b"HTTP/1.1 431 ") and b"exceed 16,384 bytes" in huge, huge[:200]
        # Many headers, the same.
        many = await _raw_exchange(settings.port, [b"GET /health HTTP/1.1\r\nhost: x\r\n"]
                                   + [b"x-h%d: v\r\n" % i for i in range(4000)], pause_s=0.0005)
        assert many.startswith(b"HTTP/1.1 431 "), many[:200]
        # A whole head past the bound in one read, and one that stops coming after a read past it.
        for head in (b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 20_000 + b"\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 20_000):
            refused = await _raw_exchange(settings.port, [head])
            assert refused.startswith(b"HTTP/1.1 431 "), refused[:200]
        # Trailers after a chunked body's last chunk are headers too: the connection closes.
        trailers = await _raw_exchange(
            settings.port, [call.replace(b"content-type", b"transfer-encoding: chunked\r\ncontent-type")
                            + b"%x\r\n%s\r\n0\r\nx-trailer: " % (len(body), body)]
            + [b"a" * 8192] * 64, pause_s=0.01)
        assert b"HTTP/1.1 200 " not in trailers, trailers[:200]
        # Within the bound (a 12 KiB header) a call is served, and its body, however long, is not counted.
        padded = call + b"x-filler: " + b"a" * 12 * 1024 + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        served = await _raw_exchange(settings.port, [padded, body])
        assert served.startswith(b"HTTP/1.1 200 "), served[:300]
        long_body = orjson.dumps({**CHAT, "max_tokens": 2, "user": "u" * 200_000})
        served = await _raw_exchange(settings.port, [call + b"content-length: %d\r\n\r\n" % len(long_body),
                                                     long_body[:70_000], long_body[70_000:]], pause_s=0.05)
        assert served.startswith(b"HTTP/1.1 200 "), served[:300]
        # Keep-alive: the next request's head on the same connection is counted afresh.
        again = call.replace(b"connection: close", b"connection: keep-alive")
        twice = await _raw_exchange(settings.port, [again + b"content-length: %d\r\n\r\n" % len(body) + body,
                                                    call + b"content-length: %d\r\n\r\n" % len(body) + body],
                                    pause_s=0.5, until_answered=False)
        assert twice.count(b"HTTP/1.1 200 ") == 2, twice[:300]
    finally:
        await shutdown(server, task)


async def test_failed_journal_flushes_are_counted_in_readiness_and_metrics_injected(
        proxy_settings_factory, topics: TopicRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # The journal's flushes to the disk fail twice (injected: no disk here can be made to fail a
    # write-back). They were logged and nothing else: no dashboard or probe showed a disk losing
    # writes, and Linux reports a failed write-back once, so the next flush succeeds regardless.
    # The calls are still answered and their events still reach Kafka (from the page cache).
    real_fdatasync, failed = os.fdatasync, []

    def failing_twice(fd: int) -> None:
        if len(failed) < 2:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", failing_twice)
    settings = proxy_settings_factory(journal_fsync_interval_ms=50)
    server, task = await serve(settings)
    url = f"http://127.0.0.1:{settings.port}/rollouts/r-flush/v1/chat/completions"
    token = mint_token(KEY, "r-flush", Role.AGENT, 600)
    try:
        for seed in range(3):
            assert (await post(url, json={**CHAT, "seed": seed}, token=token)).status_code == 200
            await asyncio.sleep(0.2)  # a flush between calls
        ready = await _ready_until(settings.port, lambda r: r["flush_errors"] == 2 and r["spooled"] == 0)
        assert ready["accepting"] is True, ready  # serving goes on: the records are in the page cache
        assert metric_value("openforge.proxy.journal_flush_errors") == 2  # read from this proxy's journal
    finally:
        await shutdown(server, task)
    events = await read_events(settings.kafka, topics, expect=3)
    assert sorted(e.request.sampling.get("seed") for e in events) == [0, 1, 2], events


async def test_a_nearly_full_disk_refuses_calls_before_the_engine_and_is_not_ready(
        proxy_settings_factory, tmp_path: Path) -> None:
    # Another file takes the disk the journal is on (a volume shared, or smaller than the
    # journal's bound). Before, each call was served by the engine and only then refused (its
    # record could not be written) while /ready said ready. Now the proxy refuses before the
    # engine's work and is not ready until there is room again. The disk is real: its free space
    # is read, a file takes half of it (up to 4 GiB) at once (allocated, not written), and the
    # floor lies halfway, so other work on the machine writing or freeing less than a quarter of
    # the free space meanwhile changes nothing (a margin of 256 MiB was once eaten by a concurrent
    # build).
    spool = tmp_path / "spool"
    spool.mkdir()
    stat = os.statvfs(spool)
    free = stat.f_bavail * stat.f_frsize
    assert free > 1 << 30, f"this test takes half the free disk under {tmp_path}, which has only {free >> 20} MiB"
    taken = min(4 << 30, free // 2)
    floor = free - taken // 2
    settings = proxy_settings_factory(min_free_disk_bytes=floor)
    server, task = await serve(settings)
    url = f"http://127.0.0.1:{settings.port}/rollouts/r-disk/v1/chat/completions"
    token = mint_token(KEY, "r-disk", Role.AGENT, 600)
    filler = tmp_path / "another-file"
    try:
        assert (await post(url, json=CHAT, token=token)).status_code == 200
        with filler.open("wb") as out:
            os.posix_fallocate(out.fileno(), 0, taken)
        ready = await _ready_until(settings.port, lambda r: r["accepting"] is False, timeout_s=10.0)
        assert ready["disk_ok"] is False and ready["disk_free_bytes"] < floor, ready
        assert (await get(f"http://127.0.0.1:{settings.port}/ready")).status_code == 503
        refused = await post(url, json=CHAT, token=token)
        # Refused at the door, naming the disk (a record lost after the engine's work says otherwise).
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert "disk under the call log is nearly full" in refused.json()["error"]["message"], refused.text
        filler.unlink()
        ready = await _ready_until(settings.port, lambda r: r["accepting"] is True, timeout_s=10.0)
        assert ready["disk_ok"] is True and ready["disk_free_bytes"] >= floor, ready
        assert (await post(url, json=CHAT, token=token)).status_code == 200
    finally:
        filler.unlink(missing_ok=True)
        await shutdown(server, task)


async def test_engine_down_gets_502_and_is_recorded(proxy_settings_factory, topics: TopicRegistry) -> None:
    settings = proxy_settings_factory(upstreams=[f"http://127.0.0.1:{free_port()}"], served_model="tiny")
    server, task = await serve(settings)
    try:
        answer = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-down/v1/chat/completions", json=CHAT,
                            token=mint_token(KEY, "r-down", Role.AGENT, 60))
        assert answer.status_code == 502 and "no engine replica reachable" in answer.text
        ready = await get(f"http://127.0.0.1:{settings.port}/ready")
        assert ready.status_code == 503 and ready.json()["engine"] is False
    finally:
        await shutdown(server, task)
    [event] = await calls_of(RunningProxy("", settings, topics), 1)
    assert event.status is CallStatus.UPSTREAM_UNREACHABLE and event.request.messages == CHAT["messages"]


async def test_helper_routes_answer_502_when_the_engine_cannot_name_its_model(proxy_settings_factory) -> None:
    # The model list and token counting ask the engine for its model name first: an engine that
    # cannot be reached is the engine's failure (502), not an unhandled error of the proxy (500).
    settings = proxy_settings_factory(upstreams=[f"http://127.0.0.1:{free_port()}"])
    server, task = await serve(settings)
    try:
        token = mint_token(KEY, "r-down", Role.AGENT, 60)
        models = await get(f"http://127.0.0.1:{settings.port}/rollouts/r-down/v1/models", token=token)
        counted = await post(f"http://127.0.0.1:{settings.port}/rollouts/r-down/v1/messages/count_tokens",
                             token=token, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        await shutdown(server, task)
    for answer in (models, counted):
        assert answer.status_code == 502, answer.text
        assert "could not be asked for its model" in answer.text


async def test_client_disconnect_mid_stream_is_recorded_and_retry_is_linked(proxy: RunningProxy,
                                                                            vllm_url: str) -> None:
    # The harness leaves after the first token; the engine must stop making the answer nobody
    # reads (greedy, this prompt's answer runs to max_tokens). The engine is paused (mode keep: its
    # requests frozen where they are) the moment the harness has its first token, so the race
    # between the proxy hearing the harness leave and the engine finishing is decided by the proxy
    # alone, however long the machine holds either process off the CPU: held for seconds on a
    # loaded two-core machine, the proxy used to hear the harness only after the engine had made
    # every token. Only the pause itself must land before the engine is done: with 255 answers of
    # 990 tokens beside it (asked of the engine itself), twice what its cache holds at once, that is
    # some forty seconds of its work.
    answers, tokens = 256, 990
    body = {**CHAT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell a story."}]}
    whole = answers * tokens
    url = f"{proxy.base('r-cut')}/v1/chat/completions"
    model = await _served(vllm_url)
    generated_before = await _engine_idle(vllm_url)
    made_whole = await _engine_metric(vllm_url, "vllm:request_success_total", finished_reason="length")
    async with _engine_held(vllm_url) as hold:
        async with httpx.AsyncClient(timeout=60, verify=PLAIN) as client, \
                client.stream("POST", url, json=body, headers=auth(proxy.token("r-cut"))) as response:
            assert response.status_code == 200
            async with _engine_load(vllm_url, model, answers - 1, tokens):
                async for line in response.aiter_lines():
                    if line.startswith("data:") and any(choice["delta"].get("content")
                                                        for choice in orjson.loads(line[5:])["choices"]):
                        break  # the first token (the first chunks only open the answer)
                await hold.pause()
        # The harness has left; the proxy records the call once it has cut its engine request.
        [cut] = await calls_of(proxy, 1)
    assert cut.status is CallStatus.CLIENT_DISCONNECTED, cut.status
    assert 0 < sum(len(c.completion_token_ids) for c in cut.choices) < tokens  # what was made before the cut
    made = await _made_since(vllm_url, generated_before)
    assert 0 < made < whole, made
    # No answer was made whole: the proxy cut its engine request (and the test its load).
    assert await _engine_metric(vllm_url, "vllm:request_success_total", finished_reason="length") == made_whole
    # The harness re-sends the conversation (as Claude Code does after a broken stream: whole
    # answer this time); it is linked to the cut attempt. Once that succeeded, the next request of
    # the same conversation is a new call. (A retry is told by its conversation, not by its
    # sampling: short answers here keep the test quick.)
    again = await post(url, json={**body, "stream": False, "max_tokens": 8}, token=proxy.token("r-cut"))
    fresh = await post(url, json={**body, "max_tokens": 8}, token=proxy.token("r-cut"))
    assert again.status_code == 200 and fresh.status_code == 200
    [_, linked, new_call] = await calls_of(proxy, 3)
    assert (linked.streamed, linked.retry_of, linked.attempt, linked.status) == (False, cut.call_id, 1, CallStatus.OK)
    assert (new_call.streamed, new_call.retry_of, new_call.attempt, new_call.status) == (True, None, 0, CallStatus.OK)


async def test_a_stream_whose_harness_left_before_its_first_byte_is_still_recorded(proxy: RunningProxy) -> None:
    # The harness sends a streamed request and hangs up at once: the proxy is still waiting for
    # the engine's headers, so the answer is cut before its first byte and its body never runs.
    body = {**CHAT, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "Count to ten."}]}
    raw = orjson.dumps(body)
    port = int(proxy.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /rollouts/r-gone/v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
                 b"authorization: Bearer " + proxy.token("r-gone").encode() + b"\r\n"
                 b"content-type: application/json\r\ncontent-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    [event] = await calls_of(proxy, 1)
    assert (event.rollout_id, event.streamed, event.status) == ("r-gone", True, CallStatus.CLIENT_DISCONNECTED)
    assert event.request.messages == body["messages"] and event.upstream_replica
    # The proxy is not left holding anything: the next call of the rollout is a new call.
    again = await post(f"{proxy.base('r-gone')}/v1/chat/completions", json={**body, "stream": False},
                       token=proxy.token("r-gone"))
    assert again.status_code == 200
    [_, second] = await calls_of(proxy, 2)
    assert (second.status, second.retry_of, second.attempt) == (CallStatus.OK, event.call_id, 1)


async def test_a_client_that_hangs_up_mid_body_is_no_fault_of_the_proxy(
        proxy: RunningProxy, caplog: pytest.LogCaptureFixture) -> None:
    # Before, the server's own "Exception in ASGI application" and a traceback for every aborted upload.
    port = int(proxy.url.rsplit(":", 1)[1])
    caplog.set_level(logging.WARNING)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /rollouts/r-half/v1/messages HTTP/1.1\r\nhost: proxy\r\n"
                 b"authorization: Bearer " + proxy.token("r-half").encode() + b"\r\n"
                 b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\": \"m\", \"mess")
    await writer.drain()
    await asyncio.sleep(0.3)  # the body has begun to arrive
    writer.close()
    await writer.wait_closed()
    answer = await post(f"{proxy.base('r-half')}/v1/chat/completions", json=CHAT, token=proxy.token("r-half"))
    assert answer.status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    [event] = await calls_of(proxy, 1)  # the upload that never finished began no call
    assert event.status is CallStatus.OK


async def test_the_model_list_refuses_an_anthropic_client_in_its_own_shape(proxy: RunningProxy) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        refused = await client.get(f"{proxy.url}/v1/models",
                                   headers={"x-api-key": "nope", "anthropic-version": "2023-06-01"})
        openai = await client.get(f"{proxy.url}/v1/models", headers={"authorization": "Bearer nope"})
    assert refused.status_code == 401 and refused.json()["type"] == "error"  # as its answer is Anthropic's
    assert openai.status_code == 401 and openai.json()["error"]["type"] == "authentication_error"


async def test_the_same_request_twice_at_once_is_two_calls(proxy: RunningProxy) -> None:
    # Two sub-agents of one rollout with one prompt: both answers are used, so neither call may
    # be linked to the other as its retry (the assembler leaves out every call a retry names).
    body = {**CHAT, "max_tokens": 24}
    url = f"{proxy.base('r-twice')}/v1/chat/completions"
    answers = await asyncio.gather(*(post(url, json=body, token=proxy.token("r-twice")) for _ in range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    events = await calls_of(proxy, 2)
    assert [(e.status, e.attempt, e.retry_of) for e in events] == [(CallStatus.OK, 0, None)] * 2


async def _engine_metric(vllm_url: str, name: str, **labels: str) -> float:
    """The sum of a vLLM Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    text = (await get(f"{vllm_url}/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{key}="{wanted}"' in head for key, wanted in labels.items()):
                total += float(value)
    return total


async def _engine_idle(vllm_url: str) -> float:
    """Wait until what earlier tests left running (answers of harnesses that left) ends; the
    engine's count of tokens made so far."""
    for _ in range(600):
        if await _engine_metric(vllm_url, "vllm:num_requests_running") == 0 == await _engine_metric(
                vllm_url, "vllm:num_requests_waiting"):
            return await _engine_metric(vllm_url, "vllm:generation_tokens_total")
        await asyncio.sleep(0.05)
    raise AssertionError("the engine was still at work after 30 s; its token count would include that work")


class _EngineHold:
    """Pauses the engine (``mode=keep``) once asked; see :func:`_engine_held`."""

    def __init__(self, client: httpx.AsyncClient, vllm_url: str) -> None:
        self._client, self._url = client, vllm_url
        self.paused = False

    async def pause(self) -> None:
        answer = await self._client.post(f"{self._url}/pause", params={"mode": "keep"})
        self.paused = True  # a pause that timed out may still have taken effect: resume regardless
        assert answer.status_code == 200, answer.text


@contextlib.asynccontextmanager
async def _engine_held(vllm_url: str) -> AsyncIterator[_EngineHold]:
    """A block in which the engine can be paused, its requests frozen, and is resumed at the end
    whatever happens (a paused engine would fail every later test of the session)."""
    async with httpx.AsyncClient(timeout=30, verify=PLAIN) as client:
        hold = _EngineHold(client, vllm_url)
        try:
            yield hold
        finally:
            if hold.paused:
                resumed = await client.post(f"{vllm_url}/resume")
                assert resumed.status_code == 200, resumed.text


async def _engine_began(vllm_url: str, generated_before: float) -> None:
    """Wait until the engine has made a token since ``generated_before`` (a request reached it)."""
    for _ in range(1500):
        if await _engine_metric(vllm_url, "vllm:generation_tokens_total") > generated_before:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine made no token in 30 s")


async def _served(vllm_url: str) -> str:
    """The engine's model name, as a request to it names it."""
    return str((await get(f"{vllm_url}/v1/models")).json()["data"][0]["id"])


@contextlib.asynccontextmanager
async def _engine_load(vllm_url: str, model: str, answers: int, tokens: int) -> AsyncIterator[None]:
    """``answers`` answers of ``tokens`` tokens the engine makes beside the call under test, asked of
    the engine itself (the proxy refuses ``n`` and ``ignore_eos``), cut when the block ends: vLLM
    aborts a request whose connection closes."""
    body = {"model": model, "messages": [{"role": "user", "content": "Load."}], "n": answers,
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60, verify=PLAIN) as client, \
            client.stream("POST", f"{vllm_url}/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200, await stream.aread()
        yield


async def _made_since(vllm_url: str, generated_before: float) -> float:
    """Tokens the engine made since ``generated_before``, read once the count has not moved for a
    second (an engine still at work moves it every step)."""
    counts: list[float] = []
    while len(counts) < 6 or len(set(counts[-6:])) > 1:
        assert len(counts) < 100, f"the engine was still making tokens after 20 s: {counts}"
        counts.append(await _engine_metric(vllm_url, "vllm:generation_tokens_total") - generated_before)
        await asyncio.sleep(0.2)
    return counts[-1]


async def test_a_whole_answer_whose_harness_left_stops_the_engine_and_its_retry_is_linked(
        proxy: RunningProxy, vllm_url: str) -> None:
    # A harness that times out on a whole answer hangs up and sends the call again. The engine
    # must stop making the answer nobody takes, and the call must not count as the turn. As in the
    # stream's test, the engine is paused once it has begun, before the harness leaves, so only
    # the pause must land before the engine's forty seconds of work are done.
    answers, tokens = 256, 990
    body = {**CHAT, "max_tokens": tokens, "temperature": 0, "messages": [{"role": "user", "content": "Go on."}]}
    whole = answers * tokens
    raw = orjson.dumps(body)
    port = int(proxy.url.rsplit(":", 1)[1])
    model = await _served(vllm_url)
    generated_before = await _engine_idle(vllm_url)
    made_whole = await _engine_metric(vllm_url, "vllm:request_success_total", finished_reason="length")
    async with _engine_held(vllm_url) as hold:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /rollouts/r-left/v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
                         b"authorization: Bearer " + proxy.token("r-left").encode() + b"\r\n"
                         b"content-type: application/json\r\ncontent-length: " + str(len(raw)).encode()
                         + b"\r\n\r\n" + raw)
            await writer.drain()
            async with _engine_load(vllm_url, model, answers - 1, tokens):
                await _engine_began(vllm_url, generated_before)
                await hold.pause()
        finally:
            writer.close()
            await writer.wait_closed()
        [event] = await calls_of(proxy, 1)
    assert (event.rollout_id, event.streamed, event.status) == ("r-left", False, CallStatus.CLIENT_DISCONNECTED)
    assert event.upstream_replica and not event.choices  # cut before the engine answered
    made = await _made_since(vllm_url, generated_before)
    assert 0 < made < whole, (made, event.timings)  # the engine began, and stopped short
    # No answer was made whole (greedy, this prompt's answer runs to max_tokens): the proxy cut its
    # engine request, whether the engine had begun it or still queued it behind the load.
    assert await _engine_metric(vllm_url, "vllm:request_success_total", finished_reason="length") == made_whole
    again = await post(f"{proxy.base('r-left')}/v1/chat/completions", json={**body, "max_tokens": 8},
                       token=proxy.token("r-left"))
    assert again.status_code == 200
    [_, second] = await calls_of(proxy, 2)
    assert (second.status, second.retry_of, second.attempt) == (CallStatus.OK, event.call_id, 1)


def _waiting_on_disk(spool: Path) -> int:
    """Events a stopped proxy left for Kafka: unshipped journal records."""
    journal = Journal(spool_path(spool), 1 << 30)
    journal.open()
    try:
        return len(journal)
    finally:
        journal.close()


async def _ready_until(port: int, check: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        ready: dict[str, Any] = (await get(f"http://127.0.0.1:{port}/ready")).json()
        if check(ready) or asyncio.get_running_loop().time() > deadline:
            return ready
        await asyncio.sleep(0.2)


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A broker of the test's own (the test stops and restarts it), started.

    Stopped however the test ends: the broker runs in a session of its own, so a failed or
    interrupted test would otherwise leave a Kafka process behind.
    """
    port = free_port_pair()
    broker = LocalBroker(BrokerSettings(port=port, controller_port=port + 1, data_dir=str(tmp_path / "kafka")))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def _private_broker(broker: LocalBroker) -> tuple[LocalBroker, KafkaSettings, TopicRegistry]:
    """``broker`` with the topics made, and the settings to reach it."""
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=1, linger_ms=0, request_timeout_ms=5000)
    registry = TopicRegistry.from_settings(kafka)
    async with KafkaAdmin(kafka, registry) as admin:
        await admin.create_topics()
    return broker, kafka, registry


async def _proxy_process(vllm_url: str, spool: Path, bootstrap: str, port: int, *, log: Path | None = None,
                         **env: str) -> asyncio.subprocess.Process:
    """``openforge proxy`` as a process of its own (a test may kill it, or limit it), once healthy.

    Its output goes to ``log`` if given, else nowhere.
    """
    environment = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
                   "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(), "OPENFORGE_PROXY_SPOOL_DIR": str(spool),
                   "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": bootstrap, **env}
    with contextlib.ExitStack() as files:  # the child has its own copy of the log's descriptor
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "openforge", "proxy", "--host", "127.0.0.1", "--port", str(port),
            "--upstream", vllm_url, env=environment, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL if log is None else files.enter_context(log.open("ab")))
    for _ in range(300):
        with contextlib.suppress(httpx.HTTPError):
            if (await get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                return process
        assert process.returncode is None, "the proxy exited while starting"
        await asyncio.sleep(0.1)
    process.kill()
    raise AssertionError("the proxy did not become healthy in 30 s")


async def _distinct_calls(kafka: KafkaSettings, registry: TopicRegistry, count: int) -> list[ModelCallV1]:
    """The calls topic's events, each once by id, read until ``count`` distinct ones (or 20 s per read)."""
    read: list[ModelCallV1] = []
    for _ in range(3):  # a copy counts towards a read's expected number: read on past it
        read = await read_events(kafka, registry, expect=len(read) + count - len({e.event_id for e in read}))
        if len({e.event_id for e in read}) >= count:
            break
    return list({e.event_id: e for e in read}.values())


async def test_kafka_outage_keeps_events_on_disk_then_delivers_and_a_full_disk_refuses(
    vllm_url: str, tmp_path: Path, own_broker: LocalBroker
) -> None:
    broker, kafka, registry = await _private_broker(own_broker)
    from proxy.settings import ProxySettings
    settings = ProxySettings(port=free_port(), upstreams=[vllm_url], credential_key=KEY.decode(),
                             spool_dir=tmp_path / "spool", kafka=kafka, publish_timeout_s=2.0)
    server, task = await serve(settings)
    url = f"http://127.0.0.1:{settings.port}/rollouts/r-k/v1/chat/completions"
    token = mint_token(KEY, "r-k", Role.AGENT, 600)
    try:
        assert (await post(url, json=CHAT, token=token)).status_code == 200
        await _ready_until(settings.port, lambda r: r["spooled"] == 0)
        broker.stop()
        during = [await post(url, json={**CHAT, "seed": i}, token=token) for i in range(5)]
        assert [r.status_code for r in during] == [200] * 5  # harness unaffected
        ready = await _ready_until(settings.port, lambda r: r["kafka"] is False)
        assert ready["spooled"] == 5 and ready["kafka"] is False
        # The outage shows on the dashboards: what waits, and the failed hand-offs to Kafka.
        assert metric_value("openforge.proxy.spool_depth") == 5
        failed = metric_value("openforge.proxy.publish_errors")
        assert failed is not None and failed >= 1, failed
        broker.start()  # the running proxy delivers them once Kafka is back
        await _ready_until(settings.port, lambda r: r["spooled"] == 0 and r["kafka"] is True)
        # Once each, by id: a send that timed out while the broker came back may have arrived too.
        assert len(await _distinct_calls(kafka, registry, 6)) == 6
        broker.stop()
        left = [await post(url, json={**CHAT, "seed": 5 + i}, token=token) for i in range(2)]
        assert [r.status_code for r in left] == [200] * 2
        await _ready_until(settings.port, lambda r: r["spooled"] == 2)
    finally:
        await shutdown(server, task)  # the proxy stops with events still on disk
    assert _waiting_on_disk(tmp_path / "spool") == 2
    broker.start()
    server, task = await serve(settings)  # a restarted proxy delivers what was left
    try:
        await _ready_until(settings.port, lambda r: r["spooled"] == 0)
        events = await _distinct_calls(kafka, registry, 8)
        assert sorted(e.request.sampling.get("seed", -1) for e in events) == [-1, 0, 1, 2, 3, 4, 5, 6]
    finally:
        await shutdown(server, task)
    # With Kafka gone and a tiny bound, the proxy refuses new calls instead of losing them.
    broker.stop()
    tiny = settings.model_copy(update={"spool_max_bytes": 1, "port": free_port()})
    server, task = await serve(tiny)
    try:
        tiny_url = f"http://127.0.0.1:{tiny.port}/rollouts/r-k/v1/chat/completions"
        first = await post(tiny_url, json=CHAT, token=token)
        assert first.status_code == 200  # taken: its event is kept even past the bound
        refused = await post(tiny_url, json=CHAT, token=token)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        refused_reward = await post(f"http://127.0.0.1:{tiny.port}/rollouts/r-k/reward", json={"value": 1},
                                    token=mint_token(KEY, "r-k", Role.VERIFIER, 60))
        assert refused_reward.status_code == 503
    finally:
        await shutdown(server, task)
    assert _waiting_on_disk(tmp_path / "spool") == 1



async def test_a_broker_outage_is_told_in_a_few_lines_and_readiness_and_sending_follow_the_broker(
        vllm_url: str, tmp_path: Path, own_broker: LocalBroker) -> None:
    """Broker SIGKILLed under load and started again: what the log, /ready and Kafka show.

    The client logged about 40 lines a second while the broker was away, /ready said Kafka was
    fine until a batch's acknowledgement timed out, and sending resumed after a retry backoff of
    up to 10 s. The acknowledgement timeout here is long (30 s), so a readiness that flips or a
    sending that resumes well within it is the probing's doing, not a timeout's.
    """
    from producers.outage import PROBE_EVERY_S, PROBE_TIMEOUT_S, STALL_S

    broker, kafka, registry = await _private_broker(own_broker)
    port, log, report_s = free_port(), tmp_path / "proxy.log", 2.0
    process = await _proxy_process(vllm_url, tmp_path / "spool", broker.bootstrap, port, log=log,
                                   OPENFORGE_PROXY_PUBLISH_TIMEOUT_S="30",
                                   OPENFORGE_PROXY_KAFKA_OUTAGE_REPORT_S=str(report_s))
    token = mint_token(KEY, "r-out", Role.AGENT, 600)
    url = f"http://127.0.0.1:{port}/rollouts/r-out/v1/chat/completions"
    answered: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:  # calls one after another for the whole test, as a harness makes them
        while not stop.is_set():
            seed = len(answered)
            if (await post(url, json={**CHAT, "seed": seed}, token=token)).status_code == 200:
                answered.append(seed)

    calls = asyncio.create_task(load())
    try:
        await _ready_until(port, lambda r: r["kafka"] is True and len(answered) >= 3)
        broker.kill()
        killed = time.monotonic()
        # Found by the first batch that waits STALL_S, and a probe: far inside the 30 s timeout.
        bound = STALL_S + PROBE_TIMEOUT_S + 5.0
        ready = await _ready_until(port, lambda r: r["kafka"] is False, timeout_s=bound)
        assert ready["kafka"] is False, f"/ready still said Kafka was fine {bound} s after the broker was killed"
        during = len(answered)
        await asyncio.sleep(3 * report_s)  # an outage of several intervals, calls answered meanwhile
        assert len(answered) > during and (await get(f"http://127.0.0.1:{port}/ready")).json()["spooled"] > 0
        broker.start()  # returns once the broker answers
        back = time.monotonic()
        bound = PROBE_EVERY_S + PROBE_TIMEOUT_S + 5.0
        ready = await _ready_until(port, lambda r: r["kafka"] is True, timeout_s=bound)
        assert ready["kafka"] is True, f"/ready did not say Kafka was back {bound} s after it answered"
        stop.set()
        await calls
        await _ready_until(port, lambda r: r["spooled"] == 0)
        events = await _distinct_calls(kafka, registry, len(answered))
        assert sorted(e.request.sampling["seed"] for e in events) == answered
    finally:
        stop.set()
        await asyncio.gather(calls, return_exceptions=True)
        process.send_signal(signal.SIGTERM)
        await process.wait()
        broker.stop()
    lines = log.read_text().splitlines()
    went = [n for n, line in enumerate(lines) if "producers.outage: Kafka at" in line and "is unreachable" in line]
    summaries = [n for n, line in enumerate(lines) if "Kafka still unreachable" in line]
    returned = [n for n, line in enumerate(lines) if "Kafka is back" in line]
    assert len(went) == 1 and len(returned) == 1, lines
    outage_s = back - killed
    assert 1 <= len(summaries) <= outage_s / report_s + 1, (outage_s, lines)
    # Nothing else about Kafka between: the client's own lines are held back, and counted.
    between = lines[went[0]:returned[0] + 1]
    assert all(n in (*went, *summaries, *returned) for n in range(went[0], returned[0] + 1)), between
    assert not [line for line in lines if " aiokafka" in line and ("ERROR" in line or "WARNING" in line)], lines


async def test_a_killed_journalling_proxy_loses_no_answered_call(vllm_url: str, tmp_path: Path,
                                                                 own_broker: LocalBroker) -> None:
    """SIGKILL after answering: the journal holds every answered call, and the next process ships it."""
    broker, kafka, registry = await _private_broker(own_broker)
    broker.stop()  # nothing can be shipped: every answered call exists only in the journal
    proxy_port = free_port()
    process = await _proxy_process(vllm_url, tmp_path / "spool", broker.bootstrap, proxy_port,
                                   OPENFORGE_PROXY_PUBLISH_TIMEOUT_S="1")
    token = mint_token(KEY, "r-crash", Role.AGENT, 600)
    try:
        url = f"http://127.0.0.1:{proxy_port}/rollouts/r-crash/v1/chat/completions"
        answered = [await post(url, json={**CHAT, "seed": i}, token=token) for i in range(4)]
        assert [r.status_code for r in answered] == [200] * 4
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    assert _waiting_on_disk(tmp_path / "spool") == 4
    broker.start()
    from proxy.settings import ProxySettings
    settings = ProxySettings(port=free_port(), upstreams=[vllm_url], credential_key=KEY.decode(),
                             spool_dir=tmp_path / "spool", kafka=kafka, publish_timeout_s=2.0)
    server, task = await serve(settings)
    try:
        await _ready_until(settings.port, lambda r: r["spooled"] == 0)
        events = await read_events(kafka, registry, expect=4)
        assert sorted(e.request.sampling["seed"] for e in events) == [0, 1, 2, 3]
        assert {e.rollout_id for e in events} == {"r-crash"}
    finally:
        await shutdown(server, task)
        broker.stop()


async def test_sigterm_to_the_process_group_lets_a_stream_finish_and_ships_its_call_before_exit(
        vllm_url: str, tmp_path: Path, own_broker: LocalBroker) -> None:
    """systemd and shells signal a service's whole process group. The proxy drains: the stream in
    flight runs to its end, and its call reaches Kafka before the proxy is gone."""
    broker, kafka, registry = await _private_broker(own_broker)
    proxy_port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(), "OPENFORGE_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap}
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "openforge", "proxy", "--host", "127.0.0.1", "--port", str(proxy_port),
            "--upstream", vllm_url, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
    token = mint_token(KEY, "r-term", Role.AGENT, 600)
    url = f"http://127.0.0.1:{proxy_port}/rollouts/r-term/v1/chat/completions"
    try:
        assert await _up(proxy_port, process), log.read_text()[-3000:]
        ready = await _ready_until(proxy_port, lambda r: r["kafka"] is True, timeout_s=60.0)
        assert ready["kafka"] is True, log.read_text()[-3000:]
        assert (await post(url, json={**CHAT, "seed": 0}, token=token)).status_code == 200
        chunks = 0
        async with httpx.AsyncClient(timeout=60) as client, client.stream(
                "POST", url, headers=auth(token),
                json={**CHAT, "seed": 1, "stream": True, "max_tokens": 600, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell a story."}]}) as stream:
            assert stream.status_code == 200
            done = False
            async for line in stream.aiter_lines():
                done = done or line == "data: [DONE]"
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 5:
                        os.killpg(process.pid, signal.SIGTERM)
        # Chunks carry one token each or, in continuation mode, what came while the last was parsed.
        assert done, f"the stream was cut short after {chunks} chunks: the drain did not wait for it"
        code = await asyncio.wait_for(process.wait(), 60)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    text = log.read_text()
    assert code in (0, -signal.SIGTERM), text[-3000:]
    try:
        events = await read_events(kafka, registry, expect=2)
        assert sorted(e.request.sampling["seed"] for e in events) == [0, 1]
        streamed = next(e for e in events if e.request.sampling["seed"] == 1)
        assert streamed.status == CallStatus.OK and len(streamed.choices[0].completion_token_ids) == 600
    finally:
        broker.stop()


async def _up(port: int, process: asyncio.subprocess.Process) -> bool:
    """Wait for a proxy process's health endpoint; False if it exited first."""
    for _ in range(600):
        with contextlib.suppress(httpx.HTTPError):
            if (await get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                return True
        if process.returncode is not None:
            return False
        await asyncio.sleep(0.1)
    return False


async def test_a_disk_that_refuses_a_call_record_gets_503_and_loses_no_other_call(
        vllm_url: str, tmp_path: Path, own_broker: LocalBroker) -> None:
    """The journal's disk refuses a record part-way (here a file size limit put on the running
    proxy, which the kernel enforces as it would a full disk): that call is answered 503 with
    Retry-After, so the harness sends it again, the half-written record is taken back, and the
    calls before and after it all reach Kafka. A stream, whose headers went out long before its
    record, ends in its protocol's error instead of its end: for Responses a ``response.failed``
    numbered on from the last event sent, in place of the ``response.completed`` held back. A
    call sent again after a refusal is not linked to the attempt that left no record."""
    broker, kafka, registry = await _private_broker(own_broker)
    proxy_port = free_port()
    process = await _proxy_process(vllm_url, tmp_path / "spool", broker.bootstrap, proxy_port)
    token = mint_token(KEY, "r-disk", Role.AGENT, 600)
    base = f"http://127.0.0.1:{proxy_port}/rollouts/r-disk/v1"
    url = f"{base}/chat/completions"
    try:
        before = [await post(url, json={**CHAT, "seed": i}, token=token) for i in range(2)]
        assert [r.status_code for r in before] == [200, 200]
        segment = max((tmp_path / "spool" / "journal").glob("*.log"))
        size = segment.stat().st_size
        limits = resource.prlimit(process.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (size + 64, limits[1]))
        try:
            refused = await post(url, json={**CHAT, "seed": 2}, token=token)
            streamed = await post(url, json={**CHAT, "seed": 4, "stream": True}, token=token)
            responses = await post(f"{base}/responses", token=token, json={
                "model": "m", "input": "hi", "max_output_tokens": 4, "stream": True})
            messages = await post(f"{base}/messages", token=token, json={**CHAT, "stream": True})
        finally:
            resource.prlimit(process.pid, resource.RLIMIT_FSIZE, limits)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "could not be recorded" in refused.json()["error"]["message"]
        assert streamed.status_code == 200 and b"could not be recorded" in streamed.content
        assert b"[DONE]" not in streamed.content
        assert responses.status_code == 200, responses.text
        sent = [orjson.loads(line[5:]) for line in responses.content.splitlines() if line.startswith(b"data:")]
        kinds = [event["type"] for event in sent]
        assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds
        assert not {"response.completed", "response.incomplete"} & set(kinds), kinds
        assert "could not be recorded" in sent[-1]["response"]["error"]["message"]
        assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
        assert messages.status_code == 200 and b"event: error" in messages.content, messages.text
        assert b"could not be recorded" in messages.content and b"message_stop" not in messages.content
        assert segment.stat().st_size == size  # no half record for the shipper to stop at
        after = await post(url, json={**CHAT, "seed": 3}, token=token)
        assert after.status_code == 200
        events = await read_events(kafka, registry, expect=3)
        assert sorted(e.request.sampling["seed"] for e in events) == [0, 1, 3]
        # The same conversation sent again is not linked to the refused attempts: no event
        # carries their call ids.
        assert [(e.attempt, e.retry_of) for e in events] == [(0, None)] * 3
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()


async def test_a_replica_that_takes_no_connection_is_skipped_and_its_calls_answered_by_another(
        proxy_settings_factory, topics: TopicRegistry, vllm_url: str) -> None:
    """One of two replicas drops every new connection (its accept queue full, as a replica gone
    from the network): the rollouts that hash to it get their answers from the other one, and
    it is taken out of rotation. Before, each of their calls waited out the connect deadline and
    got a 504."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    gone = f"http://127.0.0.1:{listener.getsockname()[1]}"
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(listener.getsockname())
        fillers.append(filler)
    settings = proxy_settings_factory(upstreams=[gone, vllm_url])
    server, task = await serve(settings)
    try:
        pool = server.config.app.state.openforge.upstream
        rollouts = [f"r-gone-{i}" for i in range(8)]
        assert any(pool.order(r)[0] == gone for r in rollouts)  # some of them prefer the gone one
        for rollout in rollouts:
            answer = await post(f"http://127.0.0.1:{settings.port}/rollouts/{rollout}/v1/chat/completions",
                                json=CHAT, token=mint_token(KEY, rollout, Role.AGENT, 60))
            assert answer.status_code == 200, (rollout, answer.text)
        assert all(pool.order(r)[0] == vllm_url for r in rollouts)  # out of rotation
    finally:
        await shutdown(server, task)
        for filler in fillers:
            filler.close()
        listener.close()


async def test_while_the_key_is_rotated_tokens_of_both_keys_call_and_post_rewards(
        proxy_settings_factory: Callable[..., Any], topics: TopicRegistry) -> None:
    from pydantic import SecretStr

    old = b"the-old-signing-key-0123"
    settings = proxy_settings_factory(credential_other_key=SecretStr(old.decode()))
    server, task = await serve(settings)
    running = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    try:
        for key, rollout in ((KEY, "r-new"), (old, "r-old")):
            answered = await post(f"{running.base(rollout)}/v1/chat/completions", json=CHAT,
                                  token=mint_token(key, rollout, Role.AGENT, 600))
            assert answered.status_code == 200, answered.text
        stranger = await post(f"{running.base('r-old')}/v1/chat/completions", json=CHAT,
                              token=mint_token(b"a-key-neither-side-has!!", "r-old", Role.AGENT, 600))
        assert stranger.status_code == 401 and "signature" in stranger.text
        rewarded = await post(f"{running.url}/rollouts/r-old/reward", json={"value": 1.0},
                              token=mint_token(old, "r-old", Role.VERIFIER, 600))
        assert rewarded.status_code == 202, rewarded.text
        assert sorted(e.rollout_id for e in await calls_of(running, 2)) == ["r-new", "r-old"]
        [reward] = await rewards_of(running, 1)
        assert (reward.rollout_id, reward.value) == ("r-old", 1.0)
    finally:
        await shutdown(server, task)
