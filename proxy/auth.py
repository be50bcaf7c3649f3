"""Who may call: per-rollout bearer tokens, verified without state."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from fastapi import Request

from proxy.errors import ProxyError
from proxy.settings import ProxySettings
from schemas.credentials import MIN_KEY_BYTES, TOKEN_PREFIX, Credential, CredentialError, Role, verify_token

logger = logging.getLogger(__name__)

#: Verified tokens remembered at most (one per live rollout is typical).
_VERIFIED_CACHE_SIZE = 100_000

#: Header a harness may use to name its rollout when the path does not.
ROLLOUT_HEADER = "x-openforge-rollout-id"


class UnauthorizedError(ProxyError):
    """Missing, forged, expired or mismatched credential (401)."""

    status_code = 401
    error_type = "authentication_error"
    headers = {"www-authenticate": 'Bearer realm="openforge"'}  # HTTP asks a 401 to name its scheme


class ForbiddenError(ProxyError):
    """A valid credential asking for something its role may not do (403)."""

    status_code = 403
    error_type = "permission_error"


def _offered(request: Request) -> Iterator[str]:
    """The tokens the request offers, ``Authorization: Bearer`` first, then ``x-api-key``.

    Both may be looked at: a gateway, an OAuth helper or a harness's own settings may put
    something that is not a rollout token in one of them while the rollout's token is in the
    other. Lazily, so a call whose first token holds does not read the second header.
    """
    header = request.headers.get("authorization")
    bearer = header[7:].strip() if header and header.lower().startswith("bearer ") else ""
    if bearer:
        yield bearer
    key = request.headers.get("x-api-key")
    if key and key != bearer:
        yield key


class Authenticator:
    """Checks a request's credential against the rollout it addresses."""

    def __init__(self, settings: ProxySettings) -> None:
        self.key = settings.signing_key()
        self.allow_anonymous = settings.allow_anonymous
        self._verified: dict[str, Credential] = {}
        """Tokens whose signature checked out, by the whole token (signature included): a
        harness sends the same token on every call, and the HMAC plus claims parsing were a
        visible share of a proxied call's CPU. Expiry is still checked on every call."""
        if self.key is None and not self.allow_anonymous:
            raise ValueError(
                "set OPENFORGE_PROXY_CREDENTIAL_KEY (or _FILE), or allow anonymous calls explicitly"
            )
        if self.key is not None and self.allow_anonymous:
            # With a key, tokens are what keeps one rollout's agent out of another's training
            # data; a call that could simply leave its token out would get around that.
            raise ValueError("allow_anonymous is for a proxy without a credential key (one machine, no "
                             "rewards); unset OPENFORGE_PROXY_ALLOW_ANONYMOUS or the key")
        if self.key is not None and len(self.key) < MIN_KEY_BYTES:
            # Refused here, at start-up: later, every call would fail with a 500 while /health said ok.
            raise ValueError(f"the credential key (OPENFORGE_PROXY_CREDENTIAL_KEY or _FILE) has {len(self.key)} "
                             f"bytes; it needs at least {MIN_KEY_BYTES}")
        other = settings.other_signing_key()
        if other is not None and self.key is None:
            raise ValueError("OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY (or _FILE) is accepted beside the signing key, "
                             "not instead of it: set OPENFORGE_PROXY_CREDENTIAL_KEY (or _FILE) too")
        if other is not None and len(other) < MIN_KEY_BYTES:
            raise ValueError(f"the other credential key (OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY or _FILE) has "
                             f"{len(other)} bytes; it needs at least {MIN_KEY_BYTES}")
        self.keys: tuple[bytes, ...] = () if self.key is None else (
            (self.key,) if other is None or other == self.key else (self.key, other))
        """The keys a token may be signed with: the signing key, and while it is rotated the other one."""
        if len(self.keys) > 1:
            # A rotation step gone wrong shows only as 401s for running rollouts: the log says which keys are live.
            logger.info("accepting rollout tokens of two signing keys (a key rotation is under way)")

    def authenticate(
        self, request: Request, path_rollout: str | None, *, need: Role | None = None
    ) -> Credential:
        """The caller's verified credential.

        Args:
            request: The request, for its token and rollout header.
            path_rollout: The rollout named in the path, if any.
            need: The role the request needs: the verifier's for a reward, the agent's for a
                model call; None where either may ask (token counts, the model list).

        Raises:
            UnauthorizedError: no valid token, or one for another rollout.
            ForbiddenError: the token's role may not do this (an agent posting a reward, a
                verifier making a model call).
        """
        header_rollout = request.headers.get(ROLLOUT_HEADER)
        if header_rollout is not None and not header_rollout.strip():
            # A harness's template with its variable unset: said as such, not as another rollout.
            raise UnauthorizedError(f"the {ROLLOUT_HEADER} header is empty: send the rollout id, or leave it out")
        if header_rollout is not None and not header_rollout.isascii():
            # HTTP headers arrive as latin-1 text; a client sends a rollout id as UTF-8, as the
            # path (percent-decoded as UTF-8) reads it, so the same id must compare equal either way.
            try:
                header_rollout = header_rollout.encode("latin-1").decode("utf-8")
            except UnicodeError as exc:
                raise UnauthorizedError(f"the {ROLLOUT_HEADER} header is not UTF-8 text") from exc
        if path_rollout is not None and header_rollout is not None and header_rollout != path_rollout:
            # Both are recorded with the call; one of them would be a lie.
            raise UnauthorizedError(f"the {ROLLOUT_HEADER} header names another rollout than the path")
        named = path_rollout or header_rollout
        if self.key is None:
            if not self.allow_anonymous or need is Role.VERIFIER:
                raise UnauthorizedError("a rollout token is required")
            try:
                return Credential.model_validate({"r": named or "anonymous", "role": Role.AGENT, "exp": 2**62})
            except ValueError as exc:  # pydantic's ValidationError: an id too long, empty
                raise UnauthorizedError(f"not a rollout id: {str(named)[:80]!r}") from exc
        refusals = []
        for token in _offered(request):
            verified = self._verify(token)
            if isinstance(verified, Credential):
                credential = verified
                break
            refusals.append((token, verified))
        else:
            if not refusals:
                raise UnauthorizedError("missing credential: send the rollout token as a bearer token or x-api-key")
            # The reason of the first that looks like a rollout token ("expired" says more than
            # "not an OpenForge rollout token" of the gateway's key beside it).
            _, refusal = next(((t, r) for t, r in refusals if t.startswith(TOKEN_PREFIX)), refusals[0])
            raise UnauthorizedError(str(refusal)) from refusal
        if named is not None and named != credential.rollout_id:
            raise UnauthorizedError("the token belongs to another rollout")
        if need is Role.VERIFIER and credential.role is not Role.VERIFIER:
            raise ForbiddenError("only the rollout's verifier may post its reward")
        if need is Role.AGENT and credential.role is not Role.AGENT:
            # A verifier's model calls (an LLM judge) would be recorded as the rollout's calls,
            # and so assembled into the agent's trajectory and trained on.
            raise ForbiddenError("a verifier token posts the rollout's reward; model calls need the agent's "
                                 "token, since every call is recorded as a turn of the agent")
        return credential

    def _verify(self, token: str) -> Credential | CredentialError:
        """The token's credential (remembered once verified), or why it is refused."""
        credential = self._verified.get(token)
        if credential is not None and credential.expires_at >= time.time():
            return credential
        try:
            credential = verify_token(self.keys, token)
        except CredentialError as exc:
            self._verified.pop(token, None)
            return exc
        if len(self._verified) >= _VERIFIED_CACHE_SIZE:
            self._verified.clear()  # crude but bounded; live rollouts re-verify once
        self._verified[token] = credential
        return credential
