"""A call's exchange in continuation mode, answered in the chat endpoint's shape.

The proxy's relay reads the engine's answer as ``/v1/chat/completions`` gives it: a chat
completion, or its chunks as server-sent events, with the prompt ids, the sampled ids and their
logprobs. :func:`exchange` plans the call (:func:`~proxy.continuation.builder.prepare`),
generates from the prompt ids built, and turns the result into that shape with derender, adding
the ids the chat endpoint would report and the engine's weight-version spans. Everything after
the exchange (translation, capture, recording) is therefore the same in both modes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from proxy.continuation.builder import ContinuationCall, prepare
from proxy.continuation.engine import TokenEndpoints, TokenEngine, TokenEngineError
from proxy.continuation.history import RolloutHistory
from proxy.continuation.planner import max_new_tokens
from proxy.engine_client import IDLE, EngineAnswer, EngineError, EngineResponse

__all__ = ["StreamedAnswer", "WholeAnswer", "exchange"]


class WholeAnswer(EngineAnswer):
    """An answer already read whole: a chat completion, or the engine's refusal with its status."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    async def read(self) -> bytes:
        """The body."""
        return self._body

    async def lines(self, *, idle_s: float | None = None) -> AsyncIterator[bytes]:
        """The body as one line (only an error answer is read so, and only by a relay that expected a stream)."""
        yield self._body

    def close(self, *, finished: bool) -> None:
        """Nothing to give back: the engine's connections were closed as each exchange ended."""


class StreamedAnswer(EngineAnswer):
    """A streamed generate answer, derendered into ``chat.completion.chunk`` events as it comes.

    The engine keeps no stream state between derender calls: this object carries it. With a tool
    parser, derender holds back text until a tool call is parsed; its chunk then has an empty delta,
    and still carries the step's ids, as the chat endpoint's does. A derender call costs about as
    much as a step of a small model, so the generate chunks that arrive while one is in flight are
    derendered together by the next: the harness gets them a little coarser rather than ever later.
    """

    status = 200

    def __init__(self, engine: TokenEngine, response: EngineResponse, planned: ContinuationCall,
                 prompt_ids: list[int]) -> None:
        self._engine = engine
        self._response = response
        self._planned = planned
        self._prompt_ids = prompt_ids
        self._state: dict[str, Any] | None = None
        self._head: dict[str, Any] = {"id": None, "object": "chat.completion.chunk", "created": None,
                                      "model": planned.rendered.get("model")}
        self._reader: asyncio.Task[None] | None = None

    async def read(self) -> bytes:
        """Not used: a streamed answer is read by lines."""
        raise EngineError("a streamed continuation answer is read line by line")

    async def _read(self, into: asyncio.Queue[bytes | Exception | None], idle_s: float | None) -> None:
        """Pass the generate stream's lines on as they come; None at its end, or the error that broke it."""
        try:
            async for line in self._response.lines(idle_s=idle_s):
                if line is IDLE or line.startswith(b"data:"):
                    into.put_nowait(line)
            into.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - raised again by the reader of the queue
            into.put_nowait(exc)

    async def lines(self, *, idle_s: float | None = None) -> AsyncIterator[bytes]:
        """The answer as the chat endpoint streams it: ``data:`` lines, then ``data: [DONE]``.

        Raises:
            EngineError: the generate stream broke, or derender refused a chunk.
        """
        pending: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(pending, idle_s))
        first = True
        try:
            while True:
                came = [await pending.get()]
                while not pending.empty():
                    came.append(pending.get_nowait())
                steps: list[dict[str, Any]] = []  # generate chunks with output, derendered together
                for item in came:
                    if isinstance(item, Exception):
                        raise item
                    if item is None:
                        return  # the stream ended without [DONE]: the relay says so
                    if item is IDLE:
                        if not steps:
                            yield item
                        continue
                    data = item[5:].strip()
                    if data == b"[DONE]" or not (chunk := _chunk(data)).get("choices"):
                        if steps:
                            yield await self._out(steps, first)
                            steps, first = [], False
                        # [DONE], or the usage chunk that comes before it
                        yield (b"data: [DONE]" if data == b"[DONE]" else
                               b"data: " + orjson.dumps({**self._head, "choices": [], "usage": chunk.get("usage")}))
                        if data == b"[DONE]":
                            return
                        continue
                    steps.append(chunk)
                if steps:
                    yield await self._out(steps, first)
                    first = False
        finally:
            await self._stop_reading()

    async def _out(self, steps: list[dict[str, Any]], first: bool) -> bytes:
        out = await self._derendered(_merged(steps))
        if first:
            out["prompt_token_ids"] = self._prompt_ids
            out["choices"][0]["delta"].setdefault("role", "assistant")
        return b"data: " + orjson.dumps(out)

    async def _stop_reading(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _derendered(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """One generate chunk as the chat endpoint's chunk: derender's delta, generate's ids and spans."""
        try:
            out, self._state = await self._engine.derender_chunk(chunk, self._state, self._prompt_ids,
                                                                 self._planned.chat_request)
        except TokenEngineError as exc:
            raise EngineError(f"derender refused a chunk: {exc}") from exc
        generated = chunk["choices"][0]
        self._head.update(id=out.get("id"), created=out.get("created"), model=out.get("model") or self._head["model"])
        choices = out.get("choices") or [{"index": 0}]
        choice = choices[0]
        choice["delta"] = _without_nulls(choice.get("delta") or {})
        _add_ids(choice, generated)
        return {**self._head, "choices": [choice]}

    def close(self, *, finished: bool) -> None:
        """Give the generate connection back when it was read to its end; otherwise cut it (aborting the request)."""
        if self._reader is not None:
            self._reader.cancel()  # its lines() ends when the connection does
        self._response.close(finished=finished)


Answer = WholeAnswer | StreamedAnswer


async def exchange(engine: TokenEngine, endpoints: TokenEndpoints, history: RolloutHistory,
                   chat_request: Mapping[str, Any], *, streamed: bool) -> tuple[ContinuationCall | None, Answer]:
    """Plan, generate and answer one call in continuation mode.

    Returns:
        The planned call (None when the engine refused to render the request), and the answer: a
        whole chat completion, a stream of its chunks, or the engine's refusal with its status
        (a request it cannot render, a prompt that fills the context).

    Raises:
        EngineError: no answer.
    """
    try:
        planned = await prepare(engine, endpoints, history, chat_request)
    except TokenEngineError as exc:
        return None, WholeAnswer(exc.status, exc.body)
    ids = planned.prompt.ids()
    requested = chat_request.get("max_completion_tokens") or chat_request.get("max_tokens")
    budget = max_new_tokens(requested if type(requested) is int else None, len(ids), endpoints.max_model_len)
    if budget < 1:
        # vLLM's own words for a prompt that fills the context, which the adapters read for each API.
        message = (f"This model's maximum context length is {endpoints.max_model_len} tokens. However, your "
                   f"prompt contains {len(ids)} input tokens, which exceeds this limit even without any output "
                   f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={len(ids)})")
        return planned, WholeAnswer(400, orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                                                 "code": 400}}))
    body = planned.generate_body(max_tokens=budget, stream=streamed)
    if streamed:
        response = await engine.open_generate(body)
        if response.status != 200:
            return planned, WholeAnswer(response.status, await response.read_and_close())
        return planned, StreamedAnswer(engine, response, planned, ids)
    try:
        generated = await engine.generate(body)
        answer = await engine.derender(generated, ids, planned.chat_request)
    except TokenEngineError as exc:
        return planned, WholeAnswer(exc.status, exc.body)
    generated_choice = generated["choices"][0]
    for choice in answer.get("choices") or ():
        _add_ids(choice, generated_choice)
    answer["prompt_token_ids"] = ids
    answer["usage"] = generated.get("usage") or answer.get("usage")
    return planned, WholeAnswer(200, orjson.dumps(answer))


def _chunk(data: bytes) -> dict[str, Any]:
    chunk = orjson.loads(data)
    if type(chunk) is not dict or type(chunk.get("choices") or []) is not list:
        raise EngineError(f"a generate chunk that is not one: {data[:200]!r}")
    return chunk


def _merged(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate chunks that came together as one: their ids and logprobs joined, the last one's end."""
    if len(steps) == 1:
        return steps[0]
    choices = [step["choices"][0] for step in steps]
    joined = dict(choices[-1])
    joined["token_ids"] = [i for choice in choices for i in choice.get("token_ids") or ()]
    joined["logprobs"] = {"content": [entry for choice in choices
                                      for entry in (choice.get("logprobs") or {}).get("content") or ()]}
    for key in ("weight_versions", "finish_reason", "stop_reason"):
        joined[key] = next((choice[key] for choice in reversed(choices) if choice.get(key) is not None), None)
    return {**steps[-1], "choices": [joined]}


def _add_ids(choice: dict[str, Any], generated: Mapping[str, Any]) -> None:
    """Put generate's ids, logprobs and weight-version spans on derender's choice (which has none)."""
    ids = list(generated.get("token_ids") or [])
    choice["token_ids"] = ids
    choice["weight_versions"] = generated.get("weight_versions")
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        # Derender writes them only for a whole answer; a chunk gets generate's own, by id.
        sampled = (generated.get("logprobs") or {}).get("content") or []
        choice["logprobs"] = {"content": [{"token_id": entry.get("token_id"), "logprob": entry.get("logprob")}
                                          for entry in sampled]}
    if choice.get("finish_reason") is None:
        choice["finish_reason"] = generated.get("finish_reason")
    if choice.get("stop_reason") is None:
        choice["stop_reason"] = generated.get("stop_reason")


def _without_nulls(value: Any) -> Any:
    """A derendered delta as the chat endpoint writes it: fields without a value left out."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
