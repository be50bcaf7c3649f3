"""OAUTHBEARER's token source (``stream/oauth.py``) against a stand-in identity provider.

No real identity provider runs on these machines; ``tests/oauth_idp.py`` is the smallest one that
speaks the client-credentials grant. What is tested is the client side: the request it sends,
how long it keeps a token, and what it says when the provider refuses.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from oauth_idp import CLIENT_ID, CLIENT_SECRET, StandInIdentityProvider
from pydantic import SecretStr

from stream import KafkaSettings
from stream.oauth import (
    DEFAULT_LIFETIME_S,
    RETRY_BACKOFF_MAX_S,
    RETRY_BACKOFF_S,
    ClientCredentialsTokenProvider,
    OAuthTokenError,
    RefusalAnsweringAuthenticator,
    _lifetime_s,
    shown_url,
    token_provider,
)


@pytest.fixture(scope="module")
def idp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInIdentityProvider]:
    server = StandInIdentityProvider(tmp_path_factory.mktemp("idp")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _reset(idp: StandInIdentityProvider) -> None:
    idp.answer, idp.trickle_s, idp.lifetime_s, idp.requests[:] = None, None, 3600, []
    idp.client_secret, idp.form_decodes_basic = CLIENT_SECRET, False


def _provider(idp: StandInIdentityProvider, secret: str = CLIENT_SECRET, scope: str | None = None, *,
              header_urlencode: bool = False) -> ClientCredentialsTokenProvider:
    return ClientCredentialsTokenProvider(idp.token_url, CLIENT_ID, SecretStr(secret), scope,
                                          header_urlencode=header_urlencode)


def _claims(token: str) -> dict[str, object]:
    body = token.split(".")[1]
    claims: dict[str, object] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    return claims


async def test_a_token_from_the_stand_in_idp_is_kept_and_shared_by_concurrent_connections(
        idp: StandInIdentityProvider) -> None:
    provider = _provider(idp, scope="kafka.write")
    before = idp.issued
    tokens = await asyncio.gather(*(provider.token() for _ in range(8)))
    assert len(set(tokens)) == 1
    assert await provider.token() == tokens[0]
    assert idp.issued - before == provider.fetched == 1
    assert idp.requests == [{"grant_type": ["client_credentials"], "scope": ["kafka.write"]}]
    assert _claims(tokens[0])["sub"] == CLIENT_ID


async def test_a_token_near_its_expiry_is_replaced_by_the_stand_in_idp(idp: StandInIdentityProvider) -> None:
    idp.lifetime_s = 1
    provider = _provider(idp)
    first = await provider.token()
    assert await provider.token() == first  # well inside its lifetime
    await asyncio.sleep(0.9)  # past 80 % of it
    second = await provider.token()
    assert second != first
    assert provider.fetched == 2


async def test_a_refused_client_is_named_with_the_stand_in_idps_reason_and_never_its_secret(
        idp: StandInIdentityProvider) -> None:
    provider = _provider(idp, secret="not-the-secret")
    with pytest.raises(OAuthTokenError) as refused:
        await provider.token()
    message = str(refused.value)
    assert idp.token_url in message and "HTTP 401" in message and CLIENT_ID in message
    assert "invalid_client (client authentication failed)" in message
    assert "not-the-secret" not in message and "not-the-secret" not in repr(provider)
    assert provider.fetched == 0


async def test_a_secret_that_form_encoding_changes_reaches_a_form_decoding_stand_in_idp_only_encoded(
        idp: StandInIdentityProvider) -> None:
    secret = "s+cr%2Ft 9/=:~" + CLIENT_SECRET
    idp.client_secret, idp.form_decodes_basic = secret, True

    as_it_is = _provider(idp, secret)
    with pytest.raises(OAuthTokenError) as refused:
        await as_it_is.token()
    message = str(refused.value)
    assert "invalid_client" in message and "OPENFORGE_KAFKA_SASL_OAUTH_HEADER_URLENCODE=true" in message
    assert secret not in message and CLIENT_SECRET not in message

    encoded = _provider(idp, secret, header_urlencode=True)
    assert _claims(await encoded.token())["sub"] == CLIENT_ID

    # A provider that takes the header as it is (Kafka's default) still gets the secret unchanged,
    # and refuses it encoded, saying the setting changed it.
    idp.form_decodes_basic = False
    assert _claims(await _provider(idp, secret).token())["sub"] == CLIENT_ID
    with pytest.raises(OAuthTokenError) as encoded_refused:
        await _provider(idp, secret, header_urlencode=True).token()
    assert "HEADER_URLENCODE=true changed the client id or secret" in str(encoded_refused.value)
    assert secret not in str(encoded_refused.value)


async def test_a_refused_secret_that_form_encoding_leaves_alone_gets_no_encoding_hint(
        idp: StandInIdentityProvider) -> None:
    with pytest.raises(OAuthTokenError) as refused:
        await _provider(idp, "wrong/secret=").token()
    assert "HEADER_URLENCODE" not in str(refused.value)


@pytest.mark.parametrize(("status", "body", "kind", "expected"), [
    (500, b"<html>upstream gone</html>", "text/html", "failed with HTTP 500$"),
    (503, b'{"error": "temporarily_unavailable"}', "application/json", "failed with HTTP 503: temporarily_unavail"),
    (400, b'{"error": "invalid_scope"}', "application/json", "refused client 'openforge-proxy' with HTTP 400: inv"),
    (200, b"<html>a login page</html>", "text/html", "without an access_token"),
    (200, b'{"token_type": "Bearer"}', "application/json", "without an access_token"),
    (200, b'{"access_token": ""}', "application/json", "without an access_token"),
])
async def test_what_is_not_a_token_from_the_stand_in_idp_is_an_error(
        idp: StandInIdentityProvider, status: int, body: bytes, kind: str, expected: str) -> None:
    idp.answer = lambda: (status, body, kind)
    with pytest.raises(OAuthTokenError, match=expected):
        await _provider(idp).token()


def _clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The provider's monotonic clock, moved by the test alone: waits are exact whatever the machine's load."""
    now = [1000.0]
    monkeypatch.setattr("stream.oauth.time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    return now


async def test_waiters_share_a_failed_fetch_from_the_stand_in_idp_and_the_next_caller_asks_again(
        idp: StandInIdentityProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider that fails (slowly, or at all) is asked once for the connections waiting on it."""
    now = _clock(monkeypatch)
    idp.answer = lambda: (500, b"{}", "application/json")
    provider = _provider(idp)
    results = await asyncio.gather(*(provider.token() for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, OAuthTokenError) for r in results)
    assert len({id(r) for r in results}) == 5  # each its own error: no traceback shared across tasks
    assert [str(r).count("OAuthTokenError") for r in results] == [1] * 5
    assert len(idp.requests) == 1
    idp.answer = None
    with pytest.raises(OAuthTokenError, match=r"failed with HTTP 500; asking again in 0\.\d+ s"):
        await provider.token()  # at once: not asked again yet
    assert provider.asks_again_in_s() > 0 and provider.pause_after_refusal_s() == 0  # the error says why
    assert len(idp.requests) == 1
    now[0] += RETRY_BACKOFF_S
    assert _claims(await provider.token())["sub"] == CLIENT_ID
    assert len(idp.requests) == 2


def _wait_s(error: OAuthTokenError) -> float:
    return float(str(error).rsplit("asking again in ", 1)[1].split(" s", 1)[0])


async def test_failures_in_a_row_slow_the_requests_to_the_stand_in_idp_down(idp: StandInIdentityProvider,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A misconfigured client asks at most a few times a second, then once per RETRY_BACKOFF_MAX_S."""
    now = _clock(monkeypatch)
    idp.answer = lambda: (503, b"{}", "application/json")
    provider = _provider(idp)
    waits = []
    for _ in range(10):
        with pytest.raises(OAuthTokenError):
            await provider.token()
        with pytest.raises(OAuthTokenError, match="asking again") as backing_off:
            await provider.token()  # not asked: still waiting
        waits.append(_wait_s(backing_off.value))
        now[0] += waits[-1]
    assert len(idp.requests) == 10
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]
    assert (RETRY_BACKOFF_S, RETRY_BACKOFF_MAX_S) == (0.1, 10.0)  # Kafka's sasl.login.retry.backoff.(max.)ms
    idp.answer = None
    await provider.token()
    idp.answer = lambda: (503, b"{}", "application/json")
    provider._token = None  # the next failure after a success starts from the first wait again
    with pytest.raises(OAuthTokenError):
        await provider.token()
    with pytest.raises(OAuthTokenError) as backing_off:
        await provider.token()
    assert _wait_s(backing_off.value) == 0.1
    provider._fetch_failures.failures = 5000  # hours of failures: the wait stays at its cap
    now[0] += 1
    with pytest.raises(OAuthTokenError):
        await provider.token()
    assert provider.asks_again_in_s() == 10.0


async def test_refusals_in_a_row_slow_the_requests_down_until_a_broker_accepts_a_token_from_the_stand_in_idp(
        idp: StandInIdentityProvider) -> None:
    provider = _provider(idp)
    first = await provider.token()
    provider.refused(first)
    assert 0 < provider.pause_after_refusal_s() <= RETRY_BACKOFF_S  # a diagnosis waits to log in again
    with pytest.raises(OAuthTokenError, match="a broker refused the last token .* asking again") as backing_off:
        await provider.token()
    assert _wait_s(backing_off.value) <= RETRY_BACKOFF_S
    await asyncio.sleep(RETRY_BACKOFF_S * 1.5)
    second = await provider.token()
    provider.refused(second)
    with pytest.raises(OAuthTokenError) as backing_off:
        await provider.token()
    assert RETRY_BACKOFF_S < _wait_s(backing_off.value) <= 2 * RETRY_BACKOFF_S  # doubled
    await asyncio.sleep(RETRY_BACKOFF_S * 2.5)
    third = await provider.token()
    provider.accepted(third)
    provider.refused(third)  # after an acceptance, from the first wait again
    with pytest.raises(OAuthTokenError) as backing_off:
        await provider.token()
    assert _wait_s(backing_off.value) <= RETRY_BACKOFF_S
    assert provider.fetched == 3 and len(idp.requests) == 3


async def test_a_refusal_of_an_older_token_keeps_the_stand_in_idps_newer_one(idp: StandInIdentityProvider) -> None:
    provider = _provider(idp)
    first = await provider.token()
    provider.refused(first)
    await asyncio.sleep(RETRY_BACKOFF_S * 1.5)
    second = await provider.token()
    provider.refused(first)  # a connection that logged in with the first token hears of it late
    assert await provider.token() == second
    assert provider.fetched == 2


async def test_a_cancelled_fetch_leaves_its_waiters_a_fresh_token_from_the_stand_in_idp_not_the_expired_one(
        idp: StandInIdentityProvider) -> None:
    """A connection given up (a start's timeout) while it fetched must not hand its waiters the old token."""
    provider = _provider(idp)
    provider._token, provider._refresh_at = "expired-token", time.monotonic() - 1
    idp.trickle_s = 0.001  # about a second for a signed token: time to cancel the first fetch
    first = asyncio.create_task(provider.token())
    await asyncio.sleep(0.2)
    waiter = asyncio.create_task(provider.token())
    await asyncio.sleep(0.05)
    first.cancel()
    idp.trickle_s = None
    token = await asyncio.wait_for(waiter, 10)
    assert token != "expired-token" and _claims(token)["sub"] == CLIENT_ID
    assert first.cancelled()


async def test_a_stand_in_idp_that_never_finishes_its_answer_is_given_up_on(idp: StandInIdentityProvider) -> None:
    """Each read gets a byte in time, so only the whole request's limit ends it (aiokafka waits on it,
    holding the lock every new connection of the client needs)."""
    idp.trickle_s = 0.05
    provider = ClientCredentialsTokenProvider(idp.token_url, CLIENT_ID, SecretStr(CLIENT_SECRET), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(OAuthTokenError, match=r"did not answer within 0\.5 s"):
        await provider.token()
    assert time.monotonic() - started < 3


async def test_a_token_a_broker_refused_is_not_offered_again_by_the_stand_in_idps_client(
        idp: StandInIdentityProvider) -> None:
    provider = _provider(idp)
    first = await provider.token()
    provider.refused()
    await asyncio.sleep(RETRY_BACKOFF_S * 1.5)
    assert await provider.token() != first
    assert provider.fetched == 2


async def test_a_redirecting_stand_in_idp_is_named_with_where_it_points(idp: StandInIdentityProvider) -> None:
    idp.answer = lambda: (302, b"", "text/plain")
    with pytest.raises(OAuthTokenError, match="redirects \\(HTTP 302\\)"):
        await _provider(idp).token()


def test_a_plain_http_endpoint_off_this_machine_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="stream.oauth"):
        ClientCredentialsTokenProvider("http://127.0.0.1:1/token", CLIENT_ID, SecretStr("s"))
        ClientCredentialsTokenProvider("http://localhost:1/token", CLIENT_ID, SecretStr("s"))
        ClientCredentialsTokenProvider("https://idp.example/token", CLIENT_ID, SecretStr("s"))
        assert not caplog.records
        ClientCredentialsTokenProvider("http://idp.example/token", CLIENT_ID, SecretStr("s"))
    assert ["unencrypted" in r.getMessage() for r in caplog.records] == [True]


def test_urls_in_messages_lose_their_credentials() -> None:
    assert shown_url("https://user:pw@idp.example:8443/t?client_secret=x#f") == "https://idp.example:8443/t"
    assert shown_url("http://[::1/token") == "<an unreadable URL>"
    provider = ClientCredentialsTokenProvider("https://user:pw@idp.example/t", CLIENT_ID, SecretStr("s"))
    assert "pw" not in repr(provider)


async def test_an_unreachable_token_endpoint_is_named(idp: StandInIdentityProvider) -> None:
    from netutil import free_port

    url = f"http://127.0.0.1:{free_port()}/token"
    provider = ClientCredentialsTokenProvider(url, CLIENT_ID, SecretStr(CLIENT_SECRET), timeout_s=5)
    with pytest.raises(OAuthTokenError, match=f"{url} could not be reached"):
        await provider.token()


async def test_a_token_endpoint_behind_a_private_authority_is_trusted_through_its_ca_file_with_a_stand_in_idp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An authority the system does not know is refused; sasl_oauth_ca_file adds it for the token endpoint."""
    idp = StandInIdentityProvider(tmp_path / "tls-idp", tls=True).start()
    try:
        assert idp.token_url.startswith("https://") and idp.ca is not None
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(OAuthTokenError, match="CERTIFICATE_VERIFY_FAILED"):
            await _provider(idp).token()
        kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_username=CLIENT_ID,
                              sasl_password=CLIENT_SECRET, sasl_oauth_token_url=idp.token_url,
                              sasl_oauth_ca_file=str(idp.ca))
        assert _claims(await kafka.oauth_token_provider().token())["sub"] == CLIENT_ID
    finally:
        idp.stop()


def test_aiokafkas_debug_log_of_a_login_keeps_the_credentials_out() -> None:
    """aiokafka logs every request it sends at DEBUG, the SASL login's token or password included."""
    import logging

    from aiokafka.protocol.admin import SaslAuthenticateRequest_v1

    import stream.settings  # noqa: F401  (installs the filter)

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("aiokafka.conn")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)
    try:
        request = SaslAuthenticateRequest_v1(b"n,,\x01auth=Bearer the-token-itself\x01\x01")
        assert "the-token-itself" in str(request)  # what aiokafka would write out
        log.debug("Request to %s:%d %d: %s", "broker", 9093, 7, request)
        log.debug("Request to %s:%d %d: %s", "broker", 9093, 8, "MetadataRequest_v1(topics=[])")
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    assert seen == ["Request to broker:9093 7: SaslAuthenticateRequest_v1(sasl_auth_bytes=<hidden>)",
                    "Request to broker:9093 8: MetadataRequest_v1(topics=[])"]


def test_tokens_sent_to_remote_brokers_without_tls_are_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    def settings(bootstrap: str, protocol: str = "SASL_PLAINTEXT") -> KafkaSettings:
        return KafkaSettings(bootstrap_servers=bootstrap, security_protocol=protocol, sasl_mechanism="OAUTHBEARER",
                             sasl_username=CLIENT_ID, sasl_password="warned-secret",
                             sasl_oauth_token_url="https://idp.example/token", sasl_oauth_scope="warned")

    with caplog.at_level("WARNING", logger="stream.oauth"):
        settings("127.0.0.1:9092,localhost:9093,[::1]:9094").oauth_token_provider()
        settings("kafka.example:9093", "SASL_SSL").oauth_token_provider()
        assert not caplog.records
        settings("127.0.0.1:9092,kafka.example:9093").oauth_token_provider()
        settings("kafka.example:9093").oauth_token_provider()
    assert ["unencrypted under SASL_PLAINTEXT" in r.getMessage() for r in caplog.records] == [True]


def test_a_tokens_lifetime_comes_from_expires_in_else_its_exp_claim(idp: StandInIdentityProvider) -> None:
    token = idp.sign({"sub": CLIENT_ID, "exp": int(time.time()) + 600})
    assert _lifetime_s(120, token) == 120
    assert _lifetime_s("90", token) == 90
    assert 595 < _lifetime_s(None, token) <= 600
    assert _lifetime_s(None, "opaque-token") == DEFAULT_LIFETIME_S
    assert _lifetime_s(0, "a.bm90IGpzb24.c") == DEFAULT_LIFETIME_S  # a zero lifetime, a body that is not JSON
    assert _lifetime_s(None, idp.sign({"exp": int(time.time()) - 5})) == 0  # already expired: not kept


def test_every_kafka_client_of_a_process_shares_one_token_source() -> None:
    """Whichever settings object made the client: the shipping worker's copy, a copy with another linger."""
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", sasl_username=CLIENT_ID,
                          sasl_password=CLIENT_SECRET, sasl_oauth_token_url="https://idp.example/token",
                          sasl_oauth_scope="kafka")
    options = kafka.client_options()
    assert options["sasl_mechanism"] == "OAUTHBEARER"
    assert "sasl_plain_password" not in options
    provider = options["sasl_oauth_token_provider"]
    assert (provider.token_url, provider.client_id, provider.scope) == ("https://idp.example/token", CLIENT_ID, "kafka")
    assert KafkaSettings.model_validate(kafka.worker_json()).oauth_token_provider() is provider
    assert kafka.model_copy(update={"linger_ms": 0}).oauth_token_provider() is provider
    assert kafka == kafka.model_copy()  # no hidden state on the settings
    # Another client, or the same client at another endpoint, has its own.
    other = kafka.model_copy(update={"sasl_password": SecretStr("another-secret")})
    assert other.oauth_token_provider() is not provider
    assert not provider.header_urlencode
    encoding = kafka.model_copy(update={"sasl_oauth_header_urlencode": True}).oauth_token_provider()
    assert encoding is not provider and encoding.header_urlencode
    assert provider.extensions() == {}
    confluent = KafkaSettings(**{**kafka.worker_json(), "sasl_oauth_extensions":
                                 "logicalCluster=lkc-abc12, identityPoolId=pool-Xy1"}).oauth_token_provider()
    assert confluent is not provider
    assert confluent.extensions() == {"logicalCluster": "lkc-abc12", "identityPoolId": "pool-Xy1"}
    assert KafkaSettings().oauth_token_provider() is None


def test_the_subclassed_exchange_answers_a_brokers_refusal_and_ends() -> None:
    """RFC 7628 3.2.2: an error challenge after the token is answered with \\x01 (the broker then fails the
    login with its reason); a success (no challenge) ends the exchange; a second challenge is a failure."""
    from aiokafka.errors import SaslAuthenticationFailed

    provider = ClientCredentialsTokenProvider("https://idp.example/token", CLIENT_ID, SecretStr("s"),
                                              extensions={"logicalCluster": "lkc-1"})
    provider._token, provider._refresh_at = "a-token", time.monotonic() + 60

    async def exchange(*challenges: bytes) -> list[object]:
        authenticator = RefusalAnsweringAuthenticator(sasl_oauth_token_provider=provider)
        steps: list[object] = [await authenticator.step(None)]
        steps.extend([await authenticator.step(challenge) for challenge in challenges])  # in order
        return steps

    provider._refusals.failures = 2
    first, end = asyncio.run(exchange(b""))
    assert first == (b"n,,\x01auth=Bearer a-token\x01logicalCluster=lkc-1\x01\x01", True) and end is None
    assert provider._refusals.failures == 0  # accepted
    _, end = asyncio.run(exchange(b"not an error challenge"))
    assert end is None and provider._token == "a-token"  # ends as aiokafka ends it; the token is kept
    refused = asyncio.run(exchange(b'{"status":"invalid_token"}'))
    assert refused[1] == (b"\x01", True)
    assert provider._token is None and provider._refusals.failures == 1  # not offered again
    provider._token, provider._refresh_at = "a-token", time.monotonic() + 60
    with pytest.raises(SaslAuthenticationFailed, match="challenged the token again"):
        asyncio.run(exchange(b'{"status":"invalid_token"}', b'{"status":"invalid_token"}'))


async def test_aiokafka_logs_in_with_the_subclass_once_a_process_has_an_oauth_token_source() -> None:
    """Pins what :class:`RefusalAnsweringAuthenticator` relies on: aiokafka has no setting for the
    authenticator, and makes each connection's from the name the subclass is put under."""
    from aiokafka.conn import AIOKafkaConnection

    provider = token_provider("https://idp.example/token", CLIENT_ID, SecretStr("s"), None)
    connection = AIOKafkaConnection("127.0.0.1", 9, security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                                    sasl_oauth_token_provider=provider)
    authenticator = connection.authenticator_oauth()
    assert isinstance(authenticator, RefusalAnsweringAuthenticator)
    assert authenticator.provider is provider


async def test_aiokafkas_own_oauthbearer_client_still_ends_the_exchange_at_a_refusal() -> None:
    """The gap the subclass fills. When this fails, aiokafka answers refusals itself: remove the subclass."""
    aiokafkas = RefusalAnsweringAuthenticator.__bases__[0]
    provider = ClientCredentialsTokenProvider("https://idp.example/token", CLIENT_ID, SecretStr("s"))
    provider._token, provider._refresh_at = "a-token", time.monotonic() + 60
    authenticator = aiokafkas(sasl_oauth_token_provider=provider)
    assert await authenticator.step(None) == (b"n,,\x01auth=Bearer a-token\x01\x01", True)
    assert await authenticator.step(b'{"status":"invalid_token"}') is None
