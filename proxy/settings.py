"""Settings of the proxy process (``OPENFORGE_PROXY_*``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, StrictFloat, StrictInt, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from proxy.media import ImagePolicy
from schemas.credentials import signing_key_from
from stream import KafkaSettings

_SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    # key: (lowest, highest, lowest excluded), as vLLM checks them
    "temperature": (0.0, 1e6, False), "top_p": (0.0, 1.0, True), "top_k": (-1, 1e9, False),
    "min_p": (0.0, 1.0, False), "repetition_penalty": (0.0, 1e6, True),
    "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
}

FORCEABLE_SAMPLING = frozenset(_SAMPLING_RANGES)
"""What :attr:`ProxySettings.sampling` may set: how tokens are drawn, not what the answer must be
(its length, stop strings, a seed stay the harness's)."""

POLICY_SAMPLING: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                           "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                           "frequency_penalty": 0.0}
"""The policy's own distribution, which the learner scores tokens under: what the demo and the
Helm chart set :attr:`ProxySettings.sampling` to. The penalties too, as vLLM takes them from a
model's ``generation_config.json`` as well (Qwen2.5's instruct models ask ``repetition_penalty``
1.05)."""


REMOVED_SETTINGS: dict[str, str] = {
    "durability": "OPENFORGE_PROXY_DURABILITY is gone: every call's event is kept in the local journal "
                  "(OPENFORGE_PROXY_SPOOL_DIR/journal) and shipped to Kafka, which keeps what `ack` kept without a "
                  "broker round trip in every answer, and a reward still waits until Kafka has it "
                  "(OPENFORGE_PROXY_PUBLISH_TIMEOUT_S). Remove the setting; events an `ack` proxy left in its spool "
                  "folder are moved into the journal at start.",
    "capture_linger_ms": "OPENFORGE_PROXY_CAPTURE_LINGER_MS is gone with `ack` durability: the journal's shipper "
                         "batches events itself; OPENFORGE_PROXY_JOURNAL_LINGER_MS sets how long they gather. "
                         "Remove the setting.",
    "journal_shipper": "OPENFORGE_PROXY_JOURNAL_SHIPPER is gone: the proxy ships its journal from its own event "
                       "loop, one process and about one core per proxy (run more replicas for more calls). "
                       "Remove the setting.",
}
"""Settings the proxy no longer has, each with what to use instead: a start with one set fails."""


class ProxySettings(BaseSettings):
    """Where the proxy listens, which engines it fronts, and how it keeps every call."""

    model_config = SettingsConfigDict(env_prefix="OPENFORGE_PROXY_", frozen=True, extra="ignore")

    host: str = "127.0.0.1"
    """Listen address. Rollout pods reach it through a Service on a cluster."""

    port: int = Field(default=8100, ge=0, le=65535)
    """Listen port."""

    upstreams: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """vLLM OpenAI-compatible servers (comma-separated in the environment). Requests of
    one rollout stick to one of them, so its growing prompt hits the prefix cache."""

    served_model: str | None = None
    """Model name sent upstream whatever the harness asked for (harnesses hard-code names
    like ``claude-sonnet-4``); None passes the harness's name through."""

    credential_key: SecretStr | None = None
    """HMAC key that signs rollout tokens (at least 16 bytes). Without it the proxy refuses
    to start unless ``allow_anonymous`` is set."""

    credential_key_file: Path | None = None
    """Read the key from this file instead (a mounted Kubernetes Secret)."""

    credential_other_key: SecretStr | None = None
    """A second key whose tokens are accepted too, for rotating the signing key without refusing
    the tokens of rollouts in flight (docs/proxy.md, "Rotating the signing key"). The proxy signs
    nothing itself; whoever mints tokens (the launcher) signs with its one key."""

    credential_other_key_file: Path | None = None
    """Read the other key from this file instead. A file that is not there, or is empty, means no
    other key: a mounted Secret holds it only while a key is being rotated."""

    allow_anonymous: bool = False
    """Accept calls without a token, attributed to the rollout in the path or header. Only
    without a credential key (one-machine experiments): with a key, tokens are what keeps one
    rollout's agent out of another's data, so the proxy refuses to start with both. Without a key
    no verifier can prove itself, so rewards cannot be posted."""

    sampling: dict[str, StrictFloat | StrictInt] = Field(default_factory=dict)
    """Sampling parameters every call reaches the engine with, whatever the harness asked (a
    JSON object in the environment, e.g. :data:`POLICY_SAMPLING`); empty (the default) sends what
    each harness asked. For on-policy rollouts: the learner scores tokens under the policy's own
    distribution (temperature 1, nothing cut, no penalty), while the engine samples with what the
    harness sent or, for what it left out, the model's ``generation_config.json`` defaults
    (Qwen3's are temperature 0.6, top_p 0.95, top_k 20). The tokens then come from another
    distribution: with vLLM's ``processed_logprobs`` (the Helm chart's) the recorded logprobs are
    of it and every importance ratio is off by the difference; with its default ``raw_logprobs``
    (the local engine's) they are the model's own at temperature 1, so the ratios look right
    and the bias goes unseen. The event records the forced values (what the engine got; the
    harness's values they replaced are not kept). Keys and ranges:
    :data:`FORCEABLE_SAMPLING`. Chat completions' other fields that bend the distribution are
    refused (:mod:`proxy.chat_fields`); a structured-output format a translated request asks for
    still applies."""

    upstream_timeout_s: float = Field(default=600.0, gt=0)
    """Longest an engine call may take, end to end."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Largest request body accepted; larger ones get 413."""

    max_head_bytes: int = Field(default=64 * 1024, ge=4096)
    """Largest request line and headers accepted, together; larger ones get 431 and the connection
    is closed. The HTTP parser has no bound of its own: one 100 MB header, sent before any
    credential is looked at, was read whole into memory."""

    spool_dir: Path = Path("./.openforge-spool")
    """Where events wait for Kafka: the journal is ``journal/`` inside it. A call's event is kept
    there (page cache, flushed every ``journal_fsync_interval_ms``) before its answer completes,
    then shipped to Kafka in order and in batches."""

    spool_max_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    """Bound on what waits for Kafka; when reached the proxy answers 503 with Retry-After
    instead of taking calls."""

    min_free_disk_bytes: int | None = Field(default=None, ge=0)
    """Free space kept on the disk of ``spool_dir`` for the calls in flight: below it calls and
    rewards get 503 with Retry-After (a call before the engine's work), and the proxy is not
    ready, until a margin above it is free again (a volume shared with other files, or smaller
    than ``spool_max_bytes``, fills before the bound). Looked at once a second; 0 turns it off.
    Unset, a sixteenth of the volume, at most 64 MiB (the journal's segments are as large); a
    floor that leaves the journal less than four segments' room is refused at start."""

    journal_fsync_interval_ms: int = Field(default=100, ge=0, le=60_000)
    """How often the journal is flushed to disk. A crashed proxy loses nothing either way (its
    writes are in the page cache); a crashed machine loses at most this window of events not
    yet in Kafka, the same trade Kafka's brokers make by default. 0 flushes before every answer."""

    journal_linger_ms: int = Field(default=100, ge=0, le=1000)
    """How long the journal's shipper lets events gather before each produce request. No answer
    waits for it, so it only delays when Kafka has an event; every produce request costs the
    broker and the proxy CPU, so fewer, larger ones leave more for calls. There is no linger
    after a batch that filled up (a backlog ships back to back), nor while a reward waits for
    its rollout's calls to reach Kafka. 100 ms rather than 20: at 16 connections on two shared
    cores the broker spent 37 to 42 µs per call instead of 47 to 48 (250 ms saved no more)."""

    images: ImagePolicy = "refuse"
    """Whether images reach the engine (``refuse``, ``inline`` or ``placeholder``; see
    :mod:`proxy.media`). Off by default: the learner trains on token ids alone. ``inline`` passes
    images sent as data (for a stack that trains on them, or serving alone); images by URL are
    refused, since the engine would fetch them from inside the cluster. ``placeholder`` sends
    each image as a line of text saying it was left out, so a rollout whose harness read an image
    goes on with a text-only model."""

    publish_timeout_s: float = Field(default=5.0, gt=0)
    """How long to wait for Kafka's acknowledgement: per shipped batch, and for a reward to reach
    Kafka before answering its verifier."""

    kafka_outage_report_s: float = Field(default=30.0, gt=0)
    """While Kafka is away, how often the log says so: one line when it goes, a summary (how long,
    what waits in the journal) every this many seconds, one line when it is back. The Kafka
    client's own messages are held back to one per interval, and counted in those lines."""

    drain_s: int = Field(default=30, ge=1, le=3600)
    """How long a stopping proxy lets the calls in flight finish (streams included). Recording
    the calls of harnesses that left takes up to 10 s more, and shipping what the journal still
    holds up to three times ``publish_timeout_s`` and 5 s: the Helm chart's grace period allows
    for all of it."""

    stream_keepalive_s: float = Field(default=10.0, gt=0, le=300)
    """Longest silence in a translated stream (Anthropic, Responses): reasoning an Anthropic
    harness did not ask to see (thinking off, or its display ``omitted``) and the arguments of an
    Anthropic or custom Responses tool call until the call ends send the harness nothing, and an
    engine sends nothing at all while a request waits in its queue, prefills, or is paused for
    new weights. Harnesses abort a silent stream (Claude Code and Codex after 5 minutes) and send
    the call again. After this long (noticed within twice it while the engine is silent) the
    harness gets a keep-alive its client passes on: an empty delta of the open Anthropic block
    (``ping`` between blocks, which the SDKs drop), ``message_start`` or the opening Responses
    events before the first token, a repeated ``response.in_progress``. Chat completions pass the
    engine's chunks on as they come, reasoning included."""

    retry_window_s: float = Field(default=600.0, gt=0)
    """How long a failed call is remembered, so an identical re-send is linked as its retry."""

    capture: bool = True
    """Record every call on Kafka. Off only to measure what capture costs (benchmarks); the call
    metrics are kept either way."""

    continuation: bool = True
    """Serve calls by token-in/token-out continuation where a replica offers the endpoints (vLLM
    started with ``--enable-scale-out``): a rollout's next call then extends the exact token ids of
    its earlier turn, and each call records the engine's weight version per token. False forces
    chat mode (``/v1/chat/completions``), which re-renders the conversation on every call."""

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    """Kafka connection (``OPENFORGE_KAFKA_*``)."""

    durability: str | None = Field(default=None, exclude=True, repr=False)
    """Removed (see :data:`REMOVED_SETTINGS`): set, the proxy refuses to start and says what to do."""

    capture_linger_ms: str | None = Field(default=None, exclude=True, repr=False)
    """Removed (see :data:`REMOVED_SETTINGS`): set, the proxy refuses to start and says what to do."""

    journal_shipper: str | None = Field(default=None, exclude=True, repr=False)
    """Removed (see :data:`REMOVED_SETTINGS`): set, the proxy refuses to start and says what to do."""

    @model_validator(mode="after")
    def _no_removed_settings(self) -> ProxySettings:
        # A setting that is gone would otherwise be ignored in silence, and an operator would
        # believe the proxy kept calls the way it names.
        said = [REMOVED_SETTINGS[name] for name in REMOVED_SETTINGS if getattr(self, name) is not None]
        if said:
            raise ValueError(" ".join(said))
        return self

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling_keys(cls, value: object) -> object:
        # Before the values' types, so a key it may not set is named as such, not as a bad number.
        if isinstance(value, dict):
            unknown = sorted(set(value) - FORCEABLE_SAMPLING)
            if unknown:
                allowed = ", ".join(sorted(FORCEABLE_SAMPLING))
                raise ValueError(f"sampling cannot set {', '.join(map(str, unknown))}; it sets {allowed}")
        return value

    @field_validator("sampling")
    @classmethod
    def _sampling_values(cls, value: dict[str, float | int]) -> dict[str, float | int]:
        # Checked here, once, rather than refused by the engine on every call.
        for key, number in value.items():
            low, high, low_excluded = _SAMPLING_RANGES[key]
            if not math.isfinite(number) or number < low or number > high or (low_excluded and number == low):
                bound = f"over {low:g}" if low_excluded else f"at least {low:g}"
                raise ValueError(f"sampling {key} must be {bound} and at most {high:g}, got {number}")
        if "top_k" in value:
            if value["top_k"] != int(value["top_k"]):
                raise ValueError(f"sampling top_k must be a whole number, got {value['top_k']}")
            value["top_k"] = int(value["top_k"])  # vLLM refuses -1.0 where it wants an integer
        return value

    @field_validator("upstreams", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        return value

    def signing_key(self) -> bytes | None:
        """The credential key's bytes, from the setting or the file."""
        value = None if self.credential_key is None else self.credential_key.get_secret_value()
        try:
            return signing_key_from(value, self.credential_key_file)
        except OSError as exc:
            raise ValueError(f"the credential key file (OPENFORGE_PROXY_CREDENTIAL_KEY_FILE) cannot be read: "
                             f"{exc.strerror or exc} ({self.credential_key_file})") from exc

    def other_signing_key(self) -> bytes | None:
        """The other accepted key's bytes, from the setting or the file; None when there is none."""
        if self.credential_other_key is not None and self.credential_other_key.get_secret_value():
            return self.credential_other_key.get_secret_value().encode()
        if self.credential_other_key_file is not None:
            try:
                key = self.credential_other_key_file.read_bytes().strip()
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ValueError(f"the other credential key file (OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY_FILE) cannot "
                                 f"be read: {exc.strerror or exc} ({self.credential_other_key_file})") from exc
            return key or None
        return None
