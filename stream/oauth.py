"""OAuth 2.0 tokens for Kafka's SASL/OAUTHBEARER, from an identity provider's token endpoint.

Clusters that log clients in with OAuth (Strimzi with Keycloak, Redpanda, a broker with Kafka's
own OIDC validator) accept a bearer token in place of a password. Each client gets one with the
client-credentials grant (RFC 6749, section 4.4): its id and secret, sent to the identity
provider's token endpoint with HTTP basic authentication, and an optional scope. By default the
id and secret go as they are, as Kafka's own Java client sends them; RFC 6749 (section 2.3.1) has
them form-encoded first, and providers that decode them so (Keycloak, PingAM) refuse a secret
holding ``+`` or ``%`` sent as it is: ``header_urlencode`` (Kafka's
``sasl.oauthbearer.header.urlencode``) encodes them. aiokafka asks :meth:`ClientCredentialsTokenProvider.token`
at every new broker connection; the token is kept until most of its lifetime has passed, and
every client of a process with the same client and endpoint shares it (:func:`token_provider`),
so a proxy with many connections asks the identity provider about once per token, not once per
connection. A token a broker refused is not offered again.

A broker gives a login the lifetime of its token (KIP-368's session lifetime) and closes the
connection at its first request after that. aiokafka does not re-authenticate; it connects
again, and this provider gives the new connection a fresh token (tested with tokens of 3 s
against Kafka 4.4: a producer sending through several lifetimes loses nothing).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import re
import ssl
import time
import weakref
from typing import Any
from urllib.parse import quote_plus

import aiokafka.conn
import httpx
import orjson
from aiokafka.abc import AbstractTokenProvider
from aiokafka.conn import OAuthAuthenticator
from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed
from pydantic import SecretStr

from schemas.backoff import Backoff

logger = logging.getLogger(__name__)

REFRESH_AT = 0.8
"""Share of a token's lifetime after which the next connection gets a new one: room for a slow
identity provider before the old token expires."""

RETRY_BACKOFF_S = 0.1
"""Wait before asking the identity provider again after one failure (Kafka's
``sasl.login.retry.backoff.ms``); it doubles with each failure in a row."""

RETRY_BACKOFF_MAX_S = 10.0
"""The longest wait between requests after failures (``sasl.login.retry.backoff.max.ms``)."""

DEFAULT_LIFETIME_S = 300.0
"""How long a token is kept when the identity provider says nothing of its lifetime (neither
``expires_in`` nor a JWT ``exp``)."""


class OAuthTokenError(KafkaConnectionError):  # type: ignore[misc]
    """No token from the identity provider; says which endpoint and why, never the secret.

    A connection error to aiokafka: a client that cannot log in tries its other brokers and
    again later, as when a broker is away, and "Unable to bootstrap" is what a start raises.
    """


class ClientCredentialsTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """Bearer tokens from ``token_url`` for the client ``client_id``, kept until near their expiry.

    Failures slow it down as Kafka's Java client does (``sasl.login.retry.backoff.ms`` and
    ``.max.ms``): after a failed request or a refused token it asks again only after
    :data:`RETRY_BACKOFF_S`, doubling with each failure in a row up to :data:`RETRY_BACKOFF_MAX_S`,
    so that clients retrying every 100 ms against a misconfigured audience do not flood the
    identity provider. Until then a connection gets the last failure's reason.
    """

    def __init__(self, token_url: str, client_id: str, client_secret: SecretStr, scope: str | None = None,
                 *, ca_file: str | None = None, header_urlencode: bool = False,
                 extensions: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
        self.token_url = token_url
        self.client_id = client_id
        self._secret = client_secret
        self.scope = scope
        self.ca_file = ca_file
        self.header_urlencode = header_urlencode
        self._extensions = dict(extensions or {})
        """Form-encode the id and secret before they are joined for basic authentication (RFC 6749, 2.3.1)."""
        self.timeout_s = timeout_s
        self.fetched = 0
        """Tokens fetched from the identity provider so far."""
        self._shown_url = shown_url(token_url)
        self._token: str | None = None
        self._refresh_at = 0.0
        self._fetches_ended = 0
        self._failure: str | None = None
        """The last fetch's failure (its message: an exception would keep the request's frames alive)."""
        self._fetch_failures = Backoff(RETRY_BACKOFF_S, RETRY_BACKOFF_MAX_S)
        self._refusals = Backoff(RETRY_BACKOFF_S, RETRY_BACKOFF_MAX_S)
        self._retry_at = 0.0
        self._warned_in_the_clear = False
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
        if _in_the_clear(token_url):
            logger.warning("the OAuth token endpoint %s is plain http: the client secret crosses the network "
                           "unencrypted", self._shown_url)

    def __repr__(self) -> str:
        return f"ClientCredentialsTokenProvider({self._shown_url!r}, client_id={self.client_id!r})"

    def extensions(self) -> dict[str, str]:
        """The SASL extensions aiokafka sends with each token (RFC 7628; Confluent Cloud's cluster and pool)."""
        return dict(self._extensions)

    def refused(self, token: str | None = None) -> None:
        """A broker refused ``token``: it is not offered again, and the next fetch waits a while.

        A refusal of an older token than the one now kept changes nothing (that one may be good).
        """
        if token is not None and token != self._token:
            return
        self._token, self._refresh_at = None, 0.0
        self._retry_at = time.monotonic() + self._refusals.next_s()

    def accepted(self, token: str | None = None) -> None:
        """A broker took ``token``: a run of refusals has ended."""
        if token is None or token == self._token:
            self._refusals.reset()

    def warn_once_if_sent_in_the_clear(self, bootstrap_servers: str) -> None:
        """Warn (once per provider) when tokens go to brokers off this machine without TLS (``SASL_PLAINTEXT``).

        A token is a password for its lifetime; aiokafka warns of PLAIN's password in the clear, not of a token.
        """
        hosts = [server.rsplit(":", 1)[0].strip("[]") for server in bootstrap_servers.split(",") if server.strip()]
        if self._warned_in_the_clear or not any(_remote(host.strip()) for host in hosts):
            return
        self._warned_in_the_clear = True
        logger.warning("OAuth tokens from %s go to the brokers (%s) unencrypted under SASL_PLAINTEXT; "
                       "use SASL_SSL", self._shown_url, bootstrap_servers)

    def asks_again_in_s(self) -> float:
        """Seconds until the identity provider is asked again after failures (0 when it may be now)."""
        return max(self._retry_at - time.monotonic(), 0.0)

    def pause_after_refusal_s(self) -> float:
        """:meth:`asks_again_in_s` when a broker's refusal caused the pause, else 0.

        After a failed request the pause's own error already gives the reason; after a refusal
        only a new login can have the broker say why.
        """
        return 0.0 if self._failure is not None else self.asks_again_in_s()

    def _fresh(self) -> str | None:
        if self._token is not None and time.monotonic() < self._refresh_at:
            return self._token
        return None

    def _backing_off(self) -> OAuthTokenError | None:
        wait_s = self.asks_again_in_s()
        if wait_s <= 0:
            return None
        why = self._failure or f"a broker refused the last token from the OAuth token endpoint {self._shown_url}"
        return OAuthTokenError(f"{why}; asking again in {wait_s:.2f} s")

    async def token(self) -> str:
        """A token that is not near its expiry; fetched once for connections made at the same time.

        Connections that waited for a fetch take its outcome, a failure included, rather than
        asking again one after another (each up to the timeout, with a provider that does not
        answer).

        Raises:
            OAuthTokenError: the endpoint could not be reached, refused the client, answered
                without an ``access_token`` or not within ``timeout_s``; or it failed (or a broker
                refused its token) moments ago and is not asked again yet.
        """
        if (token := self._fresh()) is not None:
            return token
        if (backing_off := self._backing_off()) is not None:
            raise backing_off
        ended = self._fetches_ended
        # One lock per event loop: the settings (and this provider) outlive an ``asyncio.run``.
        lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:
            if self._fetches_ended != ended:  # a fetch ended while this one waited: its outcome holds
                if self._failure is not None:
                    raise OAuthTokenError(self._failure)  # a new one each: no traceback shared across tasks
                if (token := self._fresh()) is not None:
                    return token
                # Cut short (cancelled), or its token already refused: ask again below.
            if (backing_off := self._backing_off()) is not None:
                raise backing_off
            self._failure = None
            try:
                token, lifetime_s = await self._fetch()
            except OAuthTokenError as exc:
                self._failure = str(exc.args[0]) if exc.args else str(exc)  # the message, without the class
                self._retry_at = time.monotonic() + self._fetch_failures.next_s()
                raise
            finally:
                self._fetches_ended += 1
            self._fetch_failures.reset()
            self._token, self._refresh_at = token, time.monotonic() + REFRESH_AT * lifetime_s
            self.fetched += 1
            return token

    def _basic_credentials(self) -> tuple[str, str]:
        secret = self._secret.get_secret_value()
        if self.header_urlencode:
            # application/x-www-form-urlencoded, as RFC 6749's appendix B: space as "+", the rest escaped.
            return quote_plus(self.client_id, safe=""), quote_plus(secret, safe="")
        return self.client_id, secret

    def _encoding_hint(self, status: int) -> str:
        """A hint for a refused client whose credentials the form-encoding setting may have got wrong.

        A form-decoding provider turns ``+`` into a space and ``%xx`` into a byte; one that takes
        the header as it is reads an encoded ``/`` or ``=`` (common in generated secrets) as three
        other characters. The hint never says which characters, nor where.
        """
        if status not in (400, 401):
            return ""
        id_, secret = self.client_id, self._secret.get_secret_value()
        setting = "OPENFORGE_KAFKA_SASL_OAUTH_HEADER_URLENCODE"
        if self.header_urlencode:
            if quote_plus(id_, safe="") == id_ and quote_plus(secret, safe="") == secret:
                return ""
            return (f"; {setting}=true changed the client id or secret: if the secret is right and the identity "
                    f"provider does not form-decode basic authentication, set it to false")
        if not any(c in text for text in (id_, secret) for c in "+%"):
            return ""
        return ("; the client id or secret holds characters that identity providers which form-decode basic "
                f"authentication (RFC 6749, 2.3.1) read differently: if the secret is right, set {setting}=true")

    async def _fetch(self) -> tuple[str, float]:
        form = {"grant_type": "client_credentials", **({"scope": self.scope} if self.scope else {})}
        where = f"the OAuth token endpoint {self._shown_url}"
        try:
            # The system's authorities (not certifi's), and a private one's where the settings name it.
            verify = ssl.create_default_context()
            if self.ca_file is not None:
                verify.load_verify_locations(self.ca_file)
            # httpx's timeout bounds each read; this bounds the whole request, so a provider that
            # trickles its answer cannot hold aiokafka's connection lock (every new connection) for long.
            async with asyncio.timeout(self.timeout_s), \
                    httpx.AsyncClient(timeout=self.timeout_s, verify=verify) as client:
                answer = await client.post(self.token_url, data=form, auth=self._basic_credentials(),
                                           headers={"Accept": "application/json"})
        except TimeoutError as exc:
            raise OAuthTokenError(f"{where} did not answer within {self.timeout_s:g} s") from exc
        except (httpx.HTTPError, httpx.InvalidURL, ssl.SSLError, OSError) as exc:
            raise OAuthTokenError(f"{where} could not be reached: {type(exc).__name__}: {exc}") from exc
        try:
            body: Any = orjson.loads(answer.content)
        except orjson.JSONDecodeError:
            body = None
        if answer.status_code != 200:
            # RFC 6749 5.2: {"error": "invalid_client", "error_description": "..."}
            reason = ""
            if isinstance(body, dict) and body.get("error"):
                reason = f": {body['error']}" + (f" ({body['error_description']})" if body.get("error_description")
                                                  else "")
            if 400 <= answer.status_code < 500:
                raise OAuthTokenError(f"{where} refused client {self.client_id!r} with HTTP "
                                      f"{answer.status_code}{reason}{self._encoding_hint(answer.status_code)}")
            if answer.is_redirect:
                raise OAuthTokenError(f"{where} redirects (HTTP {answer.status_code}) to "
                                      f"{shown_url(answer.headers.get('location', '?'))}: set that URL instead")
            raise OAuthTokenError(f"{where} failed with HTTP {answer.status_code}{reason}")
        if not isinstance(body, dict) or not isinstance(body.get("access_token"), str) or not body["access_token"]:
            raise OAuthTokenError(f"{where} answered without an access_token")
        token: str = body["access_token"]
        return token, _lifetime_s(body.get("expires_in"), token)


def _error_challenge(payload: bytes) -> bool:
    """Whether the broker's answer to a token is RFC 7628's error challenge (a JSON ``status``)."""
    try:
        challenge = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(challenge, dict) and "status" in challenge


def _bearer(message: bytes) -> str:
    """The token in an OAUTHBEARER client's first message (RFC 7628 3.1: ``auth=Bearer <token>``)."""
    for pair in message.decode("utf-8", "replace").split("\x01"):
        if pair.startswith("auth=Bearer "):
            return pair.removeprefix("auth=Bearer ")
    return ""


class RefusalAnsweringAuthenticator(OAuthAuthenticator):  # type: ignore[misc]
    r"""aiokafka's OAUTHBEARER client, plus the answer RFC 7628 (3.2.2) asks for when a broker refuses.

    A broker that rejects a token does not fail the exchange at once: it sends an error
    challenge (``{"status": "invalid_token"}``) and waits for the client's ``\x01`` before it
    answers with ``SASL_AUTHENTICATION_FAILED`` and its reason. aiokafka ends the exchange
    after sending the token, whatever comes back, and takes itself for logged in; the broker
    then answers its metadata requests with no brokers, and a producer's start waits for good
    (against Kafka 4.4: no error within 60 s). Kafka's Java client, librdkafka and sarama all
    send the ``\x01``; with this, aiokafka does too and raises ``SaslAuthenticationFailed``
    with the broker's reason. The token provider hears of the outcome
    (:meth:`ClientCredentialsTokenProvider.refused`, ``accepted``), so that a refused token is
    not offered again and a run of refusals slows its requests down.

    aiokafka's public interface for OAUTHBEARER is the token provider, which never sees the
    broker's answer, and it has no setting for the authenticator: each connection makes one
    from the name ``aiokafka.conn.OAuthAuthenticator``, which :func:`answer_refusals` points at
    this subclass. Its first step is aiokafka's own (the token, its extensions and the
    message's form stay aiokafka's). tests/unit/stream/test_oauth_tokens_from_a_stand_in_idp.py
    pins what it relies on: that aiokafka makes its authenticator from that name, and that
    aiokafka's own still ends the exchange after the token (once it answers refusals itself,
    this class goes).
    """

    def __init__(self, *, sasl_oauth_token_provider: AbstractTokenProvider) -> None:
        super().__init__(sasl_oauth_token_provider=sasl_oauth_token_provider)
        self.provider = sasl_oauth_token_provider
        self.sent: str | None = None
        """The token this login offered (None before the first step)."""
        self.answered = False
        """The broker's error challenge was answered: the exchange is over."""

    async def step(self, payload: bytes | None) -> tuple[bytes, bool] | None:
        """The next message to the broker, or None when the exchange is over (aiokafka's contract).

        Raises:
            SaslAuthenticationFailed: the broker challenged again after its error challenge was answered.
        """
        if self.sent is None:
            first: tuple[bytes, bool] = await super().step(payload)
            self.sent = _bearer(first[0])
            return first
        if self.answered:
            raise SaslAuthenticationFailed(f"the broker challenged the token again: {(payload or b'')[:200]!r}")
        provider = self.provider if isinstance(self.provider, ClientCredentialsTokenProvider) else None
        if payload and _error_challenge(payload):
            # The "\x01" ends the exchange; the broker answers with the failure and its reason,
            # which aiokafka raises.
            if provider is not None:
                provider.refused(self.sent)
            self.answered = True
            return b"\x01", True
        if provider is not None:
            provider.accepted(self.sent)
        return None


def answer_refusals() -> None:
    """Have every aiokafka connection of this process log in with :class:`RefusalAnsweringAuthenticator`."""
    aiokafka.conn.OAuthAuthenticator = RefusalAnsweringAuthenticator


_PROVIDERS: dict[tuple[str, str, str, str | None, str | None, bool, str | None],
                 ClientCredentialsTokenProvider] = {}


def token_provider(token_url: str, client_id: str, client_secret: SecretStr, scope: str | None,
                   ca_file: str | None = None, header_urlencode: bool = False,
                   extensions: str | None = None) -> ClientCredentialsTokenProvider:
    """The process's one token source for this client at this endpoint, shared by all its Kafka clients.

    ``extensions``: as the setting writes them (:func:`parse_extensions`). Its clients' logins
    answer a broker's refusal (:func:`answer_refusals`).
    """
    answer_refusals()
    key = (token_url, client_id, client_secret.get_secret_value(), scope, ca_file, header_urlencode, extensions)
    provider = _PROVIDERS.get(key)
    if provider is None:
        provider = _PROVIDERS[key] = ClientCredentialsTokenProvider(
            token_url, client_id, client_secret, scope, ca_file=ca_file, header_urlencode=header_urlencode,
            extensions=parse_extensions(extensions) if extensions else None)
    return provider


_EXTENSION_KEY = re.compile(r"[A-Za-z]+")
_EXTENSION_VALUE = re.compile(r"[\x21-\x7E \t\r\n]+")  # RFC 7628, as Kafka's SaslExtensions checks them


def parse_extensions(text: str) -> dict[str, str]:
    """``key=value`` pairs joined by commas, checked as a broker checks SASL extensions.

    Raises:
        ValueError: a pair without ``=``, a key that is not letters only (or is the reserved
            ``auth``), an empty or unprintable value, or a key given twice; the message names it.
    """
    pairs: dict[str, str] = {}
    for pair in text.split(","):
        key, equals, value = pair.strip().partition("=")
        if not equals:
            raise ValueError(f"OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS: {pair.strip()!r} is not key=value")
        if not _EXTENSION_KEY.fullmatch(key) or key == "auth":
            raise ValueError(f"OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS: key {key!r} must be letters only, not 'auth'")
        if not _EXTENSION_VALUE.fullmatch(value):
            raise ValueError(f"OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS: the value of {key} must be printable ASCII")
        if key in pairs:
            raise ValueError(f"OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS: {key} is given twice")
        pairs[key] = value
    return pairs


def forget_token_providers() -> None:
    """Drop the process's token sources (and their tokens): the next client starts afresh."""
    _PROVIDERS.clear()


def shown_url(url: str) -> str:
    """``url`` fit for messages: without user information or query, which may hold credentials."""
    try:
        parsed = httpx.URL(url)
        return str(parsed.copy_with(userinfo=b"", query=None, fragment=None))
    except (httpx.InvalidURL, TypeError, ValueError):
        return "<an unreadable URL>"


def check_token_url(url: str) -> str | None:
    """Why ``url`` cannot be a token endpoint (None when it can): an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"is not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host or " " in url:
        return "must be an http(s) URL with a host, like https://idp.example/oauth2/token"
    return None


def _in_the_clear(url: str) -> bool:
    parsed = httpx.URL(url)
    return parsed.scheme == "http" and _remote(parsed.host)


def _remote(host: str) -> bool:
    """Whether traffic to ``host`` leaves this machine (anything but localhost and loopback addresses)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def _lifetime_s(expires_in: object, token: str) -> float:
    """Seconds the token is valid: ``expires_in``, else the JWT's ``exp``, else a default."""
    if isinstance(expires_in, int | float) and not isinstance(expires_in, bool) and expires_in > 0:
        return float(expires_in)
    if isinstance(expires_in, str) and expires_in.isdigit() and int(expires_in) > 0:  # some providers quote it
        return float(expires_in)
    parts = token.split(".")
    if len(parts) == 3:
        try:
            claims = orjson.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        except (ValueError, orjson.JSONDecodeError):
            return DEFAULT_LIFETIME_S
        exp = claims.get("exp") if isinstance(claims, dict) else None
        if isinstance(exp, int | float) and not isinstance(exp, bool):
            return max(float(exp) - time.time(), 0.0)  # already expired: used once, not kept
    return DEFAULT_LIFETIME_S


__all__ = ["ClientCredentialsTokenProvider", "OAuthTokenError", "RefusalAnsweringAuthenticator", "answer_refusals",
           "check_token_url", "forget_token_providers", "parse_extensions", "shown_url", "token_provider"]
