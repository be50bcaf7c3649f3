"""Who may read the flight recorder: one shared credential, checked on every request.

The pages show prompts, tool output and rewards, so nothing is served without the credential. A
browser presents it once as ``?token=...``; the answer sets a cookie holding a keyed digest of it
(never the credential itself) and redirects to the same page without the token, so it does not
stay in the address bar or the history. Clients send ``Authorization: Bearer <credential>``.
Missing or wrong: 401.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlencode

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp

__all__ = ["COOKIE", "CredentialMiddleware"]

COOKIE = "openforge_ui"
"""Name of the session cookie."""

_OPEN_PATHS = frozenset({"/health"})
"""Paths served without a credential: liveness probes see no data."""

_UNAUTHORIZED = """<!doctype html><html><head><title>401 Unauthorized</title></head>
<body style="font-family:sans-serif;margin:3em"><h1>401 Unauthorized</h1>
<p>The flight recorder needs its credential: open the link <code>openforge ui</code> printed, or add
<code>?token=&lt;credential&gt;</code> to this address.</p></body></html>"""


class CredentialMiddleware(BaseHTTPMiddleware):
    """Refuses every request without the credential (401), except the health probe."""

    def __init__(self, app: ASGIApp, credential: str) -> None:
        super().__init__(app)
        self._credential = credential.encode()
        self._session = hmac.new(self._credential, b"openforge-ui-session", hashlib.sha256).hexdigest()

    def _valid(self, offered: str) -> bool:
        return hmac.compare_digest(offered.encode(), self._credential)

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        """Check the credential; turn a valid ``?token=`` into the session cookie."""
        if request.url.path in _OPEN_PATHS:
            return await call_next(request)
        token = request.query_params.get("token")
        if token is not None:
            if not self._valid(token):
                return _unauthorized()
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, self._session, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
            return response
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and self._valid(header[7:].strip()):
            return await call_next(request)
        cookie = request.cookies.get(COOKIE)
        if cookie is not None and hmac.compare_digest(cookie.encode(), self._session.encode()):
            return await call_next(request)
        return _unauthorized()


def _unauthorized() -> Response:
    return HTMLResponse(_UNAUTHORIZED, status_code=401, headers={"www-authenticate": 'Bearer realm="openforge-ui"'})
