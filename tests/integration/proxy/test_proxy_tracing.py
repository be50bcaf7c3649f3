"""Each call is a server span with an upstream client span, and its event carries the trace."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from meters import counter_values, histogram_counts, memory_reader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from proxy_helpers import RunningProxy, read_events, serve, shutdown
from spans import memory_exporter

from schemas.call.linear import WholeCalls
from schemas.registry import decode
from stream import CALLS

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    return memory_exporter()


async def _chat(http: httpx.AsyncClient, proxy: RunningProxy, rollout: str, *, stream: bool) -> None:
    answer = await http.post(f"{proxy.base(rollout)}/v1/chat/completions",
                             headers={"authorization": f"Bearer {proxy.token(rollout)}"},
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 3, "stream": stream})
    assert answer.status_code == 200


async def test_call_spans_and_event_trace_context(spans: InMemorySpanExporter, proxy) -> None:
    spans.clear()
    memory_reader()  # instruments record only once a provider is installed
    latency_before = histogram_counts("openforge.proxy.added_latency")
    tokens_before = counter_values("openforge.proxy.tokens")
    async with httpx.AsyncClient(timeout=60) as http:
        for stream in (False, True):
            await _chat(http, proxy, "r-trace", stream=stream)
    consumer = AIOKafkaConsumer(proxy.registry[CALLS].name, bootstrap_servers=proxy.settings.kafka.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    records = []
    try:
        while len(records) < 2:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    await asyncio.sleep(0.2)
    finished = spans.get_finished_spans()
    calls = [s for s in finished if "openforge.call_id" in (s.attributes or {})]
    clients = [s for s in finished if s.kind is SpanKind.CLIENT]
    assert len(calls) == 2 and len(clients) == 2, [(s.name, s.kind) for s in finished]
    # Named by route: one span name for every rollout, the rollout an attribute.
    assert {s.name for s in calls} == {"POST /rollouts/{rollout_id}/v1/chat/completions"}
    assert {(s.attributes or {})["openforge.rollout_id"] for s in calls} == {"r-trace"}
    # The call span is the request's server span, or nests in the framework's server span.
    by_id = {s.context.span_id: s for s in finished}
    for span in calls:
        kinds, node = [span.kind], span
        while node.parent is not None and node.parent.span_id in by_id:
            node = by_id[node.parent.span_id]
            kinds.append(node.kind)
        assert SpanKind.SERVER in kinds
    servers = calls
    for client in clients:
        assert client.parent is not None and client.parent.span_id in {s.context.span_id for s in servers}
    carried = {dict(r.headers)["traceparent"].decode().split("-")[1] for r in records}
    assert carried == {f"{s.context.trace_id:032x}" for s in servers}
    # The proxy's added latency is measured for whole answers and streams alike.
    latency = histogram_counts("openforge.proxy.added_latency")
    for streamed in (False, True):
        key = (("protocol", "openai_chat"), ("streamed", streamed))
        assert latency.get(key, 0) - latency_before.get(key, 0) == 1, latency
    # Tokens are counted as the calls were: the whole prompts the engine saw (an event may store
    # the part it repeats by reference), what it sampled.
    calls = WholeCalls()
    events = [calls.whole(decode(r.headers, r.value)) for r in records]
    tokens = counter_values("openforge.proxy.tokens")
    counted = {kind: tokens.get((("kind", kind),), 0) - tokens_before.get((("kind", kind),), 0)
               for kind in ("prompt", "completion")}
    assert counted == {"prompt": sum(len(e.prompt_token_ids) for e in events),
                       "completion": sum(len(e.choices[0].completion_token_ids) for e in events)}, counted
    assert counted["completion"] > 0


async def test_a_call_continues_the_trace_the_harness_sent(spans: InMemorySpanExporter, proxy) -> None:
    spans.clear()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(f"{proxy.base('r-parent')}/v1/chat/completions",
                                 headers={"authorization": f"Bearer {proxy.token('r-parent')}",
                                          "traceparent": f"00-{trace_id}-{parent_id}-01"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 3})
        assert answer.status_code == 200
    await asyncio.sleep(0.2)
    calls = [s for s in spans.get_finished_spans() if (s.attributes or {}).get("openforge.rollout_id") == "r-parent"]
    assert len(calls) == 1
    assert f"{calls[0].context.trace_id:032x}" == trace_id
    assert calls[0].parent is not None and f"{calls[0].parent.span_id:016x}" == parent_id


async def test_with_capture_off_calls_are_counted_but_not_published(proxy_settings_factory, topics) -> None:
    """Capture off (the benchmark's baseline) still reports calls and tokens; only the events go."""
    memory_reader()
    settings = proxy_settings_factory(capture=False)
    proxy = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    rollout = "r-nocapture"
    before = counter_values("openforge.proxy.calls")
    ttft_before = histogram_counts("openforge.proxy.time_to_first_token")
    server, task = await serve(settings)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for stream in (False, True):
                await _chat(http, proxy, rollout, stream=stream)
    finally:
        await shutdown(server, task)
    ok = (("protocol", "openai_chat"), ("status", "ok"))
    assert counter_values("openforge.proxy.calls").get(ok, 0) - before.get(ok, 0) == 2
    assert sum(histogram_counts("openforge.proxy.time_to_first_token").values()) - sum(ttft_before.values()) == 2
    events = await read_events(settings.kafka, topics, CALLS, expect=1, timeout_s=3.0)
    assert [e for e in events if e.rollout_id == rollout] == []
