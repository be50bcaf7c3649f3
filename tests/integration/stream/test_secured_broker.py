"""Kafka behind TLS and SASL, as managed and shared clusters run it (the suite's broker is plaintext).

The test starts its own broker with two secured listeners besides its plaintext one (which only
its readiness probe and its own replication use):

* ``SASLSSL``: SASL over TLS, with SCRAM-SHA-512 (the user made when the storage is formatted) and
  PLAIN (the user in the listener's JAAS line);
* ``MTLS``: TLS with client certificates required.

Certificates come from the ``openssl`` CLI: a throwaway authority signs the broker's (for
127.0.0.1) and a client's. Every OpenForge client reaches Kafka through
``KafkaSettings.client_kwargs()``; these tests drive the ones that matter on a secured cluster:
topic creation (with its own per-broker connections), the producer and consumer, and the
proxy's shipping worker, which gets the password on its stdin.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netutil import free_port, free_port_pair
from secured_kafka import cli_names_the_refusal, refused_start, round_trip, shipped_call

from stream import KafkaSettings
from stream.broker import BrokerSettings, LocalBroker, ensure_kafka_jars

pytestmark = pytest.mark.kafka

USER = "openforge"
PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


@dataclass
class Secured:
    sasl_ssl: str
    mtls: str
    ca: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def _certificates(folder: Path) -> None:
    """A throwaway authority, and the broker's and a client's certificates signed by it."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=openforge-test-authority", cwd=folder)
    for name, extension in (("broker", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "extendedKeyUsage=clientAuth")):
        (folder / f"{name}.ext").write_text(extension + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=openforge-test-{name}", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=folder)
    # Kafka's PEM key store: the (PKCS#8, unencrypted) key, then the certificate chain.
    (folder / "broker-keystore.pem").write_text("".join(
        (folder / part).read_text() for part in ("broker.key", "broker.pem", "ca.pem")))


class _SecuredBroker(LocalBroker):
    """The suite's single-node broker with the two secured listeners added to its configuration."""

    def __init__(self, settings: BrokerSettings, certs: Path, sasl_port: int, mtls_port: int) -> None:
        super().__init__(settings)
        self.certs, self.sasl_port, self.mtls_port = certs, sasl_port, mtls_port

    def _write_config(self) -> Path:
        config = super()._write_config()
        port, controller = self.settings.port, self.settings.controller_port
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        plain = f'org.apache.kafka.common.security.plain.PlainLoginModule required user_{USER}="{PASSWORD}";'
        extra = {  # later keys win in a properties file
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
                         f"SASLSSL://127.0.0.1:{self.sasl_port},MTLS://127.0.0.1:{self.mtls_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},SASLSSL://127.0.0.1:{self.sasl_port},"
                                    f"MTLS://127.0.0.1:{self.mtls_port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASLSSL:SASL_SSL,MTLS:SSL",
            "listener.name.saslssl.sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
            "listener.name.saslssl.scram-sha-512.sasl.jaas.config": scram,
            "listener.name.saslssl.plain.sasl.jaas.config": plain,
            "listener.name.mtls.ssl.client.auth": "required",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.certs / "broker-keystore.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.certs / "ca.pem"),
        }
        with config.open("a") as out:
            out.writelines(f"{key}={value}\n" for key, value in extra.items())
        return config

    def format_with_scram_user(self) -> None:
        """Format the storage with the SCRAM user in it (KRaft keeps credentials in its metadata)."""
        config = self._write_config()
        libs = ensure_kafka_jars(self.settings.version, self.settings.cache_dir)
        done = subprocess.run(
            ["java", f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}", "-cp", f"{libs}/*",
             "kafka.tools.StorageTool", "format", f"--cluster-id={base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b'=').decode()}", "-c", str(config),
             "--standalone", "--add-scram", f"SCRAM-SHA-512=[name={USER},password={PASSWORD}]"],
            capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("secured-kafka")
    _certificates(folder / "certs")
    port = free_port_pair()
    broker = _SecuredBroker(BrokerSettings(port=port, controller_port=port + 1, data_dir=str(folder / "data")),
                            folder / "certs", free_port(), free_port())
    broker.data_dir.mkdir(parents=True)
    broker.format_with_scram_user()
    broker.start()
    try:
        yield Secured(f"127.0.0.1:{broker.sasl_port}", f"127.0.0.1:{broker.mtls_port}", folder / "certs" / "ca.pem",
                      folder / "certs" / "client.pem", folder / "certs" / "client.key")
    finally:
        broker.stop()


def _sasl(secured: Secured, mechanism: str = "SCRAM-SHA-512", password: str = PASSWORD) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=secured.sasl_ssl, security_protocol="SASL_SSL", sasl_mechanism=mechanism,
                         sasl_username=USER, sasl_password=password, ssl_cafile=str(secured.ca),
                         topic_prefix=f"sec{uuid.uuid4().hex[:8]}.", partitions=1)


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
async def test_topics_events_and_reads_go_over_sasl_ssl(secured: Secured, mechanism: str) -> None:
    await round_trip(_sasl(secured, mechanism), b"over a secured listener")


async def test_mutual_tls_takes_the_client_certificate_and_a_client_without_one_is_refused(secured: Secured) -> None:
    with_cert = KafkaSettings(bootstrap_servers=secured.mtls, security_protocol="SSL", ssl_cafile=str(secured.ca),
                              ssl_certfile=str(secured.client_cert), ssl_keyfile=str(secured.client_key),
                              topic_prefix=f"mtls{uuid.uuid4().hex[:8]}.", partitions=1)
    await round_trip(with_cert, b"over a secured listener")

    without = with_cert.model_copy(update={"ssl_certfile": None, "ssl_keyfile": None})
    await refused_start(without)


async def test_a_wrong_password_fails_the_start_and_the_cli_says_the_credentials_were_refused(
        secured: Secured) -> None:
    await refused_start(_sasl(secured, password="not-the-password"))

    # aiokafka's error only says it could not bootstrap; the command line names the refusal.
    env = {"OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": secured.sasl_ssl, "OPENFORGE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "OPENFORGE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "OPENFORGE_KAFKA_SASL_USERNAME": USER,
           "OPENFORGE_KAFKA_SSL_CAFILE": str(secured.ca)}
    await cli_names_the_refusal(env, "SaslAuthenticationFailed", "not-the-password", right_secret=PASSWORD)


async def test_the_proxy_publishes_captured_calls_over_sasl_ssl(
        secured: Secured, vllm_url: str, tmp_path: Path) -> None:
    await shipped_call(_sasl(secured), vllm_url, tmp_path, "r-secured")
