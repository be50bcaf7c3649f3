"""The call path shared by every protocol, as a sequence of named steps.

1. **Normalise** (:func:`_normalise`): the harness's request in chat form, or a recorded refusal.
2. **Begin** (:meth:`CallService._begin`): the run's sampling applied, the call counted as an
   attempt of its rollout, its capture opened.
3. **Choose a replica** (:meth:`CallService._serve`): the rollout's own first, the others after it.
4. **Build the engine request** (:meth:`CallService._engine_request`): the one step where the
   engine modes differ. Chat mode sends the chat request, with the capture fields asked for, to
   ``/v1/chat/completions``. Continuation mode, where the replica offers token-in/token-out
   endpoints, builds the prompt from the rollout's earlier turn's exact ids and generates from them
   (:mod:`proxy.continuation`); its answer comes in the chat endpoint's shape.
5. **Exchange** (:meth:`CallService._exchange`): the request sent, the engine's answer begun.
6. **Relay**: a whole answer read and translated (:meth:`CallService._relay_whole`), or a stream
   relayed chunk by chunk (:class:`_StreamRelay`).
7. **Record** (:meth:`CallService._record`): the call's event, on every way out, the failures
   included (:meth:`CallService._fail`).

The event of a call is durable (in the local journal) before the harness sees the end of its
answer: for a whole answer, before the response is sent; for a stream, before the
closing events. Content tokens stream through as the engine produces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from producers.capture import CAPTURE_KEYS, CallCapture, cut_prompt_ids, normalize_request, session_headers
from producers.raw_calls import EngineExchange
from producers.shipper import JournalPublisher
from proxy import exact_json, telemetry
from proxy.adapters import Adapter, StreamSession
from proxy.continuation.answer import Answer, exchange
from proxy.continuation.builder import ContinuationCall
from proxy.continuation.engine import TokenEndpoints, TokenEngine, TokenEngineError
from proxy.continuation.history import RolloutHistories, Turn
from proxy.continuation.prefix import Reference, refer
from proxy.engine_client import IDLE, EngineError, EngineResponse, EngineTimeoutError, EngineUnreachableError
from proxy.errors import CallLogUnavailableError, InvalidRequestError, ProxyError, UnsupportedFeatureError
from proxy.hangup import HARNESS_GONE, HangupWatch, HarnessGoneError
from proxy.media import MEDIA_PARTS
from proxy.nesting import dumps_within_depth
from proxy.retries import RetryTracker
from proxy.settings import ProxySettings
from proxy.upstream import UpstreamPool
from schemas._base import new_event_id
from schemas.call.v1 import ApiProtocol, CallStatus, NormalizedRequest

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_ROLLOUT_SEGMENT = re.compile(r"/rollouts/[^/]+/")

PROXY_STOPPED = "the proxy stopped before the engine's answer was complete"
ENGINE_ABORTED = "the engine aborted this answer before it was finished (finish_reason 'abort')"
"""How a call whose answer the engine aborted is recorded when the harness got the answer as it was."""
ABORTED = (f"{ENGINE_ABORTED}, as a replica paused in vLLM's default mode or shutting down does; "
           "send the request again")
"""What a harness of a translated API is told instead of an answer the engine aborted."""
ENGINE_UNFINISHED = "the engine ended its stream without finishing the answer (no finish_reason before [DONE])"
"""How a stream that ended so is recorded when the harness got it as it was."""
UNFINISHED = f"{ENGINE_UNFINISHED}, as vLLM does for an answer aborted before its first token; send the request again"
"""What a harness of a translated API is told instead."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: the rollout (from token, path or header) and its task."""

    rollout_id: str
    task_id: str | None


@dataclass
class _Attempt:
    """The call at one replica: the engine request sent, the engine call's span, and the engine's answer."""

    replica: str
    sent: bytes
    span: trace.Span
    version_before: str | None
    """In chat mode, the replica's weight version read just before the request went out (see
    :meth:`CallService._weight_version`); None in continuation mode, whose engine reports it per token."""
    started: float = field(default_factory=time.perf_counter)
    response: EngineResponse | Answer = field(init=False)
    """The engine's answer: its status and headers; the body is read by the relay."""
    _ended: bool = field(default=False, init=False)

    def end(self) -> None:
        """End the engine call's span; idempotent, as every way out of a call ends it."""
        if not self._ended:
            self._ended = True
            self.span.end()


@dataclass
class _Call:
    """One call on its way down the path: what normalising made of it, and what later steps add."""

    request: Request
    adapter: Adapter
    caller: Caller
    span: trace.Span
    body: dict[str, Any]
    """The harness's request (with the run's sampling: answers that echo their request show it)."""
    chat: dict[str, Any]
    """The request in chat form; chat mode sends it to the engine."""
    asked: dict[str, Any]
    """The capture fields the harness itself asked for (the others are taken out of its answer)."""
    streamed: bool
    capture: CallCapture
    fingerprint: bytes
    """The conversation's digest: a re-send of it is a retry (:class:`~proxy.retries.RetryTracker`)."""
    watch: HangupWatch
    replica: str | None = None
    """The replica the call is at (None: none yet, or none reachable)."""
    attempt: _Attempt | None = None
    planned: ContinuationCall | None = None
    """In continuation mode, the call's plan: its prompt, and the turn its history records."""


@dataclass(frozen=True)
class _EngineRequest:
    """What the exchange sends a replica (:meth:`CallService._engine_request`)."""

    sent: bytes
    """The chat request as the engine takes it: chat mode's body, continuation's to render."""
    continuation: TokenEndpoints | None
    """The replica's token-in/token-out endpoints in continuation mode; None in chat mode."""


class _CallFailed(Exception):
    """Why a step ends the call with an error answer; :meth:`CallService._fail` records and answers it."""

    def __init__(self, http_status: int, status: CallStatus, message: str, *,
                 upstream_status: int | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.status = status
        self.message = message
        self.upstream_status = upstream_status


class CallService:
    """Runs calls for the routers; owns nothing it does not need per call."""

    def __init__(self, settings: ProxySettings, upstream: UpstreamPool, publisher: JournalPublisher) -> None:
        self.settings = settings
        self.upstream = upstream
        self.publisher = publisher
        self.retries = RetryTracker(settings.retry_window_s)
        self._served_model: str | None = settings.served_model
        self._context: dict[str, int | None] = {}
        """Each replica's context length (``max_model_len`` in its model list; None: not reported)."""
        self._token_endpoints: dict[str, TokenEndpoints | None] = {}
        """What each replica's probe found: its token-in/token-out endpoints, or None (chat mode)."""
        self._background: set[asyncio.Task[Any]] = set()
        self.histories = RolloutHistories()
        """Each rollout's token history: what continuation extends, and what call events reference."""

    async def drain(self, timeout_s: float) -> None:
        """Wait for events still being recorded (of cut streams and answers) at shutdown."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)

    async def served_model(self, replica: str) -> str:
        """The engine's model name (asked once), used whatever name the harness sent."""
        if self._served_model is None:
            status, models = await self._models(replica)
            if status != 200 or not isinstance(models, dict) or not models.get("data"):
                raise EngineUnreachableError(f"{replica}/v1/models answered {status}")
            self._served_model = str(models["data"][0]["id"])
        return self._served_model

    async def _models(self, replica: str) -> tuple[int, Any]:
        """The replica's ``/v1/models`` answer; its context length is kept from a 200 on the way."""
        status, models = await self.upstream.client.get_json(f"{replica}/v1/models", timeout_s=10.0)
        if status == 200:
            self._context[replica] = _context_length(models)
        return status, models

    async def context_length(self, replica: str) -> int | None:
        """The replica's context length in tokens, asked once; None when it does not say.

        An engine that cannot be asked now is asked again on a later call.
        """
        if replica not in self._context:
            try:
                await self._models(replica)
            except EngineUnreachableError:
                raise  # the caller tries another replica, as for the call itself
            except EngineError:
                pass  # a slow answer or a gateway's passing error: asked again on a later call
        return self._context.get(replica)

    async def _fit_output(self, chat: dict[str, Any], capture: CallCapture, replica: str) -> None:
        """Lower a call's output budget (``max_tokens``, ``max_completion_tokens``) to the engine's context.

        Claude Code asks for 32,000 output tokens whatever the model, as Anthropic's API allows up
        to the model's output limit; vLLM refuses a budget over its context length with a 400,
        which would fail every call to an engine with a shorter context. The proxy does not know
        the prompt's length before the engine renders it, so it lowers the budget to the context
        length; vLLM lowers it further to what the prompt leaves. The number is only a ceiling,
        so lowering it changes no answer.
        """
        limit: int | None = None
        for key in ("max_tokens", "max_completion_tokens"):
            wanted = chat.get(key)
            if type(wanted) is not int:
                continue
            if limit is None:
                limit = await self.context_length(replica)
                if limit is None:
                    return
            if wanted > limit:
                chat[key] = limit
                capture.request.sampling[key] = limit  # the event records what the engine got

    async def handle(self, request: Request, adapter: Adapter, caller: Caller, raw: bytes) -> Response:
        """One harness call, end to end."""
        # A framework may already have opened the server span; then ours nests inside it.
        # Model calls are served ahead of FastAPI's own (see proxy.app._ProxyApp), so ours is
        # usually the server span, continuing the harness's trace when it sent one.
        outer = trace.get_current_span().get_span_context().is_valid
        parent = None
        if not outer and "traceparent" in request.headers:
            parent = propagate.extract(request.headers)
        # Named by route, not path: a name per rollout would give trace backends one span name
        # per rollout to index. The rollout is an attribute.
        route = _ROLLOUT_SEGMENT.sub("/rollouts/{rollout_id}/", request.scope["path"], count=1)
        span = telemetry.tracer.start_span(f"{request.method} {route}", context=parent,
                                           kind=SpanKind.INTERNAL if outer else SpanKind.SERVER,
                                           attributes={"http.route": route, "openforge.rollout_id": caller.rollout_id,
                                                       "openforge.protocol": adapter.protocol.value})
        with trace.use_span(span, end_on_exit=False):
            try:
                return await self._handle(request, adapter, caller, raw, span)
            except BaseException:
                span.end()
                raise

    async def _handle(self, request: Request, adapter: Adapter, caller: Caller, raw: bytes,
                      span: trace.Span) -> Response:
        """The call path: normalise, then serve (choose a replica, exchange, relay, record)."""
        headers = session_headers(request.headers)
        body: Any = None
        try:
            body = orjson.loads(raw)
            chat, conversation = _normalise(adapter, body)
        except (orjson.JSONDecodeError, ProxyError) as exc:
            return await self._refuse(adapter, caller, headers, span, body, exc)
        call = self._begin(request, adapter, caller, span, headers, body, chat, conversation)
        try:
            return await self._serve(call)
        except (asyncio.CancelledError, HarnessGoneError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not _taken_back(call.watch):
                # Not (only) the watch's: the server is stopping, past its drain time. The call
                # is still recorded, as a stream cut off the same way is.
                if not call.capture.recording:
                    self._record_in_background(call, CallStatus.INTERNAL_ERROR, PROXY_STOPPED)
                raise
            return await self._hung_up(call)
        finally:
            call.watch.stop()

    async def _refuse(self, adapter: Adapter, caller: Caller, headers: dict[str, str], span: trace.Span,
                      body: Any, exc: orjson.JSONDecodeError | ProxyError) -> Response:
        """Record a request refused as it came, and answer it in its API's error shape.

        Not tracked as an attempt: a refused request is never a turn, and no re-send of it is a
        retry of anything the assembler could count.
        """
        error = exc if isinstance(exc, ProxyError) else InvalidRequestError(f"malformed JSON: {exc}")
        error.message = _clipped(error.message)
        capture = CallCapture(rollout_id=caller.rollout_id, call_id=new_event_id(), protocol=adapter.protocol,
                              model=str(self._served_model or "unknown"), request=_untranslated(body),
                              streamed=False, task_id=caller.task_id, headers=headers)
        await self._record(capture, CallStatus.INVALID_REQUEST, error_message=error.message,
                           upstream_status_code=None)
        span.set_status(Status(StatusCode.ERROR, error.message))
        span.end()
        param = error.field if isinstance(error, UnsupportedFeatureError) else None
        return _json(adapter.error(error.status_code, error.message, error.error_type, param), error.status_code)

    def _begin(self, request: Request, adapter: Adapter, caller: Caller, span: trace.Span,
               headers: dict[str, str], body: dict[str, Any], chat: dict[str, Any], conversation: bytes) -> _Call:
        """Apply the run's sampling, count the call as an attempt of its rollout and open its capture."""
        if self.settings.sampling:
            chat.update(self.settings.sampling)  # before the capture, which records what the engine gets
            # Answers that echo the request's sampling (Responses) show what the engine got.
            body = {**body, **self.settings.sampling}
        asked = {k: chat[k] for k in CAPTURE_KEYS if k in chat}
        streamed = bool(chat.get("stream"))
        fingerprint = self.retries.fingerprint(conversation)
        call_id = new_event_id()
        attempt, retry_of = self.retries.begin(caller.rollout_id, fingerprint, call_id)
        capture = CallCapture(
            rollout_id=caller.rollout_id, call_id=call_id, protocol=adapter.protocol,
            model=self._served_model or str(chat.get("model") or "unknown"),
            request=normalize_request(chat, asked), streamed=streamed, task_id=caller.task_id,
            attempt=attempt, retry_of=retry_of, headers=headers,
        )
        span.set_attribute("openforge.call_id", call_id)
        # A whole answer's harness that hangs up while the engine works cancels the engine's work
        # (a stream's is cancelled by the server): see proxy/hangup.py.
        watch = HangupWatch(request.receive, enabled=not streamed)
        return _Call(request, adapter, caller, span, body, chat, asked, streamed, capture, fingerprint, watch)

    async def _serve(self, call: _Call) -> Response:
        """Choose a replica (the rollout's, then the others), exchange with it, relay its answer and record.

        A replica that cannot be reached is marked down and the next one tried; any other failure
        ends the call with its error answer (:meth:`_fail`).
        """
        try:
            last_error = "no replica configured"
            for replica in self.upstream.order(call.caller.rollout_id):
                call.replica = replica
                try:
                    attempt = await self._exchange(call, replica)
                except EngineTimeoutError as exc:
                    raise _CallFailed(504, CallStatus.UPSTREAM_TIMEOUT, f"engine timed out: {exc!r}") from exc
                except EngineError as exc:
                    self.upstream.mark_down(replica)
                    last_error = f"{replica}: {exc!r}"
                    continue
                self.upstream.mark_up(replica)
                if attempt.response.status >= 400:
                    await self._engine_refused(attempt)
                if call.streamed:
                    return self._stream(call, attempt)
                return await self._relay_whole(call, attempt)
            call.replica = None
            raise _CallFailed(502, CallStatus.UPSTREAM_UNREACHABLE,
                              f"no engine replica reachable; last error: {last_error}")
        except _CallFailed as failed:
            return await self._fail(call, failed)

    async def _engine_request(self, call: _Call, replica: str) -> _EngineRequest:
        """The engine request for ``replica``: the chat request as the engine takes it, and the mode.

        It names the served model, keeps the call's output budget within the engine's context,
        and asks the engine for everything capture needs (taken out of the answer again:
        :func:`proxy.adapters.strip_capture`). Chat mode sends it as it is; continuation mode
        renders it and generates from the ids it builds (:meth:`_continues` says which).
        """
        chat = call.chat
        chat["model"] = call.capture.model = await self.served_model(replica)
        await self._fit_output(chat, call.capture, replica)
        chat["logprobs"] = True
        chat["return_token_ids"] = True
        chat["return_weight_versions"] = True
        if chat.get("include_reasoning") is False:
            # vLLM withholds every token id and logprob of an answer whose reasoning is hidden;
            # the reasoning is taken out of the answer here instead (proxy/adapters.py).
            chat["include_reasoning"] = True
        if call.streamed:
            chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
        return _EngineRequest(orjson.dumps(chat), await self._continues(call, replica))

    async def _continues(self, call: _Call, replica: str) -> TokenEndpoints | None:
        """The replica's token-in/token-out endpoints when this call goes by continuation; None: chat mode.

        Chat mode serves a call whose replica does not offer them (or when the setting forces it),
        one with media (the token ids alone do not carry it), and a stream whose harness asked for
        logprobs (a generate chunk has no token strings to give it).
        """
        if not self.settings.continuation or _has_media(call.chat) or (call.streamed and call.asked.get("logprobs")):
            return None
        return await self._endpoints(replica)

    def detect_modes(self) -> None:
        """Ask every replica for its token-in/token-out endpoints now, in the background.

        The first calls then find the answer; a replica not up yet is asked again by its first call.
        """
        if self.settings.continuation:
            for replica in self.upstream.urls:
                self._in_background(self._endpoints(replica))

    async def _endpoints(self, replica: str) -> TokenEndpoints | None:
        """The replica's token-in/token-out endpoints (probed once it answers); None: chat mode."""
        if replica not in self._token_endpoints:
            engine = TokenEngine(self.upstream.client, replica, timeout_s=self.settings.upstream_timeout_s)
            try:
                found = await engine.probe()
            except (EngineError, TokenEngineError) as exc:
                logger.info("could not ask %s for its token-in/token-out endpoints (%r); chat mode until it answers",
                            replica, exc)
                return None
            if replica not in self._token_endpoints:
                logger.info("replica %s: %s", replica, "continuation mode" if found else
                            "chat mode (no token-in/token-out endpoints: start vLLM with --enable-scale-out)")
            self._token_endpoints[replica] = found
        return self._token_endpoints[replica]

    async def _exchange(self, call: _Call, replica: str) -> _Attempt:
        """Send the engine request to ``replica``; its answer's status is in, its body still to read.

        Raises:
            EngineError: no answer (the caller tries the next replica, or times the call out).
        """
        request = await self._engine_request(call, replica)
        endpoints = request.continuation
        span = telemetry.tracer.start_span("upstream chat.completions" if endpoints is None else "upstream generate",
                                           kind=SpanKind.CLIENT, attributes={"server.address": replica})
        before = await self.upstream.read_weight_version(replica) if endpoints is None else None
        attempt = call.attempt = _Attempt(replica, request.sent, span, before)
        try:
            with call.watch.armed():
                if endpoints is None:
                    attempt.response = await self.upstream.client.post(f"{replica}/v1/chat/completions", request.sent)
                else:
                    engine = TokenEngine(self.upstream.client, replica, timeout_s=self.settings.upstream_timeout_s)
                    call.planned, attempt.response = await exchange(
                        engine, endpoints, self.histories.of(call.caller.rollout_id), call.chat, streamed=call.streamed)
                    if call.planned is not None:
                        call.capture.drift_reason = call.planned.prompt.drift
        except EngineError:
            attempt.end()
            raise
        return attempt

    @staticmethod
    def _built_turn(call: _Call) -> Turn | None:
        """A continuation call's turn, to join its rollout's history once the call is recorded."""
        answer = call.capture.first_answer()
        if call.planned is None or answer is None:
            return None
        sampled, message = answer
        return call.planned.turn(call.capture.call_id, sampled, message)

    async def _engine_refused(self, attempt: _Attempt) -> NoReturn:
        """End a call the engine answered with an error status, with the engine's own message."""
        response = attempt.response
        try:
            detail = (await response.read_and_close()).decode("utf-8", "replace")[:2000]
        except EngineError as exc:
            detail = repr(exc)
        raise _CallFailed(response.status, CallStatus.UPSTREAM_ERROR, _engine_message(detail))

    async def _relay_whole(self, call: _Call, attempt: _Attempt) -> Response:
        """Read the engine's whole answer, translate it, record the call, then answer the harness."""
        payload, answer_bytes = await self._read_whole(call, attempt)
        upstream_s = time.perf_counter() - attempt.started
        attempt.end()
        aborted = _aborted(payload.get("choices"))
        if aborted and call.adapter.protocol is not ApiProtocol.OPENAI_CHAT:
            raise _CallFailed(502, CallStatus.UPSTREAM_ERROR, ABORTED, upstream_status=attempt.response.status)
        answer = self._translate_whole(call, attempt, payload)
        call.capture.weight_version = await self._weight_version(attempt)
        call.watch.stop()
        gone = call.watch.gone or await call.request.is_disconnected()
        await self._record_whole(call, attempt, answer_bytes, aborted=aborted, gone=gone)
        if not (aborted or gone):  # as for streams and refusals: only answers that served the harness
            telemetry.added_latency.record(max(0.0, call.capture.elapsed() - upstream_s),
                                           {"protocol": call.adapter.protocol.value, "streamed": False})
        call.span.end()
        return _json(answer, 200)

    async def _read_whole(self, call: _Call, attempt: _Attempt) -> tuple[dict[str, Any], bytes]:
        """The engine's whole answer, parsed and taken in by the capture, and its bytes as they came.

        A harness that hangs up while the answer is read cancels the read (and the engine's work).
        """
        response = attempt.response
        finished = False
        try:
            with call.watch.armed():
                answer_bytes = await response.read()
            parsed, prompt_ids = _without_prompt_ids(answer_bytes, call.asked)
            payload = orjson.loads(parsed)
            call.capture.prompt_ids_json = prompt_ids  # only a readable answer's
            finished = True
        except EngineTimeoutError as exc:  # the answer began and did not end in time
            raise _CallFailed(504, CallStatus.UPSTREAM_TIMEOUT, f"engine timed out: {exc!r}") from exc
        except (EngineError, orjson.JSONDecodeError) as exc:
            raise _CallFailed(502, CallStatus.UPSTREAM_ERROR, f"engine answer unreadable: {exc!r}") from exc
        finally:
            response.close(finished=finished)
        try:
            if not isinstance(payload, dict):
                raise TypeError(f"a JSON {type(payload).__name__}, not an object")
            call.capture.on_response(payload)
        except (TypeError, AttributeError, KeyError, ValueError) as exc:  # not a chat completion
            call.capture.discard_answer()
            raise _CallFailed(502, CallStatus.UPSTREAM_ERROR, f"engine answer not understood: {exc!r}",
                              upstream_status=response.status) from exc
        return payload, answer_bytes

    def _translate_whole(self, call: _Call, attempt: _Attempt, payload: dict[str, Any]) -> dict[str, Any]:
        """The harness's answer, translated before the call is recorded: an answer it never got is not ok."""
        try:
            return call.adapter.from_chat(payload, call.body, call.asked, context=self._context.get(attempt.replica))
        except Exception as exc:  # whatever broke, the call is recorded
            if not isinstance(exc, ProxyError):
                logger.exception("translating the engine's answer failed (call %s)", call.capture.call_id)
            call.capture.discard_answer()
            status, code = ((CallStatus.UPSTREAM_ERROR, 502) if isinstance(exc, ProxyError)
                            else (CallStatus.INTERNAL_ERROR, 500))
            raise _CallFailed(code, status, f"engine answer not translated: {exc!r}",
                              upstream_status=attempt.response.status) from exc

    async def _record_whole(self, call: _Call, attempt: _Attempt, answer_bytes: bytes, *, aborted: bool,
                            gone: bool) -> None:
        """Record a whole answer's call as what it served: an abort, an answer nobody took, or the answer."""
        capture, engine_status = call.capture, attempt.response.status
        if aborted:  # a chat answer: passed on as the engine sent it, recorded as its failure
            await self._record(capture, CallStatus.UPSTREAM_ERROR, error_message=ENGINE_ABORTED,
                               upstream_status_code=engine_status, replica=attempt.replica,
                               fingerprint=call.fingerprint)
            call.span.set_status(Status(StatusCode.ERROR, ENGINE_ABORTED))
        elif gone:
            # Nobody takes this answer: a harness that timed out sends the call again, and that
            # must be linked to this one as its retry, not counted as the next turn.
            await self._record(capture, CallStatus.CLIENT_DISCONNECTED, upstream_status_code=engine_status,
                               replica=attempt.replica, fingerprint=call.fingerprint)
            call.span.set_status(Status(StatusCode.ERROR, HARNESS_GONE))
        else:
            await self._record(capture, CallStatus.OK, upstream_status_code=engine_status, replica=attempt.replica,
                               exchange=EngineExchange(attempt.sent, answer_bytes, call.asked),
                               fingerprint=call.fingerprint, built=self._built_turn(call))
        self.retries.end(capture.rollout_id, call.fingerprint, capture.call_id, ok=not (aborted or gone))

    async def _hung_up(self, call: _Call) -> Response:
        """End a whole answer's call whose harness hung up while the engine worked on it."""
        if call.attempt is not None:  # the watch fires only in armed blocks, which run inside the engine call
            call.attempt.span.set_status(Status(StatusCode.ERROR, HARNESS_GONE))
            call.attempt.end()
        call.watch.stop()
        return await self._fail(call, _CallFailed(499, CallStatus.CLIENT_DISCONNECTED, HARNESS_GONE))

    def _stream(self, call: _Call, attempt: _Attempt) -> StreamingResponse:
        """Relay the engine's stream as it comes; only its end waits for the call's record."""
        session = call.adapter.stream(call.body, call.asked, context=self._context.get(attempt.replica))
        relay = _StreamRelay(self, call, attempt, session)
        return StreamingResponse(relay.run(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def _weight_version(self, attempt: _Attempt) -> str | None:
        """In chat mode, the weight version that made the answer; otherwise unknown.

        That is the replica's version read fresh after the answer ended, when it equals the reading
        before the call. Continuation mode needs no reading: the engine reports it per token.
        """
        if attempt.version_before is None:
            return None
        return _same(attempt.version_before, await self.upstream.read_weight_version(attempt.replica))

    async def _finish_stream(self, call: _Call, status: CallStatus, error: str | None) -> str | None:
        """Record a stream's call; the message to end the stream with when its record could not be kept."""
        capture = call.capture
        unrecorded: str | None = None
        if call.attempt is not None:
            capture.weight_version = await self._weight_version(call.attempt)
        with trace.use_span(call.span, end_on_exit=True):
            try:
                await self._record(capture, status, error_message=error, upstream_status_code=200,
                                   replica=call.replica, fingerprint=call.fingerprint,
                                   built=self._built_turn(call) if status is CallStatus.OK else None)
            except CallLogUnavailableError as exc:  # the answer's headers are long gone: no 503 now
                unrecorded = exc.message
            else:
                self.retries.end(capture.rollout_id, call.fingerprint, capture.call_id, ok=status is CallStatus.OK)
            ok = status is CallStatus.OK and unrecorded is None
            if not ok:
                call.span.set_status(Status(StatusCode.ERROR, unrecorded or status.value))
        return unrecorded

    def _record_in_background(self, call: _Call, status: CallStatus, message: str) -> None:
        """Record a call whose handler is being cancelled; the server drains these before the journal closes."""
        call.span.set_status(Status(StatusCode.ERROR, message))  # the handler ends the span as it unwinds

        async def record() -> None:
            with trace.use_span(call.span, end_on_exit=False):  # the event carries the call's trace
                try:
                    await self._record(call.capture, status, error_message=message, replica=call.replica,
                                       fingerprint=call.fingerprint)
                except CallLogUnavailableError:
                    return  # logged where it failed; nobody is left to answer
                self.retries.end(call.capture.rollout_id, call.fingerprint, call.capture.call_id, ok=False)

        self._in_background(record())

    def _in_background(self, recording: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Run the recording of a call whose handler may unwind before it ends; :meth:`drain` waits for it."""
        task = asyncio.create_task(recording)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _fail(self, call: _Call, failed: _CallFailed) -> Response:
        """Record the failed call and answer the harness ``failed.http_status`` in its API's shape.

        ``failed.upstream_status`` is the engine's own status when it answered (an answer that
        could not be used); otherwise an engine error's status is the one the harness gets.
        """
        upstream_status = failed.upstream_status
        if upstream_status is None and failed.status is CallStatus.UPSTREAM_ERROR:
            upstream_status = failed.http_status
        if call.attempt is not None:
            call.attempt.end()
        capture = call.capture
        await self._record(capture, failed.status, error_message=failed.message,
                           upstream_status_code=upstream_status, replica=call.replica, fingerprint=call.fingerprint)
        self.retries.end(capture.rollout_id, call.fingerprint, capture.call_id, ok=False)
        call.span.set_status(Status(StatusCode.ERROR, failed.message))
        call.span.end()
        kind = "api_error" if failed.http_status >= 500 else "invalid_request_error"
        return _json(call.adapter.error(failed.http_status, failed.message, kind), failed.http_status)

    async def _record(self, capture: CallCapture, status: CallStatus, *, error_message: str | None = None,
                      upstream_status_code: int | None = None, replica: str | None = None,
                      exchange: EngineExchange | None = None, fingerprint: bytes | None = None,
                      built: Turn | None = None) -> None:
        # With capture off the call is still counted: the metrics are the operator's view of the
        # proxy, and the benchmark's capture-off baseline must differ from capture on by capture alone.
        capture.recording = True
        if error_message is not None:
            error_message = _clipped(error_message)
        if fingerprint is not None:
            capture.attempt, capture.retry_of = self.retries.settle(capture.call_id)
        # One turn per call joins the rollout's history, and only once its event is journalled: a
        # later call neither continues from nor references a call that has no event.
        if not self.settings.capture:
            if built is not None:
                self.histories.of(capture.rollout_id).record(built)
        else:
            reference = self._reference(capture, status, built)
            try:
                await self.publisher.publish_call(capture, status, upstream_status_code=upstream_status_code,
                                                  error_message=error_message, upstream_replica=replica,
                                                  exchange=exchange)
            except OSError as exc:  # the journal's disk; nothing half-written is left behind
                if fingerprint is not None:  # a re-send is not a retry of a call no event carries
                    self.retries.forget(capture.rollout_id, fingerprint, capture.call_id)
                logger.error("call %s of rollout %s could not be recorded: %s", capture.call_id,
                             capture.rollout_id, exc)
                raise CallLogUnavailableError(f"the call could not be recorded ({exc}); retry later") from exc
            if reference is not None and reference.turn is not None:
                self.histories.of(capture.rollout_id).record(reference.turn)
        telemetry.calls.add(1, {"protocol": capture.protocol.value, "status": capture.outcome(status).value})
        telemetry.tokens.add(capture.prompt_token_count, {"kind": "prompt"})
        telemetry.tokens.add(capture.completion_tokens, {"kind": "completion"})
        if capture.first_token_s is not None:
            telemetry.time_to_first_token.record(capture.first_token_s, {"protocol": capture.protocol.value})

    def _reference(self, capture: CallCapture, status: CallStatus, built: Turn | None) -> Reference | None:
        """What the call repeats of an earlier call of its rollout, by reference (linear events).

        Only a call that sampled is referenced later, and only once its event is journalled.
        ``built``: the call's turn where continuation built its prompt.
        """
        if capture.outcome(status) is not CallStatus.OK or not capture.prompt_token_count:
            return None
        request = capture.request
        try:
            reference = refer(self.histories.of(capture.rollout_id), capture.call_id, capture.prompt_token_ids,
                              capture.first_sampled(), request.messages, request.tools, built=built)
        except Exception:  # a reference only saves bytes: the call is recorded whole
            logger.exception("call %s of rollout %s: no prompt reference; recorded whole", capture.call_id,
                             capture.rollout_id)
            return None if built is None else Reference(None, built)  # continuation still extends it
        capture.prompt_prefix = reference.prefix
        return reference


class _StreamRelay:
    """One streamed answer on its way from the engine to the harness, and how it ended.

    Chunks go to the harness as they come; what ends its answer (the closing events, or the error
    that replaces them) is held until the call's record is durable, and so is a tool call's
    closing event, on which harnesses run the tool, with everything after it.
    """

    def __init__(self, service: CallService, call: _Call, attempt: _Attempt, session: StreamSession) -> None:
        self.service = service
        self.call = call
        self.attempt = attempt
        self.session = session
        self.held: list[bytes] = []
        """What ends the answer (from a tool call's closing event on), sent once the call is recorded."""
        self.finished = False
        """The answer has its finish reason: what comes now is the end."""
        self.stopped = False
        """The relay ended the answer early (an engine error, an abort, a refused chunk)."""
        self.broken = False
        """The engine's stream failed: its connection is not reused."""
        self.cut: str | None = None
        """Why a chat answer relayed as the engine sent it is not whole."""
        self.first = True
        self.status = CallStatus.CLIENT_DISCONNECTED
        self.error: str | None = None
        self.keepalive_s = service.settings.stream_keepalive_s
        # A translated stream is told when the engine goes silent (a queue or a prefill before the
        # first token, a pause for new weights) as well as when its chunks make no event.
        self.idle_s = None if call.adapter.protocol is ApiProtocol.OPENAI_CHAT else self.keepalive_s
        self.sent_at = 0.0

    async def run(self) -> AsyncIterator[bytes]:
        """The harness's stream: the engine's chunks as they come, then what was held once the call is recorded."""
        self.sent_at = time.monotonic()
        try:
            async for line in self.attempt.response.lines(idle_s=self.idle_s):
                if line is IDLE:
                    out = self._keepalive()
                    if out:
                        yield out
                        self.sent_at = time.monotonic()
                    continue
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                out = self._take(data)
                if self.stopped:
                    break
                if out:
                    yield out
                    self.sent_at = time.monotonic()
                    # With the engine ahead of us, reading and writing never suspend; give the
                    # disconnect listener its turn, or a gone harness goes unnoticed.
                    await asyncio.sleep(0)
            else:
                if not self.finished:
                    raise EngineError("engine stream ended without [DONE]")
            self._end()
        except (EngineError, orjson.JSONDecodeError, _ChunkShapeError) as exc:
            self._broke(exc)
        except BaseException as exc:
            self._abandoned(exc)
            raise
        for out in await self._recorded():
            yield out

    def _hold(self, out: bytes) -> None:
        # Tells the session that the call which made ``out`` began what is held back (what
        # ``unrecorded`` replaces).
        if not self.held:
            self.session.hold()
        self.held.append(out)

    def _stop(self, status: CallStatus, error: str, out: bytes) -> None:
        """End the answer here, with ``out`` (held) as its last bytes."""
        self.status, self.error, self.stopped = status, error, True
        self._hold(out)

    def _keepalive(self) -> bytes:
        """An event that only says the answer is coming, when the harness has been sent nothing for a while.

        None once something is held: it would come before what is held (and, in a Responses stream,
        take a sequence number after it).
        """
        if not self.finished and not self.held and time.monotonic() - self.sent_at >= self.keepalive_s:
            return self.session.keepalive()
        return b""

    def _take(self, data: bytes) -> bytes:
        """Capture and translate one engine chunk; what to send the harness now (what ends its answer is held)."""
        call, session = self.call, self.session
        prompt_ids = None
        opening = self.first
        if opening:  # vLLM sends the prompt's ids once, with the first chunk
            self.first = False
            data, prompt_ids = _without_prompt_ids(data, call.asked)
        chunk = orjson.loads(data)
        if type(chunk) is not dict or type(chunk.get("choices") or []) is not list \
                or any(type(c) is not dict for c in chunk.get("choices") or ()):
            raise _ChunkShapeError(f"an engine chunk that is not a chat completion chunk: {data[:200]!r}")
        if prompt_ids is not None:  # only a readable chunk's
            call.capture.prompt_ids_json = prompt_ids
        if "error" in chunk and not chunk.get("choices"):
            detail = chunk["error"]
            error = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
            self._stop(CallStatus.UPSTREAM_ERROR, error, session.fail(_engine_message(error)))
            return b""
        try:
            call.capture.on_chunk(chunk)
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            raise _ChunkShapeError(f"an engine chunk not understood: {exc!r}") from exc
        if opening and call.capture.prompt_token_count:
            session.prompt_length(call.capture.prompt_token_count)
        ends = any(c.get("finish_reason") for c in chunk.get("choices") or ())  # one choice: n is refused
        if ends and _aborted(chunk["choices"]):  # looked for only in the chunk that ends the answer
            if call.adapter.protocol is not ApiProtocol.OPENAI_CHAT:
                self._stop(CallStatus.UPSTREAM_ERROR, ABORTED, session.fail(ABORTED))
                return b""
            self.cut = ENGINE_ABORTED
        self.finished = self.finished or ends
        out = session.feed(chunk)
        if session.failure is not None:  # the translator refused the chunk and ended the stream
            self._stop(CallStatus.UPSTREAM_ERROR, session.failure, out)
            return b""
        if not out:
            out = self._keepalive()  # a long think the translation carries nothing of
        if out and (self.finished or self.held or session.tool_closed):
            # The answer's end, or a tool call's closing event, which harnesses act on as on the
            # end: held with all that follows until the call is recorded.
            self._hold(out)
            return b""
        return out

    def _outcome(self) -> tuple[CallStatus, str | None]:
        """How a stream that reached its end is recorded."""
        return (CallStatus.OK, None) if self.cut is None else (CallStatus.UPSTREAM_ERROR, self.cut)

    def _end(self) -> None:
        """Hold the answer's end: its closing events, or the error of an answer that never began."""
        if self.error is None and not self.finished and self.call.capture.completion_tokens == 0:
            # [DONE] before any finish reason or token: how vLLM ends an answer aborted before its
            # first token (its final chunk comes only with a token). An answer with tokens and no
            # finish reason goes on as it came: an engine that drops its last chunk would
            # otherwise fail the same call on every retry.
            if self.call.adapter.protocol is not ApiProtocol.OPENAI_CHAT:
                self._stop(CallStatus.UPSTREAM_ERROR, UNFINISHED, self.session.fail(UNFINISHED))
            else:
                self.cut = ENGINE_UNFINISHED
        if self.error is None:
            self.status, self.error = self._outcome()
            self._hold(self.session.finish())
            if self.session.failure is not None:  # e.g. a Responses answer without an end
                self.status, self.error = CallStatus.UPSTREAM_ERROR, self.session.failure

    def _broke(self, exc: Exception) -> None:
        """The engine's stream failed or broke its form."""
        self.broken = True
        if self.error is None and self.session.ended and self.session.failure is None:
            # Only the engine's [DONE] was missing: the harness's answer is whole and ends as it
            # would have, and the call is recorded as what it served.
            self.status, self.error = self._outcome()
        else:
            timed_out = isinstance(exc, EngineTimeoutError)
            self.status = CallStatus.UPSTREAM_TIMEOUT if timed_out else CallStatus.UPSTREAM_ERROR
            self.error = f"engine {'timed out' if timed_out else 'stream broke'}: {exc!r}"
            self._hold(self.session.fail(self.error))

    def _abandoned(self, exc: BaseException) -> None:
        """The harness went away (the task is cancelled or the generator closed), or the proxy failed.

        The engine request is cancelled by closing it, and what was sampled is still recorded.
        Anything but a hang-up is a fault of the proxy, recorded as such.
        """
        disconnected = isinstance(exc, asyncio.CancelledError | GeneratorExit)
        self.attempt.response.close(finished=False)
        self.attempt.end()
        self.service._in_background(self.service._finish_stream(
            self.call, CallStatus.CLIENT_DISCONNECTED if disconnected else CallStatus.INTERNAL_ERROR,
            None if disconnected else f"proxy failed mid-stream: {exc!r}"))

    async def _recorded(self) -> list[bytes]:
        """Record the call; then what was held, or the stream's error when the record was lost."""
        call, attempt = self.call, self.attempt
        attempt.response.close(finished=not self.broken and (self.status is CallStatus.OK or self.cut is not None
                                                              or self.error == UNFINISHED))
        attempt.end()
        upstream_s = time.perf_counter() - attempt.started
        # Shielded: a harness that hangs up while the record is written (its flush to disk, with
        # JOURNAL_FSYNC_INTERVAL_MS=0) cancelled this between the record and the retry tracker's end,
        # leaving the attempt in flight for good. The recording now runs to its end regardless.
        unrecorded = await asyncio.shield(
            self.service._in_background(self.service._finish_stream(call, self.status, self.error)))
        if unrecorded is not None:
            # The harness must not keep an answer whose record is lost: it gets the stream's error
            # instead of its end, and sends the call again.
            return [self.session.unrecorded(unrecorded)]
        if self.status is CallStatus.OK:
            # As for whole answers: the proxy's own time before the engine's stream and after it
            # (recording the call); relaying chunks overlaps the engine's generation.
            telemetry.added_latency.record(max(0.0, call.capture.elapsed() - upstream_s),
                                           {"protocol": call.adapter.protocol.value, "streamed": True})
        return self.held


def _normalise(adapter: Adapter, body: Any) -> tuple[dict[str, Any], bytes]:
    """The request in chat form, and its conversation (what makes a re-send the same turn).

    Raises:
        ProxyError: the request is refused (the harness's fault), in its API's terms.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        chat = adapter.to_chat(body)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # A shape the translator's checks did not foresee (a list where a name belongs): still
        # the request's fault, and still answered in the API's own error shape.
        logger.warning("request translation failed on unexpected input", exc_info=True)
        raise InvalidRequestError(f"the request could not be translated: {exc!r}") from exc
    # A re-send of the same conversation is a retry even if transport details differ: Claude Code
    # falls back from streaming to a whole answer with a smaller max_tokens.
    conversation = dumps_within_depth({k: chat.get(k) for k in _CONVERSATION_KEYS}, option=orjson.OPT_SORT_KEYS)
    # The rest is sent whole later, once the call counts as an attempt, and a Responses answer
    # echoes most of its request (metadata, text, reasoning, tools): encoded now only to learn
    # that they can be, and be recorded, so a field too deep is refused here and not answered 500
    # without a record. The whole Responses body rather than a list of the echoed fields, so a
    # field the echo gains later is covered too.
    dumps_within_depth({k: v for k, v in chat.items() if k not in _CONVERSATION_KEYS})
    if adapter.protocol is ApiProtocol.OPENAI_RESPONSES:
        dumps_within_depth(body)
    return chat, conversation


def _has_media(chat: dict[str, Any]) -> bool:
    """Whether a chat request carries media parts (which continuation's token ids alone would not hold)."""
    for message in chat.get("messages") or ():
        content = message.get("content") if type(message) is dict else None
        if type(content) is list and any(type(part) is dict and (part.get("type") in MEDIA_PARTS
                                                                  or not MEDIA_PARTS.isdisjoint(part))
                                         for part in content):
            return True
    return False


def _taken_back(watch: HangupWatch) -> bool:
    """Whether the task's cancellation was the hang-up watch's alone; then it is taken back."""
    task = asyncio.current_task()
    return watch.cancelled and task is not None and task.uncancel() == 0


def _aborted(choices: Any) -> bool:
    """Whether the engine cut this answer short.

    vLLM ends every answer in flight with ``finish_reason: "abort"`` when a replica is paused in
    its default mode (``abort``) or shuts down. Anthropic's stop reasons and Responses' statuses
    have no such value: as ``end_turn`` or ``completed`` the harness would act on half an answer,
    so it gets a retryable error instead (a 502, or the stream's error event). Chat completions
    pass it on as the engine said it. Either way the call is recorded as an engine error with
    what was sampled, and a call sent again is linked to it as a retry.
    """
    return type(choices) is list and any(type(c) is dict and c.get("finish_reason") == "abort" for c in choices)


def _without_prompt_ids(body: bytes, asked: dict[str, Any]) -> tuple[bytes, bytes | None]:
    """The engine's JSON to parse, and its prompt ids cut out unparsed, unless the harness asked for them."""
    return (body, None) if asked.get("return_token_ids") else cut_prompt_ids(body)


def _context_length(models: object) -> int | None:
    """``max_model_len`` of the first model in an engine's ``/v1/models`` answer, if it gives one."""
    if isinstance(models, dict) and isinstance(data := models.get("data"), list) and data \
            and isinstance(data[0], dict):
        value = data[0].get("max_model_len")
        if type(value) is int and value > 0:
            return value
    return None


class _ChunkShapeError(Exception):
    """A stream chunk that is JSON but not a chat completion chunk: the engine's fault, as broken JSON is."""


def _same(before: str | None, after: str | None) -> str | None:
    """The weight version if it did not change during the call, else unknown."""
    return before if before is not None and before == after else None


_CONVERSATION_KEYS = ("messages", "tools", "tool_choice", "response_format")
"""What makes two requests the same turn: a re-send of these is a retry, however its transport
details (streaming, max_tokens) differ."""

_REFUSED_STRING_CHARS = 64 * 1024
"""Longest string, in characters, a refused request's record keeps whole. What is longer is mostly
media (a base64 image, a PDF), which says nothing about the refusal and would take the event past
the calls topic's limit, to the dead-letter topic; a pasted file that long is cut as well."""

_REFUSED_DEPTH = 64
"""Deepest nesting a refused request's record keeps: far beyond any real request, and well inside
the 254 levels events are written and read to, so a refused body that is nested past what could
be written is still recorded (cut there)."""

_REFUSED_TOTAL = 1024 * 1024
"""Most of a refused body its record keeps, counted in characters of strings and keys, and two
for every value (scalars eight). A body may be 32 MiB and the calls topic takes 16: a body of many strings
each under :data:`_REFUSED_STRING_CHARS` (or of many small values) would still take the event to
the dead-letter topic. Past this, the rest of each list and object is one marker, so even text that
escapes to six bytes a character keeps the event well inside the topic's limit."""

_CUT_KEY = "[not recorded]"
"""The key of the marker that stands for an object's fields past :data:`_REFUSED_TOTAL`."""


def _untranslated(body: Any) -> NormalizedRequest:
    """What a refused request asked for, kept once, so the refusal can be studied later.

    The body goes under ``extra["untranslated"]`` as the harness sent it (not in chat form, so not
    in ``messages``), save strings and keys over :data:`_REFUSED_STRING_CHARS`, what is nested deeper than
    :data:`_REFUSED_DEPTH` and what comes after the first :data:`_REFUSED_TOTAL` characters, each
    replaced by a marker.
    """
    if not isinstance(body, dict):
        return NormalizedRequest(messages=[])
    return NormalizedRequest(messages=[], extra={"untranslated": _Bounded().value(body, _REFUSED_DEPTH)})


def _cut(text: str) -> str:
    """``text``, or its first 256 characters and a marker when it is over :data:`_REFUSED_STRING_CHARS`."""
    if len(text) <= _REFUSED_STRING_CHARS:
        return text
    return f"{text[:256]}…[{len(text) - 256} more characters not recorded]"


_ERROR_CHARS = 4096
"""Longest error message a call's event and its error answer carry. Refusals quote the value they
refuse (``max_tokens must be an integer, got '…'``), and a value can be megabytes long."""


def _clipped(message: str) -> str:
    if len(message) <= _ERROR_CHARS:
        return message
    return f"{message[:_ERROR_CHARS]}…[{len(message) - _ERROR_CHARS} more characters]"


class _Bounded:
    """One walk over a refused body, with what is left of :data:`_REFUSED_TOTAL`."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = _REFUSED_TOTAL

    def value(self, value: Any, depth: int) -> Any:
        self.left -= 2  # every value, so that a body of empty ones ([], "", {}) is bounded too
        if isinstance(value, str):
            value = _cut(value)
            self.left -= len(value)
            return value
        if isinstance(value, dict | list) and depth == 0:
            self.left -= 48
            return f"[nested deeper than {_REFUSED_DEPTH} levels; not recorded]"
        if isinstance(value, dict):
            fields: dict[str, Any] = {}
            for i, (key, item) in enumerate(value.items()):
                if self.left <= 0:
                    fields[_CUT_KEY] = f"[{len(value) - i} more fields not recorded: the record's limit]"
                    break
                name = _cut(key)
                if name is not key:  # a key that long is cut as a string is; two cut alike stay apart
                    name = f"{name}#{i}"
                self.left -= len(name) + 4
                fields[name] = self.value(item, depth - 1)
            return fields
        if isinstance(value, list):
            items: list[Any] = []
            for i, item in enumerate(value):
                if self.left <= 0:
                    items.append(f"[{len(value) - i} more items not recorded: the record's limit]")
                    break
                items.append(self.value(item, depth - 1))
            return items
        self.left -= 8
        return value


def _engine_message(detail: str) -> str:
    """The engine's own error message when it sent JSON, else the text."""
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
        parsed = orjson.loads(detail)
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if parsed.get("message"):
            return str(parsed["message"])
    return detail


def _json(payload: dict[str, Any], status: int) -> Response:
    try:
        content = orjson.dumps(payload)
    except orjson.JSONEncodeError:
        # orjson refuses integers past 64 bits, which a translated tool call's input can hold
        # (the model wrote one); see proxy/exact_json.py.
        content = exact_json.dumps(payload)
    return Response(content, status_code=status, media_type="application/json")
