"""Continuation against the real engine: a three-turn tool conversation through render, generate, derender.

Each turn is prepared as the proxy would (plan, render) and generated from the ids built; the engine
echoes the prompt ids it saw. The second and third prompts begin with exactly the earlier prompt and
sampled ids, the ``<tool_call>`` the model spelled in BPE pieces included, while the chat template's
own rendering of the same conversation (what chat mode sends) breaks inside the sampled turn. The
third turn streams (generate and derender chunk by chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from consumers.assembler.drift import canonical_tools, template_view
from proxy.continuation.builder import prepare
from proxy.continuation.engine import TokenEndpoints, TokenEngine, generate_body
from proxy.continuation.history import RolloutHistory
from proxy.continuation.planner import (
    Extend,
    Prompt,
    choose,
    extend_prompt,
    full_prompt,
    max_new_tokens,
)
from proxy.engine_client import EngineClient

TOOL_CALL_ID = 4092  # the tiny model's added token for "<tool_call>", the template's spelling

# Strict arguments with an enum and one call per turn: the random model then finishes a tool call
# within max_tokens (scripts/vllm/README.md, "Tools").
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture
async def engine(vllm_url: str) -> AsyncIterator[TokenEngine]:
    client = EngineClient(timeout_s=120.0)
    try:
        yield TokenEngine(client, vllm_url, timeout_s=120.0)
    finally:
        await client.aclose()


def _request(model: str, messages: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 128, "seed": seed}


async def _turn(engine: TokenEngine, endpoints: TokenEndpoints, history: RolloutHistory,
                messages: list[dict[str, Any]], *, seed: int, stream: bool = False,
                ) -> tuple[Prompt, list[int], dict[str, Any], list[int]]:
    """One call as the proxy would make it: plan, render, generate, derender, record.

    Returns the prompt, the sampled ids, the answer's message and the full render's ids (chat mode's prompt).
    """
    request = _request(endpoints.model, messages, seed)
    planned = await prepare(engine, endpoints, history, request)
    prompt, rendered = planned.prompt, planned.rendered
    ids = prompt.ids()
    body = planned.generate_body(max_tokens=max_new_tokens(128, len(ids), endpoints.max_model_len), stream=stream)
    body["return_token_ids"] = True
    if stream:
        sampled, message, seen, spans = await _streamed(engine, body, ids, request)
    else:
        generated = await engine.generate(body)
        choice = generated["choices"][0]
        seen, sampled, spans = generated["prompt_token_ids"], choice["token_ids"], choice["weight_versions"]
        answer = await engine.derender(generated, ids, request)
        assert answer["choices"][0]["token_ids"] is None  # derender gives no ids: generate's are kept
        message = answer["choices"][0]["message"]
    assert seen == ids, "the engine generated from other ids than the planner built"
    assert spans == [{"version": "default", "start": 0, "end": len(sampled)}]
    history.record(planned.turn(f"call-{len(history)}", sampled, message))
    return prompt, sampled, message, rendered["token_ids"]


async def _streamed(engine: TokenEngine, body: dict[str, Any], ids: list[int], request: dict[str, Any],
                    ) -> tuple[list[int], dict[str, Any], list[int], Any]:
    sampled: list[int] = []
    seen: list[int] = []
    spans = None
    state = None
    name, arguments, tool_id = "", "", ""
    async for chunk in engine.generate_stream(body):
        seen = chunk.get("prompt_token_ids") or seen
        if not chunk["choices"]:
            continue  # the usage chunk
        choice = chunk["choices"][0]
        sampled.extend(choice["token_ids"] or [])
        spans = choice["weight_versions"] or spans
        delta_chunk, state = await engine.derender_chunk(chunk, state, ids, request)
        for delta in delta_chunk["choices"]:
            for call in delta["delta"].get("tool_calls") or []:
                tool_id = call.get("id") or tool_id
                name += call["function"].get("name") or ""
                arguments += call["function"].get("arguments") or ""
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": tool_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
    return sampled, message, seen, spans


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an OpenAI client sends it back: arguments re-serialised by the harness."""
    calls = [{"id": c["id"], "type": "function", "function": {
        "name": c["function"]["name"], "arguments": orjson.dumps(orjson.loads(c["function"]["arguments"])).decode()}}
        for c in message["tool_calls"]]
    return {"role": "assistant", "content": message.get("content"), "tool_calls": calls}


async def _text(engine_url: str, client: EngineClient, model: str, ids: list[int]) -> str:
    status, answer = await client.post_json(engine_url + "/detokenize", orjson.dumps({"model": model, "tokens": ids}),
                                            timeout_s=30)
    assert status == 200, answer
    return str(orjson.loads(answer)["prompt"])


async def test_three_tool_turns_extend_the_exact_ids_where_chat_rendering_breaks(engine: TokenEngine) -> None:
    endpoints = await engine.probe()
    assert endpoints is not None, "the engine does not offer render, generate and derender (--enable-scale-out)"
    assert endpoints.turn_closing == (4091, 198)  # "<|im_end|>", "\n" in the tiny model's ChatML template
    history = RolloutHistory()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]

    first, sampled1, message1, _ = await _turn(engine, endpoints, history, messages, seed=12)
    assert first.drift is None and first.parent is None
    assert message1["tool_calls"], message1
    assert TOOL_CALL_ID not in sampled1
    spelled = await _text(engine.url, engine._client, endpoints.model, sampled1)
    assert spelled.startswith("<tool_call>"), spelled  # "<tool_call>" sampled as BPE pieces

    messages += [_echo(message1), {"role": "tool", "tool_call_id": message1["tool_calls"][0]["id"], "content": "sunny"}]
    second, sampled2, message2, chat2 = await _turn(engine, endpoints, history, messages, seed=2)
    before = first.ids() + sampled1
    assert second.drift is None and second.parent is not None
    assert second.ids()[:len(before)] == before
    assert second.ids()[len(before)] == 198  # the bridge: the newline after the sampled <|im_end|>
    # Chat mode's prompt for the same conversation: the template writes the tool call back its own way.
    assert chat2[:len(first.ids())] == first.ids()
    assert chat2[:len(before)] != before
    assert TOOL_CALL_ID in chat2[len(first.ids()):]
    status, answer = await engine._client.post_json(engine.url + "/v1/chat/completions", orjson.dumps(
        {**_request(endpoints.model, messages, 2), "max_tokens": 1, "return_token_ids": True}), timeout_s=60)
    assert status == 200, answer
    assert orjson.loads(answer)["prompt_token_ids"] == chat2  # what chat mode sends is that render

    messages += [_echo(message2), {"role": "tool", "tool_call_id": message2["tool_calls"][0]["id"], "content": "rain"}]
    third, sampled3, message3, chat3 = await _turn(engine, endpoints, history, messages, seed=3, stream=True)
    before = second.ids() + sampled2
    assert third.drift is None and third.parent is not None
    assert third.ids()[:len(before)] == before
    assert third.ids()[:len(first.ids()) + len(sampled1)] == first.ids() + sampled1
    assert message3["tool_calls"][0]["function"]["name"] == "get_weather"
    assert len(sampled3) > 0
    assert chat3[:len(before)] != before
    # What each step added is the bridge and then the very ids chat mode's render ends with: the
    # template's rendering of the new tool message and the generation prompt.
    for step, chat in ((second, chat2), (third, chat3)):
        assert step.added[0] == 198
        assert list(step.added[1:]) == chat[len(chat) - len(step.added) + 1:]


async def test_a_turn_cut_by_max_tokens_is_closed_by_the_whole_template_closing(engine: TokenEngine) -> None:
    endpoints = await engine.probe()
    assert endpoints is not None
    history = RolloutHistory()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    views = [template_view(m) for m in messages]
    request = {"model": endpoints.model, "messages": messages, "max_tokens": 4, "seed": 5}
    rendered = await engine.render(request)
    first = full_prompt(rendered["token_ids"], None)
    generated = await engine.generate(generate_body(rendered, first.ids(), max_tokens=4))
    choice = generated["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
    message = (await engine.derender(generated, first.ids(), request))["choices"][0]["message"]
    history.record(first.turn("c0", views, canonical_tools(None), choice["token_ids"], template_view(message)))

    messages += [{"role": "assistant", "content": message["content"]}, {"role": "user", "content": "Go on."}]
    plan = choose(history, [template_view(m) for m in messages], canonical_tools(None))
    assert isinstance(plan, Extend)
    request = {**request, "messages": messages}
    rendered = await engine.render(request)
    closed = await engine.render_ids({**request, "messages": messages[:plan.through], "add_generation_prompt": False})
    assert closed is not None
    second = extend_prompt(plan, endpoints.turn_closing, closed, rendered["token_ids"])
    before = first.ids() + choice["token_ids"]
    assert second.ids()[:len(before) + 2] == [*before, 4091, 198]  # the model never closed its turn
    body = generate_body(rendered, second.ids(), max_tokens=4)
    body["return_token_ids"] = True
    assert (await engine.generate(body))["prompt_token_ids"] == second.ids()
