"""Per-rollout credentials: signed, self-contained, verified without state.

The launcher mints two tokens per rollout: one for the agent (it may make model
calls for its own rollout and nothing else) and one for the verifier (it may
post that rollout's reward, and make no model calls: every call is recorded as
a turn of the agent). The proxy verifies them with the shared key
alone, so any number of proxy replicas agree without a database. The format is a
contract between launcher and proxy, which is why it lives beside the event
schemas; it does no I/O but read the key's file (:func:`signing_key_from`).

Token: ``of1.<base64url(claims JSON)>.<base64url(HMAC-SHA256(key, "of1." + claims))>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import time
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "MAX_TOKEN_TTL_S", "MIN_KEY_BYTES", "TOKEN_PREFIX", "Credential", "CredentialError", "Role", "mint_token",
    "signing_key_from", "verify_token",
]

TOKEN_PREFIX = "of1."  # noqa: S105 (a format tag, not a secret)
"""What every rollout token begins with (its format's version)."""
MIN_KEY_BYTES = 16
"""Shortest signing key accepted: 128 bits."""
_MAX_TOKEN_CHARS = 4096
"""Longer tokens are refused unread: a minted one is a few hundred characters."""
MAX_TOKEN_TTL_S = 100 * 365 * 86_400
"""A century: longer lifetimes overflow the claims' integer, and no rollout runs that long."""
_CLAIM_NAMES = {"r": "rollout_id", "t": "task_id", "exp": "expiry", "role": "role"}


class Role(StrEnum):
    """What a credential may do."""

    AGENT = "agent"
    """Model calls for its rollout."""
    VERIFIER = "verifier"
    """The reward of its rollout (no model calls: they would be recorded as the agent's)."""


class Credential(BaseModel):
    """The claims a token carries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_id: str = Field(min_length=1, max_length=200, pattern=r"^[^/]+$", alias="r")
    """The only rollout this token may act for (a path segment of its URLs, so without ``/``)."""
    role: Role = Field(alias="role")
    """Agent or verifier."""
    expires_at: int = Field(alias="exp")
    """Unix time (seconds) after which the token is refused."""
    task_id: str | None = Field(default=None, min_length=1, max_length=256, alias="t")
    """Task of the rollout, so the proxy can stamp it on events without a lookup."""

    @field_validator("rollout_id")
    @classmethod
    def _not_a_dot_segment(cls, value: str) -> str:
        # HTTP clients resolve "." and ".." in a URL's path before sending it, so the rollout's
        # own prefix and reward URLs would reach another path: its token could never be used.
        if value in (".", ".."):
            raise ValueError(f"{value!r} cannot be a rollout id: URLs resolve it away")
        return value


class CredentialError(Exception):
    """The token is malformed, forged, expired or for another purpose (answer 401)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _check_key(key: bytes) -> None:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the credential signing key must be at least {MIN_KEY_BYTES} bytes")


def signing_key_from(value: str | None, path: Path | None) -> bytes | None:
    """The signing key from its setting, else from its file.

    The one rule the launcher, the proxy and ``openforge token`` read it by, so that all three
    sign and verify with the same bytes.

    A setting that is set but empty (an unfilled template's ``KEY=``) does not hide the file
    beside it; the file's surrounding whitespace (its last newline) is not part of the key.

    Returns:
        The key; ``b""`` for an empty setting and no file; None when neither is given.

    Raises:
        OSError: the file cannot be read (each caller names its own variable).
    """
    if value:
        return value.encode()
    if path is not None:
        return path.read_bytes().strip()
    return None if value is None else b""


def mint_token(key: bytes, rollout_id: str, role: Role, ttl_s: float, *, task_id: str | None = None,
               now: float | None = None) -> str:
    """Sign a token for ``rollout_id`` and ``role`` valid for ``ttl_s`` seconds.

    Raises:
        ValueError: a weak key, a lifetime that is not a positive finite number of seconds (up to
            a century), claims the proxy would refuse (an empty or too long rollout or task id,
            a rollout id with ``/``), or claims too long for a token.
    """
    _check_key(key)
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= MAX_TOKEN_TTL_S):
        raise ValueError(f"a token's lifetime must be a positive number of seconds up to {MAX_TOKEN_TTL_S:,}, "
                         f"not {ttl_s!r}")
    claims: dict[str, str | int] = {"r": rollout_id, "role": role.value,
                                    "exp": int((time.time() if now is None else now) + ttl_s)}
    if task_id is not None:
        claims["t"] = task_id
    try:
        # Checked as the proxy will check them: a token it would refuse on every call (or whose
        # verifier it would refuse its reward) is better refused to whoever mints it.
        Credential.model_validate(claims)
    except ValidationError as exc:
        problems = "; ".join(f"{_CLAIM_NAMES.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"these claims would be refused by the proxy: {problems}") from None
    body = TOKEN_PREFIX + _b64(orjson.dumps(claims))
    signature = hmac.new(key, body.encode(), hashlib.sha256).digest()
    token = f"{body}.{_b64(signature)}"
    if len(token) > _MAX_TOKEN_CHARS:
        raise ValueError(f"a token for these claims would be longer than {_MAX_TOKEN_CHARS} characters")
    return token


def verify_token(key: bytes | Sequence[bytes], token: str, *, now: float | None = None) -> Credential:
    """Check signature and expiry; return the claims.

    Args:
        key: The signing key, or several keys any of which may have signed the token: while a
            key is rotated, tokens signed with the old one and with the new one are both live.
        token: The token as the caller sent it.
        now: The time to check expiry against (Unix seconds); the clock's when None.

    Raises:
        CredentialError: anything is wrong; the message says what, never the key.
    """
    keys = (key,) if isinstance(key, bytes) else tuple(key)
    if not keys:
        raise ValueError("no credential signing key to verify with")
    for one in keys:
        _check_key(one)
    if len(token) > _MAX_TOKEN_CHARS:
        raise CredentialError(f"token longer than {_MAX_TOKEN_CHARS} characters")
    if not token.startswith(TOKEN_PREFIX) or token.count(".") != 2:
        raise CredentialError("not an OpenForge rollout token")
    body, _, signature = token.rpartition(".")
    given = signature.encode(errors="replace")
    # Compared as text, not decoded: base64 decoding skips stray characters and takes '+' for
    # '-', so one token would have endless spellings that all verify, each a new entry in the
    # proxy's cache of verified tokens.
    if not any(hmac.compare_digest(_b64(hmac.new(one, body.encode(), hashlib.sha256).digest()).encode(), given)
               for one in keys):
        raise CredentialError("token signature does not match")
    try:
        credential = Credential.model_validate(orjson.loads(_unb64(body[len(TOKEN_PREFIX):])))
    except (ValueError, ValidationError) as exc:
        raise CredentialError("malformed token claims") from exc
    if credential.expires_at < (now or time.time()):
        raise CredentialError("token expired")
    return credential
