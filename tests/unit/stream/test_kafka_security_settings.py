"""TLS and SASL settings: what a process reads from OPENFORGE_KAFKA_*, what it refuses, what it never shows.

The connections themselves are tested against a real secured broker in
tests/integration/stream/test_secured_broker.py.
"""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from stream.settings import KafkaSettings


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its key, from the openssl CLI."""
    folder = tmp_path_factory.mktemp("pem")
    done = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem",
                           "-out", "cert.pem", "-days", "1", "-subj", "/CN=openforge-unit"],
                          cwd=folder, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return folder / "cert.pem", folder / "key.pem"


def test_the_default_is_plaintext_with_no_tls_context() -> None:
    options = KafkaSettings().client_options()
    assert options == {"security_protocol": "PLAINTEXT", "ssl_context": None}


def test_sasl_ssl_comes_from_the_environment_and_the_password_is_never_shown(
        monkeypatch: pytest.MonkeyPatch, pem: tuple[Path, Path]) -> None:
    cert, _ = pem
    for name, value in {"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "SCRAM-SHA-256",
                        "SASL_USERNAME": "trainer", "SASL_PASSWORD": "hunter2-secret", "SSL_CAFILE": str(cert),
                        "BOOTSTRAP_SERVERS": "k1:9093,k2:9093"}.items():
        monkeypatch.setenv(f"OPENFORGE_KAFKA_{name}", value)
    settings = KafkaSettings()
    kwargs = settings.client_kwargs()
    assert kwargs["bootstrap_servers"] == "k1:9093,k2:9093"
    assert kwargs["security_protocol"] == "SASL_SSL" and kwargs["sasl_mechanism"] == "SCRAM-SHA-256"
    assert kwargs["sasl_plain_username"] == "trainer" and kwargs["sasl_plain_password"] == "hunter2-secret"
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname and context.verify_mode is ssl.CERT_REQUIRED
    assert len(context.get_ca_certs()) == 1  # the given authority, not the system's
    shown = repr(settings) + str(settings) + settings.model_dump_json()
    assert "hunter2" not in shown


def test_mutual_tls_loads_the_client_certificate(pem: tuple[Path, Path]) -> None:
    cert, key = pem
    settings = KafkaSettings(security_protocol="SSL", ssl_cafile=str(cert), ssl_certfile=str(cert),
                             ssl_keyfile=str(key), ssl_check_hostname=False)
    context = settings.client_options()["ssl_context"]
    assert isinstance(context, ssl.SSLContext) and not context.check_hostname
    assert "sasl_mechanism" not in settings.client_options()


def test_a_key_that_is_not_a_key_fails_when_the_context_is_made(pem: tuple[Path, Path]) -> None:
    cert, _ = pem
    settings = KafkaSettings(security_protocol="SSL", ssl_certfile=str(cert), ssl_keyfile=str(cert))
    with pytest.raises(ssl.SSLError):
        settings.client_options()


@pytest.mark.parametrize(("values", "message"), [
    ({"security_protocol": "SASL_SSL"},
     "needs OPENFORGE_KAFKA_SASL_MECHANISM, OPENFORGE_KAFKA_SASL_USERNAME, OPENFORGE_KAFKA_SASL_PASSWORD"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"},
     "needs OPENFORGE_KAFKA_SASL_PASSWORD"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": ""},
     "needs OPENFORGE_KAFKA_SASL_PASSWORD"),
    ({"sasl_username": "u", "sasl_password": "p-secret"}, "SASL settings are set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "u",
      "sasl_password": "p-secret", "ssl_cafile": "/etc/hosts"},
     "TLS files are set but security_protocol is SASL_PLAINTEXT"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p-secret",
      "ssl_cafile": "/no/such/ca.pem"}, "OPENFORGE_KAFKA_SSL_CAFILE: no file at /no/such"),
    ({"security_protocol": "SSL", "ssl_certfile": "/etc/hosts"}, "SSL_CERTFILE and OPENFORGE_KAFKA_SSL_KEYFILE go"),
    ({"security_protocol": "SSL", "ssl_cafile": "/no/such/ca.pem"}, "OPENFORGE_KAFKA_SSL_CAFILE: no file at /no/such"),
    ({"security_protocol": "TLS"}, "security_protocol"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u", "sasl_password": "p-secret"},
     "sasl_mechanism"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
      "sasl_password": "p-secret"}, "needs OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL (the identity provider's token"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_url": "https://idp/t"},
     "needs OPENFORGE_KAFKA_SASL_USERNAME (the OAuth client id), OPENFORGE_KAFKA_SASL_PASSWORD (the OAuth client "
     "secret)"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "https://idp/t"},
     "OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL set, but the SASL mechanism is SCRAM-SHA-512"),
    ({"sasl_oauth_scope": "kafka"}, "SASL settings are set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "idp.example/token"},
     "OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL idp.example/token must be an http(s) URL with a host"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "https://[::1/token"}, "is not a URL"),
    # Credentials in the URL are not quoted back.
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "ftp://u:p-secret@idp/t?key=p-secret"},
     "OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL ftp://idp/t must be an http(s) URL"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_token_url": "https://idp/t", "sasl_oauth_ca_file": "/no/such/ca.pem"},
     "OPENFORGE_KAFKA_SASL_OAUTH_CA_FILE: no file at /no/such/ca.pem"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_ca_file": "/no/such/ca.pem"},
     "OPENFORGE_KAFKA_SASL_OAUTH_CA_FILE set, but the SASL mechanism is PLAIN"),
    ({"sasl_oauth_ca_file": "/no/such/ca.pem"}, "SASL settings are set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_header_urlencode": True},
     "OPENFORGE_KAFKA_SASL_OAUTH_HEADER_URLENCODE set, but the SASL mechanism is SCRAM-SHA-256"),
    ({"sasl_oauth_header_urlencode": True}, "SASL settings are set but security_protocol is PLAINTEXT"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u",
      "sasl_password": "p-secret", "sasl_oauth_extensions": "logicalCluster=lkc-1"},
     "OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS set, but the SASL mechanism is PLAIN"),
    *[({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "sasl_username": "u",
        "sasl_password": "p-secret", "sasl_oauth_token_url": "https://idp/t", "sasl_oauth_extensions": given},
       message) for given, message in [
        ("logicalCluster", "'logicalCluster' is not key=value"),
        ("logical_cluster=lkc-1", "key 'logical_cluster' must be letters only"),
        ("auth=Bearer x", "key 'auth' must be letters only, not 'auth'"),
        ("logicalCluster=", "the value of logicalCluster must be printable ASCII"),
        ("logicalCluster=lkc-\u00e9", "the value of logicalCluster must be printable ASCII"),
        ("a=1,a=2", "a is given twice"),
    ]],
])
def test_half_a_security_configuration_is_refused_with_the_setting_named(values: dict[str, object],
                                                                         message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        KafkaSettings(**values)
    assert message in str(raised.value)
    assert "p-secret" not in str(raised.value)  # errors never quote their input


def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose and .env files write unset values as empty ones."""
    for name in ("SECURITY_PROTOCOL", "SASL_MECHANISM", "SASL_USERNAME", "SASL_PASSWORD", "SSL_CAFILE",
                 "SASL_OAUTH_TOKEN_URL", "SASL_OAUTH_SCOPE", "SASL_OAUTH_CA_FILE", "SASL_OAUTH_HEADER_URLENCODE",
                 "SASL_OAUTH_EXTENSIONS"):
        monkeypatch.setenv(f"OPENFORGE_KAFKA_{name}", "")
    assert KafkaSettings().client_options() == {"security_protocol": "PLAINTEXT", "ssl_context": None}
