"""Anthropic Messages and OpenAI Responses through the proxy to real vLLM: translated both ways,
captured token-exact with the translated prompt."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from proxy_helpers import calls_of
from test_proxy_openai_chat import tokenize

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
            final = await stream.get_final_message()
    assert final.stop_reason in {"tool_use", "max_tokens", "end_turn"}
    [event] = await calls_of(proxy, 1)
    assert event.streamed and event.protocol is ApiProtocol.ANTHROPIC_MESSAGES
    assert event.request.tool_choice == "required"
    assert event.request.tools[0]["function"]["name"] == "get_weather"
    assert list(event.prompt_token_ids) == await tokenize(vllm_url, event.model, event.request.messages,
                                                          event.request.tools)
    assert len(event.choices[0].completion_token_ids) == final.usage.output_tokens


async def test_anthropic_count_tokens_matches_the_engine(proxy, vllm_url) -> None:
    async with anthropic_client(proxy, "r-count") as client:
        counted = await client.messages.count_tokens(model="claude-opus-4-7",
                                                     messages=[{"role": "user", "content": "Count me"}])
    async with httpx.AsyncClient() as http:
        models = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["id"]
    assert counted.input_tokens == len(await tokenize(vllm_url, models, [{"role": "user", "content": "Count me"}]))


async def test_unsupported_anthropic_feature_gets_400_naming_the_field(proxy) -> None:
    async with anthropic_client(proxy, "r-img") as client:
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
            await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    [event] = await calls_of(proxy, 1)
    assert event.status is CallStatus.INVALID_REQUEST
    assert "messages[0].content[0].type" in event.error_message
    assert event.request.extra["untranslated"]["messages"][0]["content"][0]["type"] == "image"


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


async def test_responses_previous_response_id_is_refused_by_name(proxy) -> None:
    async with responses_client(proxy, "r-prev") as client:
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(model="m", input="again", previous_response_id="resp_123")
