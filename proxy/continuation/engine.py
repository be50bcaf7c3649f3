"""The engine's token-in/token-out endpoints: render, generate (whole and streamed), derender.

vLLM mounts them with ``--enable-scale-out``: ``/v1/chat/completions/render`` turns a chat
request into the engine's own prompt ids and sampling parameters, ``/inference/v1/generate``
samples from given ids (and reports the weight versions per output-token range), and
``/v1/chat/completions/derender`` turns the sampled ids back into a chat answer (tool calls
parsed). Between render and generate the proxy may replace the prompt ids: that is how a rollout's
next call extends the exact ids of its earlier turn instead of a re-rendering of it.

:meth:`TokenEngine.probe` tells at start whether a replica offers the endpoints, and learns the two
facts continuation needs from the engine itself: the context length and the template's turn closing
(the ids the template writes after an assistant message's content).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.engine_client import EngineClient, EngineResponse

__all__ = ["TokenEndpoints", "TokenEngine", "TokenEngineError", "generate_body"]

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"

# An assistant message whose closing the probe reads off the template: rendered whole, and left
# open (``continue_final_message``); the closing is what the first has beyond the second.
_PROBE_MESSAGES = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]


class TokenEngineError(Exception):
    """The engine answered a token-in/token-out call with an error status (or with no JSON)."""

    def __init__(self, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{path} answered {status}: {body[:300]!r}")
        self.path = path
        self.status = status
        self.body = body


@dataclass(frozen=True)
class TokenEndpoints:
    """What a replica's probe found: it offers render, generate and derender, and these facts."""

    model: str
    """The served model's name, as requests name it."""
    max_model_len: int
    """The context length: prompt and sampled ids together."""
    turn_closing: tuple[int, ...]
    """The ids the template writes after an assistant message's content (``<|im_end|>`` and a newline
    for ChatML). A sampled turn that ended on the first of them needs only the rest as its bridge."""


def generate_body(rendered: Mapping[str, Any], prompt_ids: Sequence[int], *, max_tokens: int,
                  stream: bool = False) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body: a render answer with these prompt ids.

    Render leaves out every sampling field equal to ``SamplingParams``' default, ``max_tokens`` (16)
    among them, and generate then samples to the end of the context; and render's own
    ``max_tokens`` was sized for its prompt, not this one. So the caller always sets it. Logprobs
    of the sampled ids are always asked for: they are the behaviour logprobs training needs.

    Args:
        rendered: the render answer (a generate request for the rendered prompt).
        prompt_ids: the ids to generate from.
        max_tokens: how many ids at most to sample; must fit the context after ``prompt_ids``.
        stream: stream the answer, one chunk per step, the weight versions on the last.
    """
    if not prompt_ids:
        raise ValueError("a generate request needs at least one prompt id")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    body = dict(rendered)
    sampling = dict(body.get("sampling_params") or {})
    sampling["max_tokens"] = max_tokens
    if sampling.get("logprobs") is None:
        sampling["logprobs"] = 0
    body["sampling_params"] = sampling
    body["token_ids"] = list(prompt_ids)
    body["output_mode"] = "tokens"
    body["stream"] = stream
    body["stream_options"] = {"include_usage": True} if stream else None
    return body


class TokenEngine:
    """One replica's token-in/token-out endpoints, over the proxy's engine connections.

    Args:
        client: the process's engine client (kept-alive connections).
        url: the replica's base URL, without a trailing slash.
        timeout_s: the deadline of one exchange (a whole generate included).
    """

    def __init__(self, client: EngineClient, url: str, *, timeout_s: float) -> None:
        self._client = client
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s

    async def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        status, answer = await self._client.post_json(self.url + path, orjson.dumps(body), timeout_s=self._timeout_s)
        if status != 200:
            raise TokenEngineError(path, status, answer)
        try:
            return orjson.loads(answer)
        except orjson.JSONDecodeError as exc:
            raise TokenEngineError(path, status, answer) from exc

    async def probe(self, *, timeout_s: float = 10.0) -> TokenEndpoints | None:
        """Whether this replica offers render, generate and derender; None when it does not.

        Cheap: the model list, two renders of a two-message conversation, and a generate and a
        derender with an empty body, which a replica offering them refuses with 400 (the body is
        invalid) and one without ``--enable-scale-out`` with 403 or 404.

        Raises:
            EngineError: the replica could not be reached.
            TokenEngineError: its model list is not vLLM's.
        """
        status, models = await self._client.get_json(self.url + "/v1/models", timeout_s=timeout_s)
        try:
            entry = models["data"][0]
            model, max_model_len = str(entry["id"]), int(entry["max_model_len"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TokenEngineError("/v1/models", status, orjson.dumps(models)) from exc
        for path in (GENERATE_PATH, DERENDER_PATH):
            status, _ = await self._client.post_json(self.url + path, b"{}", timeout_s=timeout_s)
            if status != 400:
                return None
        try:
            closed = await self.render_ids({"model": model, "messages": _PROBE_MESSAGES,
                                            "add_generation_prompt": False})
            open_ = await self.render_ids({"model": model, "messages": _PROBE_MESSAGES,
                                           "add_generation_prompt": False, "continue_final_message": True})
        except TokenEngineError:
            return None  # a template that cannot leave a turn open: chat mode
        if closed is None or open_ is None or closed[:len(open_)] != open_ or len(closed) == len(open_):
            return None  # a template whose turns do not close after their content: nothing to continue
        return TokenEndpoints(model=model, max_model_len=max_model_len, turn_closing=tuple(closed[len(open_):]))

    async def render_ids(self, chat_request: Mapping[str, Any]) -> list[int] | None:
        """The prompt ids of a chat request; None when the replica does not offer render."""
        try:
            return list((await self.render(chat_request))["token_ids"])
        except TokenEngineError as exc:
            if exc.status in (403, 404):
                return None
            raise

    async def render(self, chat_request: Mapping[str, Any]) -> dict[str, Any]:
        """Render a chat request: the generate request for it (prompt ids, sampling parameters).

        Raises:
            TokenEngineError: refused (a bad request: 400, with the engine's reason).
            EngineError: no answer.
        """
        answer = await self._post(RENDER_PATH, chat_request)
        if not isinstance(answer, dict) or not isinstance(answer.get("token_ids"), list):
            raise TokenEngineError(RENDER_PATH, 200, orjson.dumps(answer))
        return answer

    async def generate(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Sample from a :func:`generate_body` (not streamed): ids, logprobs, weight-version spans."""
        answer = await self._post(GENERATE_PATH, body)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise TokenEngineError(GENERATE_PATH, 200, orjson.dumps(answer))
        return answer

    async def generate_stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Sample from a streaming :func:`generate_body`: its chunks as they come, ``[DONE]`` left out.

        A chunk holds one step's ids and logprobs; the last one with choices holds the weight-version
        spans of the whole output; a usage chunk without choices ends the stream. Leaving the
        iteration early cuts the connection, which aborts the request in the engine.
        """
        response = await self.open_generate(body)
        finished = False
        try:
            if response.status != 200:
                raise TokenEngineError(GENERATE_PATH, response.status, await response.read())
            async for line in response.lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                yield orjson.loads(data)
        finally:
            response.close(finished=finished)

    async def open_generate(self, body: Mapping[str, Any]) -> EngineResponse:
        """Send a streaming :func:`generate_body`; its answer's status is in, its lines still to read.

        The caller reads and closes the answer (closing it unread aborts the request in the engine).

        Raises:
            EngineError: no answer.
        """
        return await self._client.post(self.url + GENERATE_PATH, orjson.dumps(body), timeout_s=self._timeout_s)

    async def derender(self, generated: Mapping[str, Any], prompt_ids: Sequence[int],
                       chat_request: Mapping[str, Any]) -> dict[str, Any]:
        """The chat answer (``chat.completion``) for a whole generate answer, tool calls parsed.

        Its ``token_ids`` and ``prompt_token_ids`` come back null: the ids are the generate answer's.
        """
        return dict(await self._post(DERENDER_PATH, {
            "generate_response": generated, "prompt_token_ids": list(prompt_ids), "prompt_tokens": len(prompt_ids),
            "chat_request": chat_request}))

    async def derender_chunk(self, chunk: Mapping[str, Any], state: Mapping[str, Any] | None,
                             prompt_ids: Sequence[int], chat_request: Mapping[str, Any]
                             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One streamed generate chunk as a ``chat.completion.chunk``, and the state for the next.

        The engine keeps no state between chunks: the caller carries ``state`` (None on the first).
        With a tool parser, the engine replays the whole output so far on every chunk.
        """
        answer = await self._post(DERENDER_PATH, {
            "stream": True, "generate_chunk": chunk, "stream_state": state, "prompt_token_ids": list(prompt_ids),
            "prompt_tokens": len(prompt_ids), "chat_request": chat_request})
        return dict(answer["chunk"]), dict(answer["stream_state"])
