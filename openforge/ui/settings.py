"""Settings of ``openforge ui`` (``OPENFORGE_UI_*``); Kafka itself is ``OPENFORGE_KAFKA_*``."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.credentials import signing_key_from
from stream.broker import cache_root

__all__ = ["MIN_CREDENTIAL_CHARS", "UISettings", "is_loopback"]

MIN_CREDENTIAL_CHARS = 16
"""Shortest credential accepted: the pages show prompts and tool output."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class UISettings(BaseSettings):
    """Where the flight recorder listens, who may read it, and where its index lives."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_UI_", frozen=True, extra="ignore")

    host: str = "127.0.0.1"
    """Listen address. Loopback by default; any other address needs a credential."""

    port: int = Field(default=8200, ge=0, le=65535)
    """Listen port."""

    credential: SecretStr | None = None
    """The credential a browser or client must present (at least 16 characters): as ``?token=`` once
    (a cookie keeps it), or as ``Authorization: Bearer``. Without one, a loopback server makes a
    random one and prints the link that carries it; another address refuses to start."""

    credential_file: Path | None = None
    """Read the credential from this file instead (a mounted Kubernetes Secret)."""

    index_path: Path = Field(default_factory=lambda: cache_root() / "ui" / "index.sqlite")
    """The SQLite index. One file per experiment (topic prefix): its consumer group is named after it,
    so a new file is filled from the topics' beginning."""

    max_rollouts: int = Field(default=1_000_000, ge=1000)
    """Rollouts the index keeps; beyond this the oldest are pruned with their calls (the events stay
    on Kafka for its retention)."""

    trace_url: str = ""
    """Link to the tracing backend for one trace, with ``{trace_id}`` where the id goes (e.g. a
    Grafana Explore URL with Tempo); empty shows the id without a link."""

    tokenizer: Path | None = None
    """A ``tokenizer.json`` (or a model folder holding one) to show token text in the token view;
    without it the view shows token ids."""

    live_refresh_s: int = Field(default=10, ge=0)
    """How often the runs page reloads itself to show new events; 0 never."""

    def credential_value(self) -> str | None:
        """The configured credential, from the setting or its file; None when neither is set.

        Raises:
            ValueError: The file cannot be read, or the credential is too short.
        """
        value = None if self.credential is None else self.credential.get_secret_value()
        try:
            raw = signing_key_from(value, self.credential_file)
        except OSError as exc:
            raise ValueError(f"the credential file (OPENFORGE_UI_CREDENTIAL_FILE) cannot be read: "
                             f"{exc.strerror or exc} ({self.credential_file})") from exc
        if raw is None or raw == b"":
            return None
        text = raw.decode("utf-8", "replace")
        if len(text) < MIN_CREDENTIAL_CHARS:
            raise ValueError(f"the UI credential has {len(text)} characters; it needs at least {MIN_CREDENTIAL_CHARS}")
        return text
