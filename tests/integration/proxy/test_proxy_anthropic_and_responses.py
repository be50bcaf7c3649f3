"""Anthropic Messages and OpenAI Responses through the proxy to real vLLM: translated both ways,
captured token-exact with the translated prompt."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
from proxy_helpers import RunningProxy, calls_of, serve, shutdown
from test_proxy_openai_chat import tokenize

from proxy.media import IMAGE_PLACEHOLDER
from proxy.reasoning import signature
from proxy.service import ABORTED, ENGINE_ABORTED, ENGINE_UNFINISHED, UNFINISHED
from schemas.call.v1 import ApiProtocol, CallStatus

pytestmark = pytest.mark.kafka

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city.",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}]


def anthropic_client(proxy, rollout_id: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.base(rollout_id), api_key=proxy.token(rollout_id), max_retries=0)


async def test_anthropic_messages_whole(proxy, vllm_url) -> None:
    async with anthropic_client(proxy, "r-anth") as client:
        message = await client.messages.create(
            model="claude-opus-4-7", max_tokens=10, system=[{"type": "text", "text": "Be brief."}],
            messages=[{"role": "user", "content": "Hello there"}])
    assert message.model == "claude-opus-4-7" and message.role == "assistant"
    assert message.stop_reason in {"end_turn", "max_tokens"}
    [event] = await calls_of(proxy, 1)
    assert event.protocol is ApiProtocol.ANTHROPIC_MESSAGES and event.status is CallStatus.OK
    chat_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert event.request.messages == chat_messages
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, chat_messages)
    assert len(event.choices[0].completion_token_ids) == message.usage.output_tokens
    text = "".join(b.text for b in message.content if b.type == "text")
    assert (event.response["choices"][0]["message"]["content"] or "") == text


async def test_anthropic_messages_streamed_with_tools_and_beta_flag(proxy, vllm_url) -> None:
    async with anthropic_client(proxy, "r-anth-s") as client:
        async with client.beta.messages.stream(
            model="claude-opus-4-7", max_tokens=16, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
            starts = [e.message.usage async for e in stream if e.type == "message_start"]
            final = await stream.get_final_message()
    assert final.stop_reason in {"tool_use", "max_tokens", "end_turn"}
    [event] = await calls_of(proxy, 1)
    assert event.streamed and event.protocol is ApiProtocol.ANTHROPIC_MESSAGES
    assert event.request.tool_choice == "required"
    assert event.request.tools[0]["function"]["name"] == "get_weather"
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, event.request.messages,
                                                          event.request.tools)
    assert len(event.choices[0].completion_token_ids) == final.usage.output_tokens
    # message_start already tells the harness the prompt's size, as Anthropic's API does.
    [start] = starts
    assert start.input_tokens + (start.cache_read_input_tokens or 0) == len(event.prompt_token_ids)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == len(event.prompt_token_ids)


async def test_anthropic_count_tokens_matches_the_engine(proxy, vllm_url) -> None:
    async with anthropic_client(proxy, "r-count") as client:
        counted = await client.messages.count_tokens(model="claude-opus-4-7",
                                                     messages=[{"role": "user", "content": "Count me"}])
        # A prefill is counted as the call renders it: the last turn continued, not closed.
        prefilled = await client.messages.count_tokens(model="claude-opus-4-7", messages=[
            {"role": "user", "content": "Count me"}, {"role": "assistant", "content": "I count"}])
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["id"]
        continued = (await http.post(f"{vllm_url}/tokenize", json={
            "model": models, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Count me"}, {"role": "assistant", "content": "I count"}]})).json()
    assert counted.input_tokens == len(await tokenize(vllm_url, models, [{"role": "user", "content": "Count me"}]))
    assert prefilled.input_tokens == continued["count"]


async def test_anthropic_paths_with_the_beta_flag_are_served(proxy, vllm_url) -> None:
    """Claude Code sends its calls to ``/v1/messages?beta=true`` and counts tokens at
    ``/v1/messages/count_tokens?beta=true``, with a beta header."""
    headers = {"x-api-key": proxy.token("r-beta"), "anthropic-version": "2023-06-01",
               "anthropic-beta": "interleaved-thinking-2025-05-14"}
    messages = [{"role": "user", "content": "Hello there"}]
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(f"{proxy.base('r-beta')}/v1/messages?beta=true", headers=headers,
                                 json={"model": "claude-opus-4-7", "max_tokens": 4, "messages": messages})
        counted = await http.post(f"{proxy.base('r-beta')}/v1/messages/count_tokens?beta=true", headers=headers,
                                  json={"model": "claude-opus-4-7", "messages": messages})
    assert answer.status_code == 200 and answer.json()["type"] == "message", answer.text
    [event] = await calls_of(proxy, 1)
    assert event.protocol is ApiProtocol.ANTHROPIC_MESSAGES and event.status is CallStatus.OK
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == len(event.prompt_token_ids) == len(
        await tokenize(vllm_url, event.model, messages))


async def test_translated_calls_capture_the_ids_and_logprobs_the_engine_samples(proxy, vllm_url) -> None:
    """Greedy, so the engine given the event's prompt ids again samples the same tokens: the
    Anthropic and Responses calls' events (whole and streamed) hold vLLM's own ids and logprobs."""
    async with anthropic_client(proxy, "r-exact-a") as client:
        await client.messages.create(model="claude-opus-4-7", max_tokens=12, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Name a colour."}])
    async with responses_client(proxy, "r-exact-r") as client:
        async with client.responses.stream(model="gpt-5-codex", input="Name a fruit.", max_output_tokens=12,
                                           temperature=0) as stream:
            kinds = [event.type async for event in stream]
    assert kinds[-1] in {"response.completed", "response.incomplete"}, kinds
    events = await calls_of(proxy, 2)
    assert [e.protocol for e in events] == [ApiProtocol.ANTHROPIC_MESSAGES, ApiProtocol.OPENAI_RESPONSES]
    async with httpx.AsyncClient(timeout=60) as http:
        for event in events:
            choice = event.choices[0]
            direct = await http.post(f"{vllm_url}/v1/completions", json={
                "model": event.model, "prompt": list(event.prompt_token_ids), "max_tokens": 12, "temperature": 0,
                "logprobs": 0, "return_token_ids": True})
            direct.raise_for_status()
            sampled = direct.json()["choices"][0]
            assert len(choice.completion_token_ids) > 0
            assert list(choice.completion_token_ids) == sampled["token_ids"]
            assert list(choice.logprobs) == pytest.approx(sampled["logprobs"]["token_logprobs"], abs=1e-3)


async def test_translated_tool_histories_reach_the_engine_as_its_template_renders_them(proxy, vllm_url) -> None:
    """A second turn after a tool ran, in each translated API (with Responses' developer role):
    the engine gets it as chat messages its own template renders, the tool's result under the
    call's id, and the event's prompt ids are that rendering."""
    async with anthropic_client(proxy, "r-hist-a") as client:
        await client.messages.create(model="claude-opus-4-7", max_tokens=4, tools=ANTHROPIC_TOOLS, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking it up."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C"}]}])
    async with responses_client(proxy, "r-hist-r") as client:
        await client.responses.create(model="gpt-5-codex", max_output_tokens=4, tools=RESPONSES_TOOLS, input=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21C"}])
    events = await calls_of(proxy, 2)
    for event, call_id in zip(events, ("toolu_1", "call_1"), strict=True):
        assert event.status is CallStatus.OK, event.error_message
        messages = event.request.messages
        [called] = [m for m in messages if m.get("tool_calls")]
        assert [(c["id"], c["function"]["name"]) for c in called["tool_calls"]] == [(call_id, "get_weather")]
        assert json.loads(called["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        assert messages[-1] == {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21C"}
        assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, messages, event.request.tools)
    assert events[1].request.messages[0]["role"] in {"system", "developer"}


async def test_unsupported_anthropic_feature_gets_400_naming_the_field(proxy) -> None:
    async with anthropic_client(proxy, "r-doc") as client:
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
            await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                "data": "JVBERi0="}}]}])
    [event] = await calls_of(proxy, 1)
    assert event.status is CallStatus.INVALID_REQUEST
    assert "messages[0].content[0].type" in event.error_message
    assert event.request.extra["untranslated"]["messages"][0]["content"][0]["type"] == "document"


async def test_a_refused_request_is_recorded_once_without_its_media_or_its_deepest_nesting(proxy) -> None:
    # The body is the study material of a refusal, but a screenshot's base64 (refused by default)
    # would take the event past the topic's limit, and a body nested 300 deep past what the
    # event's decoder reads: either way the record would end in the dead-letter topic.
    screenshot = "iVBORw0K" * (256 * 1024)  # 2 MiB of base64
    async with anthropic_client(proxy, "r-refused-image") as client:
        with pytest.raises(anthropic.BadRequestError, match="OPENFORGE_PROXY_IMAGES"):
            await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": screenshot}}]}])
    def nested(levels: int) -> object:
        value: object = "deep"
        for _ in range(levels):
            value = [value]
        return value

    # Deep in the conversation, in a field chat passes to the engine as it came, or in one a
    # Responses answer copies back from its request. 300 levels are past what JSON is written to
    # (254); 252 are not, but the call's record holds the field two levels deeper, so that body
    # would be answered and then fail to be recorded (it got a 500 and left no event).
    bodies = {"r-refused-deep": ("chat/completions", {"model": "m", "messages": [{"role": "user",
                                                                                   "content": nested(300)}]}),
              "r-refused-deep-metadata": ("chat/completions", {"model": "m", "stream": True,
                                                               "stream_options": {"trace": nested(300)},
                                                               "messages": [{"role": "user", "content": "hi"}]}),
              "r-refused-deep-responses": ("responses", {"model": "m", "input": "hi",
                                                         "metadata": {"trace": nested(300)}}),
              "r-refused-writable": ("chat/completions", {"model": "m", "max_tokens": 4, "stream": True,
                                                          "stream_options": {"trace": nested(252)},
                                                          "messages": [{"role": "user", "content": "hi"}]})}
    async with httpx.AsyncClient(timeout=30) as http:
        for rollout, (path, body) in bodies.items():
            answer = await http.post(f"{proxy.base(rollout)}/v1/{path}",
                                     headers={"authorization": f"Bearer {proxy.token(rollout)}"}, json=body)
            assert answer.status_code == 400 and "nests deeper than 128 levels" in answer.text, (rollout, answer.text)
        # The most a request may nest (128 levels, the body counted) is answered and recorded whole.
        answer = await http.post(f"{proxy.base('r-deepest')}/v1/chat/completions",
                                 headers={"authorization": f"Bearer {proxy.token('r-deepest')}"},
                                 json={"model": "m", "max_tokens": 4, "stream": True,
                                       "stream_options": {"trace": nested(126)},
                                       "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
    events = {e.rollout_id: e for e in await calls_of(proxy, 6)}
    assert events["r-refused-deep-metadata"].status is events["r-refused-deep-responses"].status \
        is events["r-refused-writable"].status is CallStatus.INVALID_REQUEST
    assert events["r-deepest"].status is CallStatus.OK
    assert events["r-deepest"].request.extra["stream_options"] == {"trace": nested(126)}
    image, deep = events["r-refused-image"], events["r-refused-deep"]
    assert image.status is deep.status is CallStatus.INVALID_REQUEST
    assert image.request.messages == [] and deep.request.messages == []  # the body once, not twice
    parts = image.request.extra["untranslated"]["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "What is this?"}
    data = parts[1]["source"]["data"]
    assert data.startswith(screenshot[:256]) and data.endswith(f"[{len(screenshot) - 256} more characters not recorded]")
    level = deep.request.extra["untranslated"]["messages"][0]["content"]
    depth = 3  # body, messages, the message
    while isinstance(level, list):
        level, depth = level[0], depth + 1
    assert level == "[nested deeper than 64 levels; not recorded]" and depth == 64


async def test_a_refused_body_of_many_texts_is_recorded_on_the_calls_topic_cut_to_its_limit(proxy) -> None:
    # 300 texts of 60,000 characters: each under the per-string cut, together 18 MB, over the
    # calls topic's 16 MiB. The record keeps the first megabyte of it and a marker for the rest,
    # so its event is on the calls topic, not the dead-letter topic.
    texts = [{"type": "text", "text": chr(65 + i % 26) * 60_000} for i in range(300)]
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        *texts]}]}
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(f"{proxy.base('r-refused-texts')}/v1/messages", json=body,
                                 headers={"x-api-key": proxy.token("r-refused-texts"), "anthropic-version": "2023-06-01"})
    assert answer.status_code == 400 and "messages[0].content[0].type" in answer.text, answer.text
    [event] = await calls_of(proxy, 1)
    assert event.status is CallStatus.INVALID_REQUEST
    content = event.request.extra["untranslated"]["messages"][0]["content"]
    assert content[0]["type"] == "document" and content[1:-1] == texts[:len(content) - 2]
    assert re.fullmatch(r"\[\d+ more items not recorded: the record's limit\]", content[-1])



async def test_a_refusal_quoting_a_huge_value_is_cut_in_the_answer_and_the_record(proxy) -> None:
    # The refusal quotes the value it refuses; a 5 MB one would have been quoted whole.
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(f"{proxy.base('r-refused-quote')}/v1/messages",
                                 json={"model": "m", "max_tokens": "9" * 5_000_000,
                                       "messages": [{"role": "user", "content": "hi"}]},
                                 headers={"x-api-key": proxy.token("r-refused-quote"), "anthropic-version": "2023-06-01"})
    assert answer.status_code == 400 and "max_tokens" in answer.text
    assert len(answer.content) < 6_000
    [event] = await calls_of(proxy, 1)
    assert event.status is CallStatus.INVALID_REQUEST
    assert event.error_message.startswith("max_tokens") and event.error_message.endswith(" more characters]")
    assert len(event.error_message) < 4_200


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


@contextlib.asynccontextmanager
async def _serving(settings, topics) -> AsyncIterator[RunningProxy]:
    server, task = await serve(settings)
    try:
        yield RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)
    finally:
        await shutdown(server, task)


@pytest.fixture
async def proxy_with_images(proxy_settings_factory, topics) -> AsyncIterator[RunningProxy]:
    async with _serving(proxy_settings_factory(images="inline"), topics) as proxy:
        yield proxy


async def test_images_reach_the_engine_which_answers_for_its_model(proxy_with_images) -> None:
    # With images on, they are translated to chat image parts and go to the engine, as a
    # chat-completions client's do: a vision model sees them. The suite's model reads text only,
    # so its engine refuses them itself, and that refusal reaches each harness in its own shape.
    proxy = proxy_with_images
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    async with anthropic_client(proxy, "r-img") as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}])
    async with responses_client(proxy, "r-img-resp") as responses:
        with pytest.raises(openai.BadRequestError) as refused_too:
            await responses.responses.create(model="m", max_output_tokens=5, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}])
    assert "multimodal" in str(refused.value) and "multimodal" in str(refused_too.value)
    events = sorted(await calls_of(proxy, 2), key=lambda e: e.rollout_id)
    assert [(e.rollout_id, e.status, e.upstream_status_code) for e in events] == [
        ("r-img", CallStatus.UPSTREAM_ERROR, 400), ("r-img-resp", CallStatus.UPSTREAM_ERROR, 400)]
    for event in events:
        assert event.request.messages[-1]["content"] == [{"type": "text", "text": "What is this?"}, image]


@pytest.fixture
async def proxy_with_placeholders(proxy_settings_factory, topics) -> AsyncIterator[RunningProxy]:
    async with _serving(proxy_settings_factory(images="placeholder"), topics) as proxy:
        yield proxy


async def test_images_become_a_line_of_text_the_text_model_answers_under_placeholder(
        proxy_with_placeholders, vllm_url) -> None:
    # A harness resends its whole conversation, so under the default one image fails every later
    # call of the rollout; with placeholders each protocol's image (by data or by URL) reaches the
    # text-only engine as a line saying it was left out, and is captured token-exact as such.
    proxy = proxy_with_placeholders
    async with anthropic_client(proxy, "r-ph-anthropic") as client:
        message = await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}])
    async with responses_client(proxy, "r-ph-responses") as responses:
        response = await responses.responses.create(model="m", max_output_tokens=5, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}])
        chat = await responses.chat.completions.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert message.stop_reason in {"end_turn", "max_tokens"} and response.status in {"completed", "incomplete"}
    assert chat.choices[0].finish_reason in {"stop", "length"}
    events = {e.protocol: e for e in await calls_of(proxy, 3)}
    joined = [{"role": "user", "content": f"What is this?\n{IMAGE_PLACEHOLDER}"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "text", "text": IMAGE_PLACEHOLDER}]}]
    for protocol, messages in [(ApiProtocol.ANTHROPIC_MESSAGES, joined), (ApiProtocol.OPENAI_RESPONSES, parts),
                               (ApiProtocol.OPENAI_CHAT, parts)]:
        event = events[protocol]
        assert event.status is CallStatus.OK and event.request.messages == messages, protocol
        assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, messages), protocol


def responses_client(proxy, rollout_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy.base(rollout_id)}/v1", api_key=proxy.token(rollout_id), max_retries=0)


async def test_responses_whole(proxy, vllm_url) -> None:
    async with responses_client(proxy, "r-resp") as client:
        response = await client.responses.create(model="gpt-5-codex", instructions="Be brief.", input="Hi",
                                                 max_output_tokens=10)
    assert response.model == "gpt-5-codex" and response.status in {"completed", "incomplete"}
    [event] = await calls_of(proxy, 1)
    assert event.protocol is ApiProtocol.OPENAI_RESPONSES
    chat_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert event.request.messages == chat_messages
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, chat_messages)
    assert (event.response["choices"][0]["message"]["content"] or "") == response.output_text
    assert len(event.choices[0].completion_token_ids) == response.usage.output_tokens


async def test_responses_streamed_with_tools(proxy, vllm_url) -> None:
    async with responses_client(proxy, "r-resp-s") as client:
        stream = await client.responses.create(model="gpt-5-codex", input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                               tool_choice="required", max_output_tokens=16, stream=True)
        events = [e async for e in stream]
    # A random model runs out of tokens mid tool call: the stream must still end properly.
    assert events[0].type == "response.created"
    assert events[-1].type in {"response.completed", "response.incomplete"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    [event] = await calls_of(proxy, 1)
    assert event.streamed and event.protocol is ApiProtocol.OPENAI_RESPONSES
    assert event.request.tool_choice == "required"
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, event.request.messages,
                                                          event.request.tools)
    assert len(event.choices[0].completion_token_ids) == final.usage.output_tokens


@pytest.mark.parametrize("api", ["anthropic", "responses"])
async def test_a_named_tool_choice_reaches_the_engine_in_chat_s_shape(proxy, vllm_url, api: str) -> None:
    """Each SDK names the tool to call in its own shape; the engine gets chat's named choice, and
    the harness gets what the engine answered. (A random tiny model rarely finishes the call
    before its token limit, so this checks the transport, as the chat test does; whole tool
    calls in every protocol are covered by the harness tests' scripted engine.)"""
    prompt = "Weather in Paris?"
    if api == "anthropic":
        async with anthropic_client(proxy, "r-named-a") as client:
            message = await client.messages.create(
                model="claude-opus-4-7", max_tokens=48, tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": prompt}])
        names = [b.name for b in message.content if b.type == "tool_use"]
        text = "".join(b.text for b in message.content if b.type == "text")
    else:
        async with responses_client(proxy, "r-named-r") as client:
            response = await client.responses.create(model="gpt-5-codex", input=prompt, tools=RESPONSES_TOOLS,
                                                     tool_choice={"type": "function", "name": "get_weather"},
                                                     max_output_tokens=48)
        names = [o.name for o in response.output if o.type == "function_call"]
        text = response.output_text
    [event] = await calls_of(proxy, 1)
    assert event.request.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, event.request.messages,
                                                          event.request.tools)
    engine = event.response["choices"][0]["message"]
    assert names == [c["function"]["name"] for c in engine.get("tool_calls") or []]
    assert text == (engine["content"] or "")


async def test_responses_previous_response_id_is_refused_by_name(proxy) -> None:
    async with responses_client(proxy, "r-prev") as client:
        with pytest.raises(openai.BadRequestError, match="previous_response_id") as refused:
            await client.responses.create(model="m", input="again", previous_response_id="resp_123")
        assert refused.value.param == "previous_response_id"  # the SDK's own field for it
        with pytest.raises(openai.BadRequestError) as refused_part:
            await client.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_file", "file_id": "file_1"}]}])
        assert refused_part.value.param == "input[0].content[0].type", refused_part.value.body


async def test_output_ceiling_over_the_engines_context_is_lowered(proxy, vllm_url) -> None:
    """Claude Code asks for 32,000 output tokens whatever the model; vLLM refuses a max_tokens
    over its context length. Calls get the engine's context length as their ceiling (the event
    records what the engine got), chat completions as well."""
    async with httpx.AsyncClient() as http:
        context = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["max_model_len"]
    assert context < 32_000
    async with anthropic_client(proxy, "r-ceiling") as client:
        async with client.messages.stream(model="claude-opus-4-7", max_tokens=32_000,
                                          messages=[{"role": "user", "content": "Write a long story."}]) as stream:
            async for event in stream:
                if event.type == "content_block_delta":
                    break  # generating: the engine took the call; leaving ends it early
    [recorded] = await calls_of(proxy, 1)
    assert recorded.protocol is ApiProtocol.ANTHROPIC_MESSAGES
    assert recorded.request.sampling["max_tokens"] == context
    assert recorded.status in {CallStatus.CLIENT_DISCONNECTED, CallStatus.OK}
    async with responses_client(proxy, "r-ceiling-chat") as chat:  # the same client speaks chat
        await chat.chat.completions.create(model="m", max_tokens=32_000, messages=[{"role": "user", "content": "Hi"}])
    [_, chat_call] = await calls_of(proxy, 2)
    assert chat_call.status is CallStatus.OK and chat_call.request.sampling["max_tokens"] == context


async def test_an_answer_that_fills_the_context_says_so_to_an_anthropic_harness(proxy, vllm_url) -> None:
    """An answer cut where the context ends, short of the harness's max_tokens, is Anthropic's
    model_context_window_exceeded, whole or streamed (Claude Code reports a full context on it,
    and a spent budget on max_tokens); the event keeps the engine's own finish reason."""
    async with httpx.AsyncClient() as http:
        model = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]
    context = model["max_model_len"]
    line = "the quick brown fox jumps over the lazy dog "

    async def prompt_tokens(repeats: int) -> int:
        return len(await tokenize(vllm_url, model["id"], [{"role": "user", "content": line * repeats}]))

    one, two = await prompt_tokens(1), await prompt_tokens(2)
    repeats = (context - 12 - one) // (two - one) + 1  # a prompt that leaves the answer a dozen tokens or so
    room = context - await prompt_tokens(repeats)
    assert 0 < room <= 12 + (two - one), room
    messages = [{"role": "user", "content": line * repeats}]
    async with anthropic_client(proxy, "r-full") as client:
        # Greedy, so the answer is the same every run (a stop token at once would end the turn).
        greedy = {"top_k": 1}  # Anthropic's field, which this SDK's create() does not name
        # Over the engine's context, as Claude Code's 32,000 (which the SDK refuses to wait for whole).
        whole = await client.messages.create(model="claude-opus-4-7", max_tokens=4_096, messages=messages,
                                             extra_body=greedy)
        async with client.messages.stream(model="claude-opus-4-7", max_tokens=32_000, extra_body=greedy,
                                          messages=messages) as stream:
            streamed = await stream.get_final_message()
        budget = await client.messages.create(model="claude-opus-4-7", max_tokens=room - 1, messages=messages,
                                              extra_body=greedy)
    assert (whole.stop_reason, whole.usage.output_tokens) == ("model_context_window_exceeded", room)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("model_context_window_exceeded", room)
    assert (budget.stop_reason, budget.usage.output_tokens) == ("max_tokens", room - 1)
    events = await calls_of(proxy, 3)
    assert [e.choices[0].finish_reason for e in events] == ["length"] * 3
    assert [len(e.choices[0].completion_token_ids) for e in events] == [room, room, room - 1]


async def test_a_prompt_over_the_context_is_refused_in_each_harness_api_s_own_words(proxy, vllm_url) -> None:
    """Claude Code compacts on "prompt is too long: N tokens > M maximum", Codex on the error code
    context_length_exceeded; the event keeps the engine's own message."""
    async with httpx.AsyncClient() as http:
        context = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["max_model_len"]
    long_text = "the quick brown fox jumps over the lazy dog " * (context // 4)
    async with anthropic_client(proxy, "r-long-a") as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="claude-opus-4-7", max_tokens=8,
                                         messages=[{"role": "user", "content": long_text}])
    message = refused.value.body["error"]["message"]
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: (\d+ tokens > {context} maximum|more than the {context} tokens .*)",
                        message), message
    async with responses_client(proxy, "r-long-r") as client:
        with pytest.raises(openai.BadRequestError) as refused_r:
            await client.responses.create(model="gpt-5-codex", input=long_text, max_output_tokens=8)
    assert refused_r.value.code == "context_length_exceeded", refused_r.value.body
    events = await calls_of(proxy, 2)
    assert {e.status for e in events} == {CallStatus.UPSTREAM_ERROR}
    assert all("maximum context length" in e.error_message for e in events), [e.error_message for e in events]


@contextlib.asynccontextmanager
async def _engine_held_then_aborted(vllm_url: str) -> AsyncIterator[None]:
    """vLLM paused (``keep``): what is sent meanwhile waits in its queue. On exit, the pause is
    switched to vLLM's default mode, ``abort``, which ends every answer in flight, then lifted."""
    async with httpx.AsyncClient(timeout=30) as http:
        (await http.post(f"{vllm_url}/pause", params={"mode": "keep"})).raise_for_status()
        try:
            yield
        finally:
            try:
                (await http.post(f"{vllm_url}/pause", params={"mode": "abort"})).raise_for_status()
            finally:
                (await http.post(f"{vllm_url}/resume")).raise_for_status()


@pytest.mark.parametrize("continuation", [False, True], ids=["chat", "continuation"])
async def test_an_answer_the_engine_aborts_before_its_first_token_is_a_retryable_error(
        proxy_settings_factory, topics, vllm_url, continuation: bool) -> None:
    """A pause in vLLM's default mode ends every answer in flight. One not yet started ends its
    chat stream with [DONE] and no finish reason (mid-answer, it is finish_reason "abort": see the
    scripted engine's tests); its generate stream says "abort" either way. Told end_turn, a harness
    would take an empty answer for a whole one: an Anthropic harness gets the stream's error event
    instead, which Claude Code retries. Chat completions pass the stream on as the engine sent it
    (continuation's as the chat endpoint would send an abort). Both are recorded as engine errors."""
    prompt = [{"role": "user", "content": "Write a long story."}]
    settings = proxy_settings_factory(continuation=continuation)
    server, task = await serve(settings)
    proxy = RunningProxy(f"http://127.0.0.1:{settings.port}", settings, topics)

    async def anthropic_stream() -> None:
        async with anthropic_client(proxy, "r-abort-stream") as client:
            stream = await client.messages.create(model="claude-opus-4-7", max_tokens=32_000, stream=True,
                                                  messages=prompt)
            async for _ in stream:
                pass

    async def chat_stream() -> list[str | None]:
        async with responses_client(proxy, "r-abort-chat") as chat:
            chunks = await chat.chat.completions.create(model="m", max_tokens=900, stream=True, messages=prompt)
            return [c.choices[0].finish_reason async for c in chunks if c.choices]

    async with _engine_held_then_aborted(vllm_url):
        cut = asyncio.create_task(anthropic_stream())
        passed = asyncio.create_task(chat_stream())
        await asyncio.sleep(3.0)  # both reach the engine's queue (a paused vLLM reports no queue to poll)
    try:
        with pytest.raises(anthropic.APIStatusError) as refused:
            await cut
        finished = await passed
        events = sorted(await calls_of(proxy, 2), key=lambda e: e.protocol.value)
    finally:
        await shutdown(server, task)
    told, recorded = (ABORTED, ENGINE_ABORTED) if continuation else (UNFINISHED, ENGINE_UNFINISHED)
    assert refused.value.body["error"]["message"] == told, refused.value.body
    assert finished == (["abort"] if continuation else [None])  # the role chunk, then [DONE]
    assert [(e.protocol, e.streamed) for e in events] == [(ApiProtocol.ANTHROPIC_MESSAGES, True),
                                                          (ApiProtocol.OPENAI_CHAT, True)]
    for event in events:
        assert event.status is CallStatus.UPSTREAM_ERROR, event.status
        assert event.error_message == (recorded if event.protocol is ApiProtocol.OPENAI_CHAT else told)
        assert len(event.prompt_token_ids) > 0
        assert all(list(c.completion_token_ids) == [] for c in event.choices)


async def test_reasoning_sent_back_reaches_real_vllm_on_the_assistant_turn(proxy, vllm_url) -> None:
    # The thinking a harness sends back (a thinking block the proxy signed, a reasoning item with
    # text) goes to the engine as the assistant message's ``reasoning``, which vLLM takes and hands
    # to the chat template; the prompt recorded is the engine's own for those messages.
    thought = "The user greets me; greet back."
    async with anthropic_client(proxy, "r-think-a") as client:
        await client.messages.create(model="m", max_tokens=4, thinking={"type": "adaptive"}, messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": signature(thought)},
                                              {"type": "text", "text": "Hi!"}]},
            {"role": "user", "content": "How are you?"}])
    async with openai.AsyncOpenAI(base_url=f"{proxy.base('r-think-r')}/v1", api_key=proxy.token("r-think-r"),
                                  max_retries=0) as client:
        await client.responses.create(model="m", max_output_tokens=4, input=[
            {"role": "user", "content": "Hello"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "How are you?"}])
    events = await calls_of(proxy, 2)
    for event in events:
        assert event.status is CallStatus.OK, event.error_message
        assert event.request.messages[1] == {"role": "assistant", "content": "Hi!", "reasoning": thought}
        assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, event.request.messages)
