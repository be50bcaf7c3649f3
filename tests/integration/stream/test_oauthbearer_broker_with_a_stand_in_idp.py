"""Kafka's SASL/OAUTHBEARER: a real broker judging tokens from a stand-in identity provider.

No real identity provider runs on these machines, so ``tests/oauth_idp.py`` stands in for one
(token endpoint and JWKS), and every test here says so in its name. The broker is real: its
``OAUTHBEARER`` listener validates each token with Kafka's own ``OAuthBearerValidatorCallbackHandler``
against the provider's key set, audience and issuer, as a cluster behind Keycloak or Okta does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netutil import free_port, free_port_pair
from oauth_idp import AUDIENCE, CLIENT_ID, CLIENT_SECRET, StandInIdentityProvider
from secured_kafka import cli_names_the_refusal, created, read, refused_start, round_trip, shipped_call

from stream import CALLS, EventProducer, KafkaSettings
from stream.admin import bootstrap_refusal
from stream.broker import BrokerSettings, LocalBroker
from stream.oauth import forget_token_providers

pytestmark = pytest.mark.kafka

_VALIDATOR = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
_LOGIN = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required ;"


class _OAuthBroker(LocalBroker):
    """The suite's single-node broker with an ``OAUTH`` listener (SASL_PLAINTEXT, OAUTHBEARER) added."""

    def __init__(self, settings: BrokerSettings, idp: StandInIdentityProvider, oauth_port: int) -> None:
        super().__init__(settings)
        self.idp, self.oauth_port = idp, oauth_port

    def _jvm_options(self) -> list[str]:
        # Kafka 4 fetches no key set from a URL it was not told to allow.
        return [f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls={self.idp.jwks_url}"]

    def _write_config(self) -> Path:
        config = super()._write_config()
        port, controller = self.settings.port, self.settings.controller_port
        extra = {  # later keys win in a properties file
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
                         f"OAUTH://127.0.0.1:{self.oauth_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},OAUTH://127.0.0.1:{self.oauth_port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,OAUTH:SASL_PLAINTEXT",
            "listener.name.oauth.sasl.enabled.mechanisms": "OAUTHBEARER",
            "listener.name.oauth.oauthbearer.sasl.server.callback.handler.class": _VALIDATOR,
            "listener.name.oauth.oauthbearer.sasl.jaas.config": _LOGIN,
            "sasl.oauthbearer.jwks.endpoint.url": self.idp.jwks_url,
            "sasl.oauthbearer.expected.audience": AUDIENCE,
            "sasl.oauthbearer.expected.issuer": self.idp.issuer,
        }
        with config.open("a") as out:
            out.writelines(f"{key}={value}\n" for key, value in extra.items())
        return config


@dataclass
class OAuthCluster:
    bootstrap: str
    idp: StandInIdentityProvider


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OAuthCluster]:
    folder = tmp_path_factory.mktemp("oauth-kafka")
    idp = StandInIdentityProvider(folder / "idp").start()
    port = free_port_pair()
    broker = _OAuthBroker(BrokerSettings(port=port, controller_port=port + 1, data_dir=str(folder / "data")), idp,
                          free_port())
    try:
        broker.start()
        yield OAuthCluster(f"127.0.0.1:{broker.oauth_port}", idp)
    finally:
        broker.stop()
        idp.stop()


@pytest.fixture(autouse=True)
def _fresh_idp(cluster: OAuthCluster) -> None:
    """Each test starts with the provider's audience and no token kept from another test."""
    cluster.idp.audience, cluster.idp.lifetime_s = AUDIENCE, 3600
    forget_token_providers()


def _oauth(cluster: OAuthCluster, secret: str = CLIENT_SECRET, scope: str = "kafka") -> KafkaSettings:
    """Settings for the cluster; a process keeps one token per client, secret and scope (another
    scope makes a test's own token)."""
    return KafkaSettings(bootstrap_servers=cluster.bootstrap, security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="OAUTHBEARER", sasl_username=CLIENT_ID, sasl_password=secret,
                         sasl_oauth_token_url=cluster.idp.token_url, sasl_oauth_scope=scope,
                         topic_prefix=f"oauth{uuid.uuid4().hex[:8]}.", partitions=1)


async def test_topics_events_and_reads_go_over_oauthbearer_with_a_stand_in_idp(cluster: OAuthCluster) -> None:
    kafka = _oauth(cluster)
    before = cluster.idp.issued
    await round_trip(kafka, b"with a bearer token")
    # The admin client, its per-broker connections, the producer and the consumer share one token.
    provider = kafka.oauth_token_provider()
    assert provider.fetched == 1
    assert cluster.idp.issued - before == 1
    assert cluster.idp.requests[-1] == {"grant_type": ["client_credentials"], "scope": ["kafka"]}


async def test_sasl_extensions_go_with_the_token_in_a_form_the_broker_takes_with_a_stand_in_idp(
        cluster: OAuthCluster) -> None:
    """Confluent Cloud wants its cluster and identity pool as SASL extensions beside the token.

    Kafka's broker parses the client's first message strictly (RFC 7628), extensions included, and
    refuses the login if one is malformed; its validator accepts any well-formed extension, so a
    login that goes through shows the extensions were sent as the protocol has them.
    """
    kafka = _oauth(cluster, scope="kafka.extensions").model_copy(
        update={"sasl_oauth_extensions": "logicalCluster=lkc-abc12,identityPoolId=pool-Xy1"})
    assert kafka.oauth_token_provider().extensions() == {"logicalCluster": "lkc-abc12", "identityPoolId": "pool-Xy1"}
    await round_trip(kafka, b"with extensions")


async def test_a_producer_outlives_its_tokens_on_a_cluster_that_ends_expired_logins_with_a_stand_in_idp(
        cluster: OAuthCluster) -> None:
    """A long-running proxy sends through many tokens' lifetimes. The broker gives a login the
    lifetime of its token (KIP-368's session lifetime) and closes the connection at its first
    request after it; aiokafka does not re-authenticate but connects again, and the provider
    gives the new connection a fresh token. Nothing sent may be lost."""
    cluster.idp.lifetime_s = 3
    kafka = _oauth(cluster, scope="kafka.expiring")
    registry = await created(kafka)
    topic = registry[CALLS].name
    provider = kafka.oauth_token_provider()
    sent = 0
    async with EventProducer(kafka, registry=registry) as producer:
        fetched = provider.fetched
        deadline = asyncio.get_running_loop().time() + 10  # past three tokens' lifetimes
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.wait_for(await producer.send_raw(topic, f"event {sent}".encode(), key=b"r-1"), 30)
            sent += 1
            await asyncio.sleep(0.2)
        # The broker closed the producer's login as each token expired; each new one took a new token.
        assert provider.fetched - fetched >= 2, provider.fetched - fetched
    records = await read(kafka, topic, expect=sent)
    assert sorted(r.value for r in records) == sorted(f"event {i}".encode() for i in range(sent))


async def test_a_token_for_another_audience_is_refused_by_the_broker_with_a_stand_in_idp(
        cluster: OAuthCluster) -> None:
    """The broker itself validates the token: the provider's signature is good, its audience is not.

    The refusal is the broker's answer to the login (not a connection dropped later), so it has
    a reason to give; and the refused token is not offered again.
    """
    cluster.idp.audience = "some-other-service"
    kafka = _oauth(cluster, scope="kafka.other-audience")
    await refused_start(kafka)
    provider = kafka.oauth_token_provider()
    issued = cluster.idp.issued
    reason = await bootstrap_refusal(kafka)
    assert reason is not None and "SaslAuthenticationFailed" in reason, reason
    assert "invalid_token" in reason, reason
    assert cluster.idp.issued == issued + 1 and provider.fetched >= 2


async def test_a_wrong_client_secret_is_named_by_the_cli_with_a_stand_in_idp(cluster: OAuthCluster) -> None:
    await refused_start(_oauth(cluster, secret="not-the-secret"))
    env = {"OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": cluster.bootstrap, "OPENFORGE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
           "OPENFORGE_KAFKA_SASL_MECHANISM": "OAUTHBEARER", "OPENFORGE_KAFKA_SASL_USERNAME": CLIENT_ID,
           "OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL": cluster.idp.token_url}
    await cli_names_the_refusal(env, "refused client 'openforge-proxy' with HTTP 401: invalid_client",
                                "not-the-secret", right_secret=CLIENT_SECRET)


async def test_the_proxy_publishes_over_oauthbearer_with_a_stand_in_idp(
        cluster: OAuthCluster, vllm_url: str, tmp_path: Path) -> None:
    await shipped_call(_oauth(cluster), vllm_url, tmp_path, "r-oauth")
