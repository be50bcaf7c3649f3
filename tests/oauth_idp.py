"""A stand-in OAuth identity provider: a token endpoint (client credentials) and its JWKS.

No real identity provider runs on these machines, so the tests that need one say so in their
names and use this: the smallest server that issues RS256-signed JWTs the way Keycloak or Okta do
(``sub``, ``aud``, ``iss``, ``exp``, ``iat``, ``scope``; a ``kid`` found in the key set), and
refuses a wrong client as RFC 6749 says (HTTP 401, ``invalid_client``). Kafka's own validator
(``OAuthBearerValidatorCallbackHandler``) checks its tokens against ``/jwks``, so what reaches the
broker is judged by the real thing. Keys come from the ``openssl`` CLI.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote_plus

CLIENT_ID = "openforge-proxy"
CLIENT_SECRET = "idp-secret-" + uuid.uuid4().hex[:8]
AUDIENCE = "kafka"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def _authority_and_server_certificate(folder: Path) -> Path:
    """A throwaway authority (returned: its PEM) and a certificate for 127.0.0.1 it signed."""
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=stand-in-idp-authority")
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=stand-in-idp")
    _openssl(folder, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "1", "-extfile", "server.ext")
    return folder / "ca.pem"


class StandInIdentityProvider:
    """``/token`` and ``/jwks`` on 127.0.0.1, in a thread; :attr:`issued` counts tokens given out."""

    def __init__(self, folder: Path, *, lifetime_s: int = 3600, tls: bool = False) -> None:
        """``tls``: serve HTTPS with a certificate for 127.0.0.1 from a throwaway authority (:attr:`ca`)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.key = folder / "idp-key.pem"
        subprocess.run(["openssl", "genrsa", "-out", str(self.key), "2048"], check=True, capture_output=True)
        modulus = subprocess.run(["openssl", "rsa", "-in", str(self.key), "-noout", "-modulus"], check=True,
                                 capture_output=True, text=True).stdout.strip().split("=", 1)[1]
        self.kid = "stand-in-" + uuid.uuid4().hex[:6]
        self.jwks = {"keys": [{"kty": "RSA", "kid": self.kid, "use": "sig", "alg": "RS256",
                               "n": _b64url(bytes.fromhex(modulus)), "e": _b64url((65537).to_bytes(3, "big"))}]}
        self.lifetime_s = lifetime_s
        self.audience = AUDIENCE
        """The ``aud`` of the next tokens (a test changes it to have the broker refuse them)."""
        self.issued = 0
        self.requests: list[dict[str, list[str]]] = []
        """Every token request's form, in order."""
        self.client_secret = CLIENT_SECRET
        """The secret the client must show (a test sets one that form-encoding changes)."""
        self.form_decodes_basic = False
        """Read the basic-authentication id and secret form-decoded (RFC 6749, 2.3.1), as Keycloak does."""
        self.answer: Callable[[], tuple[int, bytes, str]] | None = None
        """When set, what ``/token`` answers instead (status, body, content type)."""
        self.trickle_s: float | None = None
        """When set, answers are sent a byte at a time with this pause between bytes (a provider that
        never stops sending, so no read ever times out)."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self._server.server_address[1]
        self.ca: Path | None = None
        if tls:
            self.ca = _authority_and_server_certificate(folder)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(folder / "server.pem", folder / "server.key")
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.issuer = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.token_url = f"{self.issuer}/token"
        self.jwks_url = f"{self.issuer}/jwks"
        self._thread = threading.Thread(target=self._server.serve_forever, name="stand-in-idp", daemon=True)

    def start(self) -> StandInIdentityProvider:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def sign(self, claims: dict[str, object]) -> str:
        head = _b64url(json.dumps({"alg": "RS256", "typ": "JWT", "kid": self.kid}).encode())
        body = _b64url(json.dumps(claims).encode())
        signed = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=f"{head}.{body}".encode(),
                                check=True, capture_output=True).stdout
        return f"{head}.{body}.{_b64url(signed)}"

    def _token(self, scope: str | None) -> bytes:
        now = int(time.time())
        claims: dict[str, object] = {"sub": CLIENT_ID, "aud": self.audience, "iss": self.issuer, "iat": now,
                                     "exp": now + self.lifetime_s, "jti": uuid.uuid4().hex}
        if scope:
            claims["scope"] = scope
        self.issued += 1
        return json.dumps({"access_token": self.sign(claims), "token_type": "Bearer",
                           "expires_in": self.lifetime_s}).encode()

    def _client(self, authorization: str) -> tuple[str, str] | None:
        """The id and secret of a basic ``Authorization`` header, read as this provider reads them."""
        scheme, _, encoded = authorization.partition(" ")
        try:
            id_, colon, secret = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        if scheme != "Basic" or not colon:
            return None
        if self.form_decodes_basic:
            return unquote_plus(id_), unquote_plus(secret)
        return id_, secret

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        idp = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                pause = idp.trickle_s  # once: a test may change it while this answer is being sent
                if pause is None:
                    self.wfile.write(body)
                    return
                try:
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        time.sleep(pause)
                except OSError:  # the client gave up
                    pass

            def do_GET(self) -> None:
                if self.path == "/jwks":
                    self._send(200, json.dumps(idp.jwks).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
                idp.requests.append(form)
                if self.path != "/token":
                    self._send(404, b"{}")
                    return
                if idp.answer is not None:
                    status, body, kind = idp.answer()
                    self._send(status, body, kind)
                    return
                if idp._client(self.headers.get("Authorization") or "") != (CLIENT_ID, idp.client_secret):
                    self._send(401, json.dumps({"error": "invalid_client",
                                                "error_description": "client authentication failed"}).encode())
                    return
                if form.get("grant_type") != ["client_credentials"]:
                    self._send(400, json.dumps({"error": "unsupported_grant_type"}).encode())
                    return
                self._send(200, idp._token((form.get("scope") or [None])[0]))

        return Handler
