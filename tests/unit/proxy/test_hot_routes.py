"""Requests the plain-ASGI model-call handler does not take still get FastAPI's answers.

No lifespan runs here (no Kafka, no engine): each request below must be answered without the
proxy's state, which is exactly what shows it never reached the call pipeline.
"""

from __future__ import annotations

import httpx
import pytest

from proxy.app import _HOT_PATH, build_app
from proxy.settings import ProxySettings


@pytest.fixture
def client() -> httpx.AsyncClient:
    app = build_app(ProxySettings(credential_key="k" * 32))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


@pytest.mark.parametrize(("path", "kind", "rollout"), [
    ("/v1/chat/completions", "chat/completions", None),
    ("/v1/messages", "messages", None),
    ("/rollouts/r-1/v1/responses", "responses", "r-1"),
])
def test_hot_paths(path: str, kind: str, rollout: str | None) -> None:
    match = _HOT_PATH.fullmatch(path)
    assert match is not None
    assert (match["kind"], match["rollout_id"]) == (kind, rollout)


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/rollouts/a/b/v1/messages", "/v1/messages/x",
                                  "/rollouts//v1/messages", "/v2/chat/completions"])
def test_not_hot_paths(path: str) -> None:
    assert _HOT_PATH.fullmatch(path) is None


async def test_wrong_method_goes_to_fastapi(client: httpx.AsyncClient) -> None:
    async with client:
        response = await client.get("/v1/chat/completions")
        assert response.status_code == 405
        response = await client.post("/rollouts/a/b/v1/chat/completions", content=b"{}")
        assert response.status_code == 404
        assert (await client.get("/health")).json() == {"status": "ok"}


async def test_routing_errors_come_in_each_protocols_error_shape(client: httpx.AsyncClient) -> None:
    """FastAPI's {"detail": ...} has no error.message, which is what the SDKs show the harness."""
    async with client:
        wrong_method = await client.get("/v1/chat/completions")
        assert wrong_method.json()["error"] == {"message": "GET is not allowed on /v1/chat/completions",
                                                "type": "invalid_request_error"}
        assert wrong_method.headers["allow"] == "POST"
        anthropic = await client.get("/rollouts/r-1/v1/messages")
        assert anthropic.status_code == 405 and anthropic.json()["type"] == "error", anthropic.text
        assert anthropic.json()["error"]["message"] == "GET is not allowed on /rollouts/r-1/v1/messages"
        missing = await client.post("/rollouts/a%2Fb/v1/chat/completions", content=b"{}")
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["message"].startswith("no route POST /rollouts/a/b/v1/chat/completions")
        lost = await client.post("/rollouts/r-1/v1/messages/batches", content=b"{}")
        assert lost.json() == {"type": "error", "error": {"type": "not_found_error",
                                                          "message": lost.json()["error"]["message"]}}



async def test_health_answers_head(client: httpx.AsyncClient) -> None:
    async with client:
        assert (await client.head("/health")).status_code == 200  # probes and load balancers send HEAD
