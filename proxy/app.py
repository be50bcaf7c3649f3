"""The proxy's FastAPI application: routes, lifespan, and the shared state behind them."""

from __future__ import annotations

import contextlib
import gc
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from producers.disk_room import JournalSpace
from producers.journal import Journal
from producers.shipper import JournalPublisher, spool_path, take_over_spool
from proxy import telemetry
from proxy.adapters import Adapter, ChatAdapter
from proxy.anthropic.adapter import AnthropicAdapter
from proxy.anthropic.translate import error_body as anthropic_error_body
from proxy.auth import Authenticator, UnauthorizedError
from proxy.engine_client import EngineError
from proxy.errors import CallLogUnavailableError, InvalidRequestError, ProxyError
from proxy.media import ImagePolicy
from proxy.nesting import dumps_within_depth
from proxy.responses.adapter import ResponsesAdapter
from proxy.service import Caller, CallService
from proxy.settings import ProxySettings
from proxy.upstream import UpstreamPool
from schemas import RewardV1
from schemas.credentials import Role
from stream import REWARDS, EventProducer, EventTooLargeError, KafkaSettings, TopicRegistry

logger = logging.getLogger(__name__)


@dataclass
class AppState:
    """Everything the routes share, typed (instead of loose ``app.state`` attributes)."""

    settings: ProxySettings
    auth: Authenticator
    upstream: UpstreamPool
    publisher: JournalPublisher
    calls: CallService
    adapters: dict[str, Adapter]


def _publisher(settings: ProxySettings, registry: TopicRegistry, kafka: KafkaSettings,
               space: JournalSpace) -> JournalPublisher:
    """The journal in ``spool_dir`` and its shipper to Kafka, as the settings and its volume ask."""
    def producer() -> EventProducer:
        return EventProducer(kafka, registry=registry, client_id="openforge-proxy")

    journal = Journal(spool_path(settings.spool_dir), settings.spool_max_bytes, segment_bytes=space.segment_bytes)
    return JournalPublisher(producer, journal, registry, ack_timeout_s=settings.publish_timeout_s,
                            fsync_interval_s=settings.journal_fsync_interval_ms / 1000,
                            linger_s=settings.journal_linger_ms / 1000,
                            before_start=lambda: take_over_spool(settings.spool_dir, journal),
                            min_free_bytes=space.min_free_bytes,
                            outage_report_s=settings.kafka_outage_report_s)


def _refusal(publisher: JournalPublisher, what: str) -> str:
    """Why a call or reward is refused (503): the disk under the log, or the log's own bound."""
    if not publisher.disk.ok:
        return f"the disk under the {what} log is nearly full; retry later"
    return f"{what} log is full; retry later"


def _adapters(images: ImagePolicy) -> dict[str, Adapter]:
    return {"chat": ChatAdapter(images), "messages": AnthropicAdapter(images), "responses": ResponsesAdapter(images)}


def build_app(settings: ProxySettings | None = None, *, own_process: bool = False) -> FastAPI:
    """Create the proxy app; Kafka and the engines are connected in its lifespan.

    Args:
        settings: The proxy's settings (from the environment when None).
        own_process: The app is all its process serves (``openforge proxy``): after start-up,
            tune the garbage collector for it (:func:`_freeze_startup_heap`). Left off where the
            app shares a process, as in tests.
    """
    settings = settings or ProxySettings()
    auth = Authenticator(settings)  # fails fast on a missing key
    try:  # so does a volume too small for the journal
        space = JournalSpace.of(spool_path(settings.spool_dir), settings.min_free_disk_bytes)
    except OSError as exc:
        raise ValueError(f"the journal's folder {spool_path(settings.spool_dir)} cannot be used: {exc}") from exc
    logger.info("the journal's volume holds %d MiB: segments of %d MiB, %d MiB kept free for calls",
                space.volume_bytes >> 20, space.segment_bytes >> 20, space.min_free_bytes >> 20)
    registry = TopicRegistry.from_settings(settings.kafka)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upstream = UpstreamPool(settings.upstreams, timeout_s=settings.upstream_timeout_s)
        # The shipper makes its own batches (what gathered while the last was in flight, and its
        # linger): the client adding a linger of its own to each would only delay them.
        kafka = settings.kafka.model_copy(update={"linger_ms": 0})
        publisher = _publisher(settings, registry, kafka, space)
        await publisher.start()
        telemetry.observe_publisher(lambda: publisher.backlog, lambda: publisher.publish_errors,
                                    lambda: publisher.flush_errors)
        calls = CallService(settings, upstream, publisher)
        calls.detect_modes()
        app.state.openforge = AppState(settings, auth, upstream, publisher, calls, _adapters(settings.images))
        if own_process:
            _freeze_startup_heap()
        try:
            yield
        finally:
            await calls.drain(timeout_s=10.0)
            await publisher.stop()
            await upstream.aclose()

    app = _ProxyApp(title="OpenForge proxy", lifespan=lifespan, docs_url=None, redoc_url=None)

    def state(request: Request) -> AppState:
        result: AppState = request.app.state.openforge
        return result

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        if exc.status_code < 500:  # an engine that failed a helper request is not a refusal
            telemetry.refused.add(1, {"status": exc.status_code})
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own answers (no such route, a method the route does not take) were
        # {"detail": ...}, where the SDKs look for error.message and showed the harness nothing.
        return _error_response(request, _RoutingError(exc.status_code, _routing_message(request, exc),
                                                      dict(exc.headers or {})))

    async def read_body(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        # isascii: "²".isdigit() is true, and int() of it raises.
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body of {int(declared):,} bytes exceeds {limit:,}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"request body exceeds {limit:,} bytes")
                chunks.append(chunk)
        except ClientDisconnect as exc:
            # No call began, so nothing is recorded; an aborted upload is no fault of the proxy
            # (unhandled, the server logged a traceback for each one).
            raise InvalidRequestError("the client hung up before its request body was complete") from exc
        return b"".join(chunks)

    def refuse_encoded(request: Request) -> None:
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Read as it is, a compressed body would be refused as malformed JSON, naming nothing.
            raise UnsupportedEncodingError(f"request bodies with Content-Encoding {encoding!r} are not "
                                           "accepted; send the body uncompressed")

    async def call(request: Request, kind: str, rollout_id: str | None) -> Response:
        st = state(request)
        adapter = st.adapters.get(kind)
        if adapter is None:
            raise InvalidRequestError(f"this proxy does not serve the {kind} API")
        credential = st.auth.authenticate(request, rollout_id, need=Role.AGENT)
        if not st.publisher.accepting:
            telemetry.refused.add(1, {"status": 503})
            return Response(orjson.dumps(adapter.error(503, _refusal(st.publisher, "call"), "overloaded_error")),
                            status_code=503, media_type="application/json", headers={"retry-after": "5"})
        refuse_encoded(request)
        raw = await read_body(request, st.settings.max_body_bytes)
        return await st.calls.handle(request, adapter, Caller(credential.rollout_id, credential.task_id), raw)

    async def hot(request: Request, kind: str, rollout_id: str | None) -> Response:
        try:
            return await call(request, kind, rollout_id)
        except ProxyError as exc:
            if exc.status_code < 500:  # a record lost after the engine's work (503) was no refusal
                telemetry.refused.add(1, {"status": exc.status_code})
            return _error_response(request, exc)

    # The model-call routes are served ahead of FastAPI (see _ProxyApp); the FastAPI routes
    # below stay for the rest (trailing slashes, wrong methods) and the schema.
    app.hot_handler = hot

    for prefix in ("", "/rollouts/{rollout_id}"):
        def routes(prefix: str = prefix) -> None:
            @app.post(prefix + "/v1/chat/completions", include_in_schema=False)
            async def chat(request: Request, rollout_id: str | None = None) -> Response:
                return await call(request, "chat", rollout_id)

            @app.post(prefix + "/v1/messages", include_in_schema=False)
            async def messages(request: Request, rollout_id: str | None = None) -> Response:
                return await call(request, "messages", rollout_id)

            @app.post(prefix + "/v1/responses", include_in_schema=False)
            async def responses(request: Request, rollout_id: str | None = None) -> Response:
                return await call(request, "responses", rollout_id)

            @app.post(prefix + "/v1/messages/count_tokens", include_in_schema=False)
            async def count_tokens(request: Request, rollout_id: str | None = None) -> Response:
                st = state(request)
                st.auth.authenticate(request, rollout_id)
                adapter = st.adapters.get("messages")
                if adapter is None:
                    raise InvalidRequestError("this proxy does not serve the messages API")
                refuse_encoded(request)
                try:
                    body = orjson.loads(await read_body(request, st.settings.max_body_bytes))
                except orjson.JSONDecodeError as exc:
                    raise InvalidRequestError(f"malformed JSON: {exc}") from exc
                if not isinstance(body, dict):
                    raise InvalidRequestError("the request body must be a JSON object")
                body.setdefault("max_tokens", 1)
                try:
                    chat = adapter.to_chat(body)
                except (TypeError, ValueError, AttributeError, KeyError) as exc:  # as for the call itself
                    raise InvalidRequestError(f"the request could not be translated: {exc!r}") from exc
                dumps_within_depth(chat)  # as deep as the call itself may be, and no deeper
                replica = st.upstream.order(rollout_id or "count")[0]
                # The prompt the call itself would render: a prefill continues the last turn.
                payload: dict[str, Any] = {"model": await _served_model(st, replica), "messages": chat["messages"],
                                           "add_generation_prompt": chat.get("add_generation_prompt", True)}
                if chat.get("continue_final_message"):
                    payload["continue_final_message"] = True
                if chat.get("tools"):
                    payload["tools"] = chat["tools"]
                try:
                    status, answer = await st.upstream.client.post_json(f"{replica}/tokenize", orjson.dumps(payload),
                                                                        timeout_s=30.0)
                except EngineError as exc:
                    raise UpstreamFailedError(f"engine could not count tokens: {exc}") from exc
                if status != 200:
                    raise UpstreamFailedError(f"engine could not count tokens: {answer[:500].decode(errors='replace')}")
                try:
                    count = orjson.loads(answer)["count"]
                    if type(count) is not int:
                        raise TypeError(f"count is {count!r}")
                except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
                    raise UpstreamFailedError(f"engine's token count not understood: {exc!r}") from exc
                return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")

            @app.get(prefix + "/v1/models", include_in_schema=False)
            async def models(request: Request, rollout_id: str | None = None) -> Response:
                st = state(request)
                st.auth.authenticate(request, rollout_id)
                replica = st.upstream.order(rollout_id or "models")[0]
                name = await _served_model(st, replica)
                if "anthropic-version" in request.headers:
                    body: dict[str, Any] = {
                        "data": [{"type": "model", "id": name, "display_name": name,
                                  "created_at": "2026-01-01T00:00:00Z"}],
                        "has_more": False, "first_id": name, "last_id": name}
                else:
                    body = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "openforge",
                                                        "created": 0}]}
                return Response(orjson.dumps(body), media_type="application/json")

        routes()

    @app.post("/rollouts/{rollout_id}/reward", include_in_schema=False)
    async def reward(request: Request, rollout_id: str) -> Response:
        st = state(request)
        credential = st.auth.authenticate(request, rollout_id, need=Role.VERIFIER)
        refuse_encoded(request)
        try:
            body = orjson.loads(await read_body(request, min(_REWARD_BODY_BYTES, st.settings.max_body_bytes)))
            if not isinstance(body, dict):
                raise InvalidRequestError("the reward body must be a JSON object")
            dumps_within_depth(body)  # an info nested past what its event is written to was a 500
            # Strict, unlike the event's own validation: a misspelt field would drop its content
            # silently, and "0.5" or true read as numbers would hide a verifier's bug.
            unknown = sorted(set(body) - _REWARD_FIELDS)
            if unknown:
                raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}: a reward takes value and info")
            if type(body.get("value")) not in (int, float):
                shown = orjson.dumps(body.get("value")).decode() if "value" in body else "nothing"
                raise InvalidRequestError(f"value must be a JSON number, got {_clipped(shown)}")
            info = body.get("info")
            if info is not None and not isinstance(info, dict):
                # Checked here: an empty list or string would otherwise be stored as {} unsaid.
                raise InvalidRequestError(f"info must be a JSON object, got {_clipped(orjson.dumps(info).decode())}")
            event = RewardV1(rollout_id=credential.rollout_id, task_id=credential.task_id,
                             value=body.get("value"), info=info or {},
                             verifier_id=f"verifier:{credential.rollout_id}")
        except orjson.JSONDecodeError as exc:
            raise InvalidRequestError(f"malformed JSON: {exc}") from exc
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            raise InvalidRequestError(f"invalid reward: {problems}") from exc
        if not st.publisher.accepting:
            telemetry.refused.add(1, {"status": 503})
            full = {"error": {"message": _refusal(st.publisher, "event"), "type": CallLogUnavailableError.error_type}}
            return Response(orjson.dumps(full), status_code=503, media_type="application/json",
                            headers={"retry-after": "5"})
        try:
            outcome = await st.publisher.publish(REWARDS, event, wait_for_kafka=True)
        except EventTooLargeError as exc:
            # A body within the route's limit grows as an event (its envelope, numbers written
            # out in full): too large is the verifier's to fix, not a server error it would retry.
            raise PayloadTooLargeError(f"the reward's event would be too large for its topic: {exc}; "
                                       "keep info smaller") from exc
        except OSError as exc:  # the disk that keeps events: as for a call, retry later
            logger.error("the reward of rollout %s could not be kept: %s", credential.rollout_id, exc)
            raise CallLogUnavailableError(f"the reward could not be recorded ({exc}); retry later") from exc
        return Response(orjson.dumps({"event_id": event.event_id, "stored": outcome}), status_code=202,
                        media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready(request: Request) -> Response:
        st = state(request)
        engine = await st.upstream.ready()
        disk_ok = st.publisher.disk.ok  # asked apart: ``accepting`` does not look while another bound refuses
        accepting = st.publisher.accepting
        body = {"engine": engine, "kafka": st.publisher.kafka_ok, "spooled": st.publisher.backlog,
                "accepting": accepting, "disk_ok": disk_ok, "disk_free_bytes": st.publisher.disk.free_bytes,
                "flush_errors": st.publisher.flush_errors}
        # Spooling is degraded but serving; no engine or a full spool is not ready.
        ok = engine and accepting
        return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type="application/json")

    return app


def _freeze_startup_heap() -> None:
    """Tune the cyclic garbage collector for a long-lived server that allocates per call.

    The modules, the app, its clients and settings live as long as the process; frozen, they
    leave the collector's full passes, which walked all of them again (about 80 ms per pass,
    20 to 30 passes a minute under load, each one a stall of every call in flight). A call's
    own objects die with the call, so a larger first generation lets most of them go before a
    pass sees them. Over a run of the proxy benchmark, collection took 7 to 10% of the proxy's CPU
    with the defaults, 4 to 6% with the freeze alone, and under 1% with both.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 100)


def _clipped(text: str, limit: int = 80) -> str:
    """``text`` as shown in an error message: a rejected value may be most of a megabyte."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class _RoutingError(ProxyError):
    """An answer of FastAPI's router (404, 405), in the proxy's error shape."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = "invalid_request_error" if status_code < 500 else "api_error"
        self.headers = headers


def _routing_message(request: Request, exc: StarletteHTTPException) -> str:
    if exc.status_code == 404:
        return (f"no route {request.method} {request.url.path}: model calls are POST /v1/chat/completions, "
                "/v1/responses or /v1/messages, under /rollouts/<rollout id> or not")
    if exc.status_code == 405:
        return f"{request.method} is not allowed on {request.url.path}"
    return str(exc.detail)


def _error_response(request: Request, exc: ProxyError) -> Response:
    body: dict[str, Any] = {"error": {"message": exc.message, "type": exc.error_type}}
    path = request.url.path
    # Anthropic's clients read the model list too: as for its answer, the header tells whose.
    if "/v1/messages" in path or (path.endswith("/v1/models") and "anthropic-version" in request.headers):
        body = anthropic_error_body(exc.status_code, exc.message, exc.error_type)
    return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json",
                    headers=exc.headers or None)


_REWARD_FIELDS = frozenset({"value", "info"})
_REWARD_BODY_BYTES = 1024 * 1024
"""Largest reward body (or ``max_body_bytes``, if smaller): a verdict and its details, not the work."""
_HOT_PATH = re.compile(r"(?:/rollouts/(?P<rollout_id>[^/]+))?/v1/(?P<kind>chat/completions|messages|responses)")
_HOT_KINDS = {"chat/completions": "chat", "messages": "messages", "responses": "responses"}


class _ProxyApp(FastAPI):
    """FastAPI, with the ``POST`` model calls served ahead of its middleware and router.

    Matching a request against every route, solving the endpoint's dependencies and wrapping
    it in FastAPI's exception handling took about 15% of the proxy's CPU per call in profiles,
    and the middleware layers around the router (server errors, FastAPI's own telemetry and
    body limit) another 8 to 10% once the engine client was cheap. These routes need none of
    it: their only parameter is the rollout id in the path, their body limit is their own, and
    their only expected exception is ``ProxyError``. Anything else (other methods and paths,
    trailing slashes, the lifespan) goes to FastAPI unchanged. An unexpected exception reaches
    uvicorn, which logs it and answers 500, as the server-error middleware would have.

    So middleware added to this app does not see model calls, nor does FastAPI's own telemetry:
    the call service opens their server span itself, continuing a ``traceparent`` it was sent.
    """

    hot_handler: Callable[[Request, str, str | None], Awaitable[Response]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.hot_handler is not None:
            path: str = scope["path"]
            root: str = scope.get("root_path", "") or self.root_path
            if root and path.startswith(root):
                path = path[len(root):]
            match = _HOT_PATH.fullmatch(path)
            if match is not None:
                scope["app"] = self  # what Starlette sets, so that request.app works
                response = await self.hot_handler(Request(scope, receive), _HOT_KINDS[match["kind"]],
                                                  match["rollout_id"])
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class PayloadTooLargeError(ProxyError):
    """The body exceeds ``max_body_bytes`` (413)."""

    status_code = 413
    error_type = "request_too_large"


class UnsupportedEncodingError(ProxyError):
    """A request body in a Content-Encoding the proxy does not decode (415)."""

    status_code = 415
    error_type = "invalid_request_error"


class UpstreamFailedError(ProxyError):
    """The engine failed a helper request (502)."""

    status_code = 502
    error_type = "api_error"


async def _served_model(st: AppState, replica: str) -> str:
    """The engine's model name for a helper route; an engine that cannot say is a 502, not the proxy's 500."""
    try:
        return await st.calls.served_model(replica)
    except EngineError as exc:
        raise UpstreamFailedError(f"the engine could not be asked for its model: {exc}") from exc


__all__ = ["AppState", "UnauthorizedError", "build_app"]
