"""Kafka connection settings, read from the environment in one place.

Every process composes :class:`KafkaSettings` into its own settings class, so the
environment stays the single source of configuration (``OPENFORGE_KAFKA_*``).
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Compression = Literal["zstd", "lz4", "gzip", "none"]


class _HideSaslPayloads(logging.Filter):
    """Keep SASL credentials out of aiokafka's debug log of every request it sends.

    ``SaslAuthenticateRequest`` carries the PLAIN password, the OAUTHBEARER token or SCRAM's proof;
    aiokafka logs each request it sends at DEBUG with its fields, so turning debug logging on to
    diagnose a connection would write the credentials out.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(_sasl_request(arg) for arg in record.args):
            record.args = tuple(f"{type(arg).__name__}(sasl_auth_bytes=<hidden>)" if _sasl_request(arg) else arg
                                for arg in record.args)
        return True


def _sasl_request(value: object) -> bool:
    return type(value).__name__.startswith("SaslAuthenticateRequest")


logging.getLogger("aiokafka.conn").addFilter(_HideSaslPayloads())
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]


class KafkaSettings(BaseSettings):
    """How to reach Kafka and how to talk to it.

    Defaults match the local development broker (`openforge kafka up`), so a
    one-machine run needs no configuration at all.
    """

    # Errors never quote their input (it holds the SASL password); an empty variable counts as
    # unset, as compose and .env files write them.
    model_config = SettingsConfigDict(env_prefix="OPENFORGE_KAFKA_", frozen=True, extra="ignore",
                                      hide_input_in_errors=True, env_ignore_empty=True)

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated ``host:port`` list of brokers to bootstrap from."""

    topic_prefix: str = ""
    """Prepended to every registry topic name (e.g. ``exp42.``) so experiments can
    share one cluster without seeing each other's events."""

    client_id: str = "openforge"
    """Reported to the brokers; shows up in their logs and quotas."""

    compression: Compression = "zstd"
    """Batch compression. zstd compresses packed token ids best; lz4 is cheaper on CPU."""

    linger_ms: int = Field(default=5, ge=0)
    """How long the producer waits to fill a batch. A few milliseconds buys large
    batches under load and costs little latency when idle."""

    batch_size_bytes: int = Field(default=256 * 1024, gt=0)
    """Upper bound of one producer batch per partition."""

    request_timeout_ms: int = Field(default=40_000, gt=0)
    """How long one broker request may take before the client gives up on it."""

    partitions: int | None = Field(default=None, ge=1)
    """Overrides every registry topic's partition count when set (small clusters, tests)."""

    replication_factor: int = Field(default=1, ge=1)
    """Replicas per partition when topics are created. 1 suits the local broker only."""

    security_protocol: SecurityProtocol = "PLAINTEXT"
    """How clients talk to the brokers: ``SASL_SSL`` for most managed and shared clusters,
    ``SSL`` for TLS alone (with client certificates for mutual TLS), ``PLAINTEXT`` for the local
    broker and clusters reachable only inside their own network."""

    ssl_cafile: str | None = None
    """PEM file of the certificate authorities that signed the brokers' certificates; unset,
    the system's authorities are trusted (as for a managed cluster's public certificates)."""

    ssl_certfile: str | None = None
    """PEM file of this client's certificate, for brokers that require mutual TLS."""

    ssl_keyfile: str | None = None
    """PEM file of the private key of ``ssl_certfile``."""

    ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host it was reached at. Off only for
    clusters whose certificates name other hosts; the connection is then open to an impostor."""

    sasl_mechanism: SaslMechanism | None = None
    """How clients authenticate under ``SASL_*``: SCRAM sends a proof, not the password; PLAIN
    sends the password itself, so it belongs under ``SASL_SSL`` only; OAUTHBEARER sends a token
    from an identity provider (``sasl_oauth_token_url``), got with the user and password as the
    OAuth client's id and secret."""

    sasl_username: str | None = None
    """The SASL user (with OAUTHBEARER: the OAuth client id)."""

    sasl_password: SecretStr | None = None
    """The SASL user's password, or with OAUTHBEARER the OAuth client secret
    (``OPENFORGE_KAFKA_SASL_PASSWORD``, e.g. from a Kubernetes secret). Never logged or shown:
    ``repr`` and JSON dumps mask it."""

    sasl_oauth_token_url: str | None = None
    """OAUTHBEARER: the identity provider's token endpoint (``https://…/token``), asked for a token
    with the client-credentials grant. Its certificate is checked against the system's
    authorities, and those of ``sasl_oauth_ca_file`` when set."""

    sasl_oauth_scope: str | None = None
    """OAUTHBEARER: the scope to ask for, where the identity provider needs one."""

    sasl_oauth_ca_file: str | None = None
    """OAUTHBEARER: PEM file of a private authority that signed the token endpoint's certificate,
    trusted besides the system's (only for the token endpoint: the process's other HTTPS clients
    keep the system's authorities)."""

    sasl_oauth_extensions: str | None = None
    """OAUTHBEARER: SASL extensions sent with the token (RFC 7628), as ``key=value`` pairs joined by
    commas: ``logicalCluster=lkc-…,identityPoolId=pool-…`` for Confluent Cloud. Keys are letters
    only and ``auth`` is reserved; values are printable ASCII without commas."""

    sasl_oauth_header_urlencode: bool = False
    """OAUTHBEARER: form-encode the client id and secret before they go to the token endpoint in
    basic authentication, as RFC 6749 (2.3.1) has it and Kafka's ``sasl.oauthbearer.header.urlencode``
    does. Off by default, as in Kafka; identity providers that decode them (Keycloak, PingAM)
    need it on for a secret holding ``+`` or ``%``, or a client id holding ``:``."""

    @model_validator(mode="after")
    def _security_complete(self) -> KafkaSettings:
        """Refuse half a security configuration at start, naming the setting to fix.

        Otherwise it shows later, as a broker's disconnect or a handshake error at the first connection.
        """
        sasl = self.security_protocol.startswith("SASL_")
        tls = self.security_protocol.endswith("SSL")
        prefix = "OPENFORGE_KAFKA_"
        if sasl:
            given = {"sasl_mechanism": self.sasl_mechanism, "sasl_username": self.sasl_username,
                     "sasl_password": self.sasl_password and self.sasl_password.get_secret_value()}
            meaning: dict[str, str] = {}
            if self.sasl_mechanism == "OAUTHBEARER":
                given["sasl_oauth_token_url"] = self.sasl_oauth_token_url
                meaning = {"sasl_username": " (the OAuth client id)", "sasl_password": " (the OAuth client secret)",
                           "sasl_oauth_token_url": " (the identity provider's token endpoint)"}
            missing = [name for name, value in given.items() if not value]
            if missing:
                raise ValueError(f"security_protocol {self.security_protocol} needs "
                                 + ", ".join(prefix + name.upper() + meaning.get(name, "") for name in missing))
        elif any(value is not None for value in (self.sasl_mechanism, self.sasl_username, self.sasl_password,
                                                 self.sasl_oauth_token_url, self.sasl_oauth_scope,
                                                 self.sasl_oauth_ca_file, self.sasl_oauth_extensions,
                                                 self.sasl_oauth_header_urlencode or None)):
            raise ValueError(f"SASL settings are set but security_protocol is {self.security_protocol}; "
                             f"use SASL_SSL (or SASL_PLAINTEXT) for them to be used")
        oauth = {"sasl_oauth_token_url": self.sasl_oauth_token_url, "sasl_oauth_scope": self.sasl_oauth_scope,
                 "sasl_oauth_ca_file": self.sasl_oauth_ca_file, "sasl_oauth_extensions": self.sasl_oauth_extensions,
                 "sasl_oauth_header_urlencode": self.sasl_oauth_header_urlencode or None}
        if sasl and self.sasl_mechanism != "OAUTHBEARER" and any(v is not None for v in oauth.values()):
            raise ValueError(", ".join(prefix + name.upper() for name, v in oauth.items() if v is not None)
                             + f" set, but the SASL mechanism is {self.sasl_mechanism}; set "
                             f"{prefix}SASL_MECHANISM=OAUTHBEARER for them to be used")
        if self.sasl_oauth_extensions is not None:
            from stream.oauth import parse_extensions

            parse_extensions(self.sasl_oauth_extensions)  # raises ValueError naming the pair
        if self.sasl_oauth_token_url is not None:
            from stream.oauth import check_token_url, shown_url

            problem = check_token_url(self.sasl_oauth_token_url)
            if problem is not None:
                raise ValueError(f"{prefix}SASL_OAUTH_TOKEN_URL {shown_url(self.sasl_oauth_token_url)} {problem}")
        files = {"ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        if not tls and any(files.values()):
            raise ValueError(f"TLS files are set but security_protocol is {self.security_protocol}; "
                             f"use SSL or SASL_SSL for them to be used")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(f"{prefix}SSL_CERTFILE and {prefix}SSL_KEYFILE go together (a client certificate "
                             f"and its key)")
        for name, path in {**files, "sasl_oauth_ca_file": self.sasl_oauth_ca_file}.items():
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{prefix}{name.upper()}: no file at {path}")
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``SSL`` and ``SASL_SSL``, built from the PEM files; None otherwise.

        Raises:
            ssl.SSLError: a file is not a PEM certificate or key, or the key does not match.
        """
        if not self.security_protocol.endswith("SSL"):
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile is not None:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return context

    def client_options(self) -> dict[str, Any]:
        """The security arguments of every aiokafka client (producer, consumer, admin, connection).

        The one place these settings become aiokafka's arguments, so that no client is left
        talking plaintext to a secured cluster.
        """
        options: dict[str, Any] = {"security_protocol": self.security_protocol, "ssl_context": self.ssl_context()}
        if self.sasl_mechanism == "OAUTHBEARER":
            options.update(sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=self.oauth_token_provider())
        elif self.sasl_mechanism is not None:
            assert self.sasl_password is not None  # the validator requires it with a mechanism
            options.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                           sasl_plain_password=self.sasl_password.get_secret_value())
        return options

    def oauth_token_provider(self) -> Any:
        """OAUTHBEARER's token source (None without OAUTHBEARER).

        The process's one source for this client at this endpoint (:func:`stream.oauth.token_provider`),
        so that every Kafka client it makes shares the token, whichever settings object made it.
        """
        if self.sasl_mechanism != "OAUTHBEARER":
            return None
        from stream.oauth import token_provider

        # The validator requires all three.
        assert self.sasl_oauth_token_url is not None
        assert self.sasl_username is not None
        assert self.sasl_password is not None
        provider = token_provider(self.sasl_oauth_token_url, self.sasl_username, self.sasl_password,
                                  self.sasl_oauth_scope, self.sasl_oauth_ca_file, self.sasl_oauth_header_urlencode,
                                  self.sasl_oauth_extensions)
        if self.security_protocol == "SASL_PLAINTEXT":
            provider.warn_once_if_sent_in_the_clear(self.bootstrap_servers)
        return provider

    def scoped(self, name: str) -> str:
        """A consumer group or transactional id under this deployment's topic prefix.

        Group and transactional ids are cluster-wide like topic names: two experiments sharing a
        cluster under different prefixes but the same default group would rebalance each other's
        consumers, and their assemblers would fence each other's transactions.
        """
        return self.topic_prefix + name

    def client_kwargs(self) -> dict[str, Any]:
        """:meth:`client_options` with ``bootstrap_servers``: the arguments of a new aiokafka client."""
        return {"bootstrap_servers": self.bootstrap_servers, **self.client_options()}

    def worker_json(self) -> dict[str, Any]:
        """These settings as JSON values, the password included (a JSON dump masks it).

        For a child process that gets them on a pipe, never on its command line or in its environment.
        """
        values = self.model_dump(mode="json")
        if self.sasl_password is not None:
            values["sasl_password"] = self.sasl_password.get_secret_value()
        return values


class BrokerSettings(BaseSettings):
    """The local single-node development broker (`openforge kafka up`)."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_BROKER_", frozen=True, extra="ignore")

    version: str = "4.4.0"
    """Apache Kafka release to run. 4.4.0 is the newest release whose transactions
    work with aiokafka's producer; see docs/kafka.md for the evidence."""

    port: int = Field(default=9092, ge=1, le=65535)
    """Client (PLAINTEXT) listener on 127.0.0.1."""

    controller_port: int = Field(default=9093, ge=1, le=65535)
    """KRaft controller listener on 127.0.0.1; ``port`` + 1 unless set, so moving the client port
    (a second broker on one machine) moves both, as ``openforge kafka up --port`` does."""

    data_dir: str | None = None
    """Where logs, metadata and the broker's own log file live; defaults to a folder
    under the cache (``<cache>/kafka/data``)."""

    heap: str = "512m"
    """JVM heap (-Xmx). A single-node dev broker needs little."""

    start_timeout_s: float = Field(default=90.0, gt=0)
    """How long to wait for the broker to answer before declaring the start failed."""

    cache_dir: str | None = None
    """Where the broker jars are cached; defaults to ``$OPENFORGE_CACHE`` or the
    user's cache folder (``$XDG_CACHE_HOME/openforge``, else ``~/.cache/openforge``)."""

    @model_validator(mode="before")
    @classmethod
    def _controller_follows_port(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("controller_port") is None and data.get("port") is not None:
            return {**data, "controller_port": int(data["port"]) + 1}
        return data

    @model_validator(mode="after")
    def _distinct_ports(self) -> Self:
        if self.port == self.controller_port:
            raise ValueError(f"the client and controller ports are both {self.port}; give them different ports")
        return self
