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



async def test_health_answers_head(client: httpx.AsyncClient) -> None:
    async with client:
        assert (await client.head("/health")).status_code == 200  # probes and load balancers send HEAD
