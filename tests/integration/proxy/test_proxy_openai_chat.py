"""OpenAI Chat Completions through the proxy to real vLLM, captured on the real broker."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
from proxy_helpers import KEY, RunningProxy, calls_of, serve, shutdown

import proxy.service as proxy_service
from proxy.settings import POLICY_SAMPLING
from schemas.call.v1 import ApiProtocol, CallStatus
from schemas.credentials import Role, mint_token

pytestmark = pytest.mark.kafka

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


async def tokenize(vllm_url: str, model: str, messages: list, tools: list | None = None) -> list[int]:
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"{vllm_url}/tokenize", json=body)
    answer.raise_for_status()
    return answer.json()["tokens"]


def client_for(proxy, rollout_id: str, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy.base(rollout_id)}/v1", api_key=proxy.token(rollout_id, task_id="t-1"),
                              max_retries=0, **kwargs)


async def test_non_streaming_call_is_captured_token_exact(proxy, vllm_url) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    async with client_for(proxy, "r-chat") as client:
        answer = await client.chat.completions.create(
            model="anything-the-harness-likes", messages=messages, max_tokens=12, temperature=1.0, logprobs=True,
            extra_body={"return_token_ids": True})
    raw = answer.model_dump()
    assert answer.model == "anything-the-harness-likes"  # echoed as asked, engine name hidden
    [event] = await calls_of(proxy, 1)
    assert event.status is CallStatus.OK and event.protocol is ApiProtocol.OPENAI_CHAT
    assert (event.rollout_id, event.task_id, event.attempt, event.retry_of) == ("r-chat", "t-1", 0, None)
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, messages)
    choice = event.choices[0]
    assert list(choice.completion_token_ids) == raw["choices"][0]["token_ids"]
    assert list(choice.logprobs) == [t["logprob"] for t in raw["choices"][0]["logprobs"]["content"]]
    assert len(choice.completion_token_ids) == answer.usage.completion_tokens
    # The engine's version at the time covers every sampled token.
    assert [(v.start, v.end) for v in choice.weight_versions] == [(0, len(choice.completion_token_ids))]
    assert event.request.messages == messages and event.request.sampling["max_tokens"] == 12
    assert event.session_headers["user-agent"].startswith("AsyncOpenAI")
    assert "authorization" not in event.session_headers
    assert event.timings.time_to_first_token_s is not None


async def test_the_model_list_names_the_engine_s_model_to_both_sdks(proxy, vllm_url) -> None:
    async with httpx.AsyncClient() as http:
        served = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["id"]
    async with client_for(proxy, "r-models") as client:
        listed = [model.id async for model in client.models.list()]
    async with anthropic.AsyncAnthropic(base_url=proxy.base("r-models"), api_key=proxy.token("r-models"),
                                        max_retries=0) as client:
        listed_to_anthropic = [model.id async for model in client.models.list()]
    assert listed == [served] == listed_to_anthropic


async def test_capture_fields_are_stripped_when_the_harness_did_not_ask(proxy) -> None:
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{proxy.base('r-strip')}/v1/chat/completions",
                                 headers={"authorization": f"Bearer {proxy.token('r-strip')}"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert answer.status_code == 200
    body = answer.json()
    assert "prompt_token_ids" not in body
    assert "token_ids" not in body["choices"][0] and body["choices"][0].get("logprobs") is None
    assert "weight_versions" not in body["choices"][0]
    [event] = await calls_of(proxy, 1)
    assert len(event.choices[0].completion_token_ids) == body["usage"]["completion_tokens"]
    assert len(event.choices[0].logprobs) == len(event.choices[0].completion_token_ids)


async def test_streaming_passes_tokens_through_and_captures_them(proxy, vllm_url) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    async with client_for(proxy, "r-stream") as client:
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=16, stream=True,
                                                      logprobs=True, extra_body={"return_token_ids": True})
        chunks = [chunk async for chunk in stream]
        # What the proxy asks the engine for and the harness did not is not in the harness's chunks.
        bare = [chunk async for chunk in await client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, stream=True)]
    streamed_ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {}).get("token_ids") or []]
    streamed_logprobs = [t.logprob for c in chunks for ch in c.choices if ch.logprobs
                         for t in ch.logprobs.content or []]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert all(c.usage is None for c in chunks)  # the usage chunk the proxy asked for stays hidden
    event, bare_event = await calls_of(proxy, 2)
    assert event.streamed and event.status is CallStatus.OK
    assert list(event.choices[0].completion_token_ids) == streamed_ids
    assert list(event.choices[0].logprobs) == streamed_logprobs
    assert event.response["choices"][0]["message"]["content"] == text
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, messages)
    assert event.usage is not None and event.usage.completion_tokens == len(streamed_ids)
    timings = event.timings
    assert timings.time_to_first_token_s is not None and 0 < timings.time_to_first_token_s <= timings.total_s
    assert bare and all(ch.logprobs is None and not {"token_ids", "weight_versions"} & set(ch.model_extra or {})
                        for c in bare for ch in c.choices), bare
    assert len(bare_event.choices[0].logprobs) == len(bare_event.choices[0].completion_token_ids) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_prompt_ids_the_harness_did_not_ask_for_are_cut_unparsed_and_captured_exactly(
        proxy, vllm_url, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    cuts: list[bytes | None] = []
    real = proxy_service.cut_prompt_ids

    def recording(body: bytes) -> tuple[bytes, bytes | None]:
        rest, ids = real(body)
        cuts.append(ids)
        return rest, ids

    monkeypatch.setattr(proxy_service, "cut_prompt_ids", recording)
    messages = [{"role": "user", "content": "Name three colours."}]
    async with client_for(proxy, "r-cut-ids") as client:
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, stream=True)]
            assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks)
        else:
            answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            assert "prompt_token_ids" not in (answer.model_extra or {})
        # Asked for, the ids reach the harness as the engine sent them, and nothing is cut.
        asked = await client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                                     extra_body={"return_token_ids": True})
    first, second = await calls_of(proxy, 2)
    expected = await tokenize(vllm_url, first.model, messages)
    assert len(cuts) == 1 and cuts[0] is not None  # vLLM's JSON is cut as the proxy expects it
    assert (asked.model_extra or {})["prompt_token_ids"] == expected
    assert list(first.prompt_token_ids) == expected == list(second.prompt_token_ids)
    assert first.streamed is stream and first.usage is not None and first.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_tool_requests_reach_the_engine_and_answers_are_relayed_as_sampled(proxy, vllm_url, tool_choice,
                                                                                 stream) -> None:
    # A random tiny model cannot finish a well-formed tool call, so this checks the transport:
    # tools rendered into the prompt exactly as vLLM renders them, and the answer relayed as sampled.
    # Well-formed tool calls in every protocol are covered by the harness tests' scripted engine.
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model="m", messages=messages, tools=WEATHER, tool_choice=tool_choice, max_tokens=24, seed=1)
    async with client_for(proxy, "r-tools") as client:
        if stream:
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
            text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
            calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
        else:
            answer = await client.chat.completions.create(**kwargs)
            text, calls = answer.choices[0].message.content or "", answer.choices[0].message.tool_calls or []
    [event] = await calls_of(proxy, 1)
    assert event.request.tools == WEATHER and event.request.tool_choice == tool_choice
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, messages, WEATHER)
    recorded = event.response["choices"][0]["message"]
    assert (recorded["content"] or "") == text
    assert len(recorded.get("tool_calls") or []) == len({getattr(c, "index", i) for i, c in enumerate(calls)})


async def _label_weights(http: httpx.AsyncClient, vllm_url: str, version: str) -> None:
    (await http.post(f"{vllm_url}/update_weight_version", json={"new_version": version})).raise_for_status()


@contextlib.asynccontextmanager
async def _weight_version_kept(http: httpx.AsyncClient, vllm_url: str) -> AsyncIterator[str]:
    """The engine's weight version, put back on leaving: the session's one engine, the next test reads it."""
    before = (await http.get(f"{vllm_url}/weight_info")).json()["weight_version"]
    try:
        yield before
    finally:
        await _label_weights(http, vllm_url, before)


@pytest.mark.parametrize("continuation", [True, False], ids=["continuation", "chat"])
async def test_calls_carry_the_weight_version_the_engine_serves(
        proxy_settings_factory, topics, vllm_url, continuation: bool) -> None:
    settings = proxy_settings_factory(continuation=continuation)
    server, task = await serve(settings)
    proxy = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    try:
        async with httpx.AsyncClient() as http, _weight_version_kept(http, vllm_url):
            # Asked at once: chat mode reads the version fresh around the call, no cached reading.
            await _label_weights(http, vllm_url, "41")
            answer = await http.post(f"{proxy.base('r-ver')}/v1/chat/completions",
                                     headers={"authorization": f"Bearer {proxy.token('r-ver')}"},
                                     json={"model": "m", "messages": [{"role": "user", "content": "v?"}],
                                           "max_tokens": 3})
            assert answer.status_code == 200
        [event] = await calls_of(proxy, 1)
    finally:
        await shutdown(server, task)
    assert [v.version for v in event.choices[0].weight_versions] == ["41"]


@pytest.mark.parametrize("continuation", [True, False], ids=["continuation", "chat"])
async def test_a_version_update_during_a_call_is_never_labelled_as_one_version(
        proxy_settings_factory, topics, vllm_url, continuation: bool) -> None:
    """The weights' label changes while the answer streams. Continuation records the engine's
    spans, one per version; chat mode's readings around the call differ, so the version is unknown."""
    settings = proxy_settings_factory(continuation=continuation)
    server, task = await serve(settings)
    proxy = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    try:
        async with httpx.AsyncClient(timeout=120) as http, _weight_version_kept(http, vllm_url) as before:
            async with http.stream("POST", f"{proxy.base('r-mid')}/v1/chat/completions",
                                   headers={"authorization": f"Bearer {proxy.token('r-mid')}"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "Go on."}],
                                         "max_tokens": 300, "stream": True, "seed": 4}) as answer:
                assert answer.status_code == 200
                lines = answer.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):  # sampling has begun
                        break
                # As a publish does: the engine holds the request (pause, keep) while its
                # weights change, so the rest of the answer comes from the new version
                # however fast the engine samples.
                (await http.post(f"{vllm_url}/pause", params={"mode": "keep"})).raise_for_status()
                try:
                    await _label_weights(http, vllm_url, "mid-1")
                finally:
                    (await http.post(f"{vllm_url}/resume")).raise_for_status()
                async for _ in lines:
                    pass
        [event] = await calls_of(proxy, 1)
    finally:
        await shutdown(server, task)
    choice = event.choices[0]
    assert event.status is CallStatus.OK and len(choice.completion_token_ids) > 3
    if continuation:
        assert [v.version for v in choice.weight_versions] == [str(before), "mid-1"]
        assert choice.weight_versions[0].start == 0 and choice.weight_versions[-1].end == len(
            choice.completion_token_ids)
    else:
        assert choice.weight_versions == []


async def test_a_rollout_s_calls_stick_to_one_replica_and_rollouts_spread_over_all(
        proxy_settings_factory, topics, vllm_url) -> None:
    """Two replicas: the one real engine by address and by name. Every call of a rollout goes
    to the same one (its prefix cache holds the conversation so far), and rollouts spread over both."""
    port = vllm_url.rsplit(":", 1)[1]
    replicas = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
    settings = proxy_settings_factory(upstreams=replicas)
    proxy = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    rollouts = [f"r-stick-{i}" for i in range(16)]  # all on one replica by chance: 2 in 65,536
    server, task = await serve(settings)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for turn in range(2):
                for rollout in rollouts:
                    answer = await http.post(f"{proxy.base(rollout)}/v1/chat/completions",
                                             headers={"authorization": f"Bearer {proxy.token(rollout)}"},
                                             json={"model": "m", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": f"turn {turn}"}]})
                    assert answer.status_code == 200, answer.text
    finally:
        await shutdown(server, task)
    events = await calls_of(proxy, 2 * len(rollouts))
    served: dict[str, set[str | None]] = {}
    for event in events:
        served.setdefault(event.rollout_id, set()).add(event.upstream_replica)
    assert sorted(served) == sorted(rollouts) and all(len(by) == 1 for by in served.values()), served
    assert set().union(*served.values()) == set(replicas), served


async def test_forced_sampling_reaches_the_engine_whatever_the_harness_asked(proxy_settings_factory, topics) -> None:
    # The harness asks for greedy answers; the proxy is set to sample as the policy does
    # (temperature 1, nothing cut). A greedy tiny model answers the same prompt the same way every
    # time; at temperature 1 over its 4,096 tokens, eight tokens repeat only by a tiny chance.
    settings = proxy_settings_factory(sampling=POLICY_SAMPLING)
    server, task = await serve(settings)
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{settings.port}/rollouts/r-policy/v1",
                                      api_key=mint_token(KEY, "r-policy", Role.AGENT, 60), max_retries=0) as client:
            answers = [await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Say something"}], max_tokens=8, temperature=0,
                top_p=0.5, seed=7 + i) for i in range(4)]
            # A Responses answer echoes its sampling: the values the engine got, not the harness's.
            echoed = await client.responses.create(model="m", input="Say something", max_output_tokens=16,
                                                   temperature=0, top_p=0.5)
    finally:
        await shutdown(server, task)
    assert len({a.choices[0].message.content for a in answers}) > 1, [a.choices[0].message.content for a in answers]
    assert (echoed.temperature, echoed.top_p) == (POLICY_SAMPLING["temperature"], POLICY_SAMPLING["top_p"])
    events = await calls_of(RunningProxy("", settings, topics), 5)
    # The event records what the engine got; what sampling does not force stays the harness's.
    assert [e.request.sampling for e in events[:4]] == [{**POLICY_SAMPLING, "max_tokens": 8, "seed": 7 + i}
                                                        for i in range(4)]
    assert events[4].request.sampling["temperature"] == POLICY_SAMPLING["temperature"]


async def test_a_field_that_bends_sampling_is_refused_by_name_and_the_budget_fits_the_context(
        proxy, vllm_url) -> None:
    # Through the openai SDK, as a harness sends them: an OpenAI field and a vLLM one (extra_body).
    async with client_for(proxy, "r-fields") as client:
        with pytest.raises(openai.BadRequestError, match="logit_bias") as bias:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 logit_bias={"12": -100}, max_tokens=2)
        with pytest.raises(openai.BadRequestError) as tokens:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, extra_body={"min_tokens": 2})
        # Over the engine's context, which vLLM refuses: lowered to it, and vLLM lowers it to what
        # the prompt leaves.
        answer = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=32_000, extra_body={"store": False})
    assert (bias.value.param, tokens.value.param) == ("logit_bias", "min_tokens")
    assert answer.choices[0].finish_reason in ("stop", "length")
    async with httpx.AsyncClient() as http:
        context = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["max_model_len"]
    refused_bias, refused_tokens, fitted = await calls_of(proxy, 3)
    assert refused_bias.status is refused_tokens.status is CallStatus.INVALID_REQUEST
    assert fitted.status is CallStatus.OK and fitted.request.sampling["max_tokens"] == context
    assert "store" not in fitted.request.extra  # dropped: not the engine's to see


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_conversation_s_events_store_only_new_prompt_ids_and_rebuild_whole(proxy, vllm_url, stream) -> None:
    from proxy_helpers import read_events

    from stream import CALLS

    messages: list = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count."}]
    async with client_for(proxy, "r-linear") as client:
        for turn in range(3):
            kwargs = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 1.0, "logprobs": True}
            if stream:
                async for _ in await client.chat.completions.create(stream=True, **kwargs):
                    pass
            else:
                await client.chat.completions.create(**kwargs)
            messages = [*messages, {"role": "assistant", "content": "one"}, {"role": "user", "content": f"And {turn}?"}]
    stored = await read_events(proxy.settings.kafka, proxy.registry, CALLS, expect=3, whole=False)
    events = await calls_of(proxy, 3)
    assert [e.call_id for e in stored] == [e.call_id for e in events]
    assert [e.prompt_prefix is not None for e in stored] == [False, True, True]
    for before, event, whole in zip(events, stored[1:], events[1:], strict=False):
        # The template re-renders the sampled turn: the prompt forks inside it, so the reference
        # covers at least the earlier prompt, and only the ids after it are stored.
        assert event.prompt_prefix is not None and event.prompt_prefix.call_id == before.call_id
        assert event.prompt_prefix.tokens >= len(before.prompt_token_ids)
        assert len(event.prompt_token_ids) == len(whole.prompt_token_ids) - event.prompt_prefix.tokens
        # The messages the harness sent again are referenced too: the event holds the two new ones.
        assert event.prompt_prefix.messages == len(before.request.messages) and len(event.request.messages) == 2
    for event, asked in zip(events, [messages[:2], messages[:4], messages[:6]], strict=True):
        assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, asked)
