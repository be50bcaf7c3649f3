"""The authenticator remembers verified tokens, yet still refuses expired and forged ones."""

from __future__ import annotations

import time

import pytest
from starlette.requests import Request

from proxy.auth import Authenticator, UnauthorizedError
from proxy.settings import ProxySettings
from schemas.credentials import Role, mint_token

KEY = "k" * 32


def _request(token: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": [(b"authorization", f"Bearer {token}".encode())]})


def test_cached_token_still_expires() -> None:
    auth = Authenticator(ProxySettings(credential_key=KEY))
    now = time.time()
    expires = int(now) + 2  # claims hold whole seconds
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, expires - now + 0.001, now=now)
    assert auth.authenticate(_request(token), "r-1").rollout_id == "r-1"
    assert auth.authenticate(_request(token), None).rollout_id == "r-1"  # from the cache
    time.sleep(expires - time.time() + 0.05)
    with pytest.raises(UnauthorizedError, match="expired"):
        auth.authenticate(_request(token), "r-1")


def test_cache_does_not_admit_a_forged_signature_or_another_rollout() -> None:
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, 60.0)
    auth.authenticate(_request(token), "r-1")
    body, _, signature = token.rpartition(".")
    forged = f"{body}.{'A' * len(signature)}"
    with pytest.raises(UnauthorizedError, match="signature"):
        auth.authenticate(_request(forged), "r-1")
    with pytest.raises(UnauthorizedError, match="another rollout"):
        auth.authenticate(_request(token), "r-2")
    other = mint_token(("x" * 32).encode(), "r-1", Role.AGENT, 60.0)
    with pytest.raises(UnauthorizedError):
        auth.authenticate(_request(other), "r-1")


def test_a_token_has_one_spelling_only() -> None:
    """Base64 decoding would skip stray characters and take '+' for '-': every respelling of a
    valid token would verify, and each would be a new entry in the cache of verified tokens."""
    auth = Authenticator(ProxySettings(credential_key=KEY))
    tokens = [mint_token(KEY.encode(), f"r-{i}", Role.AGENT, 60.0) for i in range(200)]
    token = next(t for t in tokens if "-" in t.rpartition(".")[2] or "_" in t.rpartition(".")[2])
    body, _, signature = token.rpartition(".")
    respelled = [
        f"{body}.{signature}=",  # padding
        f"{body}.{signature[:5]}!{signature[5:]}",  # a character outside the alphabet
        f"{body}.{signature.replace('-', '+').replace('_', '/')}",  # the other alphabet
    ]
    rollout = auth.authenticate(_request(token), None).rollout_id
    cached = len(auth._verified)
    for variant in respelled:
        assert variant != token
        with pytest.raises(UnauthorizedError, match="signature"):
            auth.authenticate(_request(variant), rollout)
    assert len(auth._verified) == cached == 1


def test_an_overlong_token_is_refused_unread() -> None:
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, 60.0)
    body, _, signature = token.rpartition(".")
    with pytest.raises(UnauthorizedError, match="longer than"):
        auth.authenticate(_request(f"{body}.{signature}{'A' * 10_000}"), "r-1")
    with pytest.raises(ValueError, match="task_id"):  # claims that long are refused before
        mint_token(KEY.encode(), "r-1", Role.AGENT, 60.0, task_id="t" * 5000)


def test_a_short_key_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        Authenticator(ProxySettings(credential_key="short-key"))


def test_anonymous_calls_are_refused_with_a_key_and_bounded_without_one() -> None:
    # With a key, an agent could leave its token out and write into any rollout.
    with pytest.raises(ValueError, match="allow_anonymous"):
        Authenticator(ProxySettings(credential_key=KEY, allow_anonymous=True))
    anonymous = Authenticator(ProxySettings(allow_anonymous=True))
    bare = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []})
    assert anonymous.authenticate(bare, "r-1").rollout_id == "r-1"
    with pytest.raises(UnauthorizedError, match="not a rollout id"):  # before, a 500
        anonymous.authenticate(bare, "r" * 300)
    with pytest.raises(UnauthorizedError, match="token is required"):
        anonymous.authenticate(bare, "r-1", need=Role.VERIFIER)


def test_a_rollout_header_that_disagrees_with_the_path_is_refused() -> None:
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, 60)
    both = Request({"type": "http", "method": "POST", "path": "/rollouts/r-1/v1/chat/completions",
                    "headers": [(b"authorization", f"Bearer {token}".encode()),
                                (b"x-openforge-rollout-id", b"victim")]})
    with pytest.raises(UnauthorizedError, match="another rollout than the path"):
        auth.authenticate(both, "r-1")
    header_only = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                           "headers": [(b"authorization", f"Bearer {token}".encode()),
                                       (b"x-openforge-rollout-id", b"victim")]})
    with pytest.raises(UnauthorizedError, match="another rollout"):
        auth.authenticate(header_only, None)


@pytest.mark.parametrize("ttl_s", [0.0, -60.0, float("inf"), float("nan")])
def test_a_token_lifetime_must_be_a_positive_number_of_seconds(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        mint_token(KEY.encode(), "r-1", Role.AGENT, ttl_s)


@pytest.mark.parametrize(("rollout_id", "task_id", "named"), [
    ("", None, "rollout_id"), ("r" * 201, None, "rollout_id"), ("a/b", None, "rollout_id"),
    (".", None, "rollout_id"), ("..", None, "rollout_id"),  # URLs resolve these away
    ("r-1", "", "task_id"), ("r-1", "t" * 257, "task_id"),
])
def test_claims_the_proxy_would_refuse_are_refused_when_minted(rollout_id: str, task_id: str | None,
                                                              named: str) -> None:
    # Minted, such a token would fail every call (401) or every reward (400) of its rollout.
    with pytest.raises(ValueError, match=f"refused by the proxy: {named}"):
        mint_token(KEY.encode(), rollout_id, Role.AGENT, 60, task_id=task_id)


def test_a_lifetime_past_a_century_is_refused_as_a_value_error() -> None:
    with pytest.raises(ValueError, match="up to 3,153,600,000"):  # before, a TypeError from the encoder
        mint_token(KEY.encode(), "r-1", Role.AGENT, 1e20)


def test_a_utf8_rollout_header_names_the_same_rollout_as_the_path() -> None:
    # Headers arrive as latin-1 text, the path as UTF-8: the same id must match either way.
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-é", Role.AGENT, 60)
    headers = [(b"authorization", f"Bearer {token}".encode()), (b"x-openforge-rollout-id", "r-é".encode())]
    by_header = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers})
    assert auth.authenticate(by_header, None).rollout_id == "r-é"
    assert auth.authenticate(by_header, "r-é").rollout_id == "r-é"  # and agrees with the path
    garbled = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [headers[0], (b"x-openforge-rollout-id", b"r-\xe9")]})
    with pytest.raises(UnauthorizedError, match="not UTF-8"):
        auth.authenticate(garbled, None)


def test_an_unreadable_key_file_is_a_clear_error_and_an_empty_key_does_not_hide_it(tmp_path) -> None:
    with pytest.raises(ValueError, match="key file .* cannot be read: No such file"):
        Authenticator(ProxySettings(credential_key_file=tmp_path / "missing"))
    (tmp_path / "key").write_text(KEY + "\n")
    auth = Authenticator(ProxySettings(credential_key="", credential_key_file=tmp_path / "key"))
    assert auth.key == KEY.encode()


def test_a_401_names_its_scheme() -> None:
    assert UnauthorizedError("no").headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("path_rollout", [None, "r-1"])
def test_an_empty_rollout_header_is_named_as_such(path_rollout: str | None) -> None:
    # A harness's header template with its variable unset; before, "another rollout" (or, with
    # the path's rollout, "names another rollout than the path") sent the operator looking elsewhere.
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, 60.0)
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [(b"authorization", f"Bearer {token}".encode()), (b"x-openforge-rollout-id", b" ")]})
    with pytest.raises(UnauthorizedError, match="header is empty"):
        auth.authenticate(request, path_rollout)


def test_while_the_key_is_rotated_tokens_of_both_keys_are_accepted(tmp_path) -> None:
    new, old, stranger = KEY, "o" * 32, "s" * 32
    auth = Authenticator(ProxySettings(credential_key=new, credential_other_key=old))
    for key in (new, old):
        token = mint_token(key.encode(), "r-1", Role.AGENT, 60.0)
        assert auth.authenticate(_request(token), "r-1").rollout_id == "r-1"
    with pytest.raises(UnauthorizedError, match="signature"):
        auth.authenticate(_request(mint_token(stranger.encode(), "r-1", Role.AGENT, 60.0)), "r-1")
    # Dropping the other key ends its tokens: a proxy started without it refuses them.
    after = Authenticator(ProxySettings(credential_key=new))
    with pytest.raises(UnauthorizedError, match="signature"):
        after.authenticate(_request(mint_token(old.encode(), "r-1", Role.AGENT, 60.0)), "r-1")
    # From a file, as a mounted Secret gives it; a Secret without it (no rotation under way) gives none.
    other_file = tmp_path / "other-signing-key"
    other_file.write_text(old + "\n")
    from_file = Authenticator(ProxySettings(credential_key=new, credential_other_key_file=other_file))
    assert from_file.authenticate(_request(mint_token(old.encode(), "r-2", Role.AGENT, 60.0)), "r-2")
    assert Authenticator(ProxySettings(credential_key=new,
                                       credential_other_key_file=tmp_path / "absent")).keys == (new.encode(),)
    other_file.write_text("")
    assert Authenticator(ProxySettings(credential_key=new, credential_other_key_file=other_file)).keys == (
        new.encode(),)


@pytest.mark.parametrize(("settings", "message"), [
    ({"credential_other_key": "o" * 32, "allow_anonymous": True}, "beside the signing key"),
    ({"credential_key": KEY, "credential_other_key": "short"}, "other credential key .* has 5 bytes"),
])
def test_an_other_key_that_cannot_work_is_refused_at_start(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Authenticator(ProxySettings(**settings))


def test_an_unreadable_other_key_file_is_refused_at_start(tmp_path) -> None:
    with pytest.raises(ValueError, match="other credential key file .* cannot be read"):
        Authenticator(ProxySettings(credential_key=KEY, credential_other_key_file=tmp_path))  # a directory


def _both(bearer: str, api_key: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/messages",
                    "headers": [(b"authorization", f"Bearer {bearer}".encode()), (b"x-api-key", api_key.encode())]})


def test_a_rollout_token_in_x_api_key_is_found_behind_another_bearer_token() -> None:
    """A gateway or a harness's own setting put something else in ``Authorization: Bearer``;
    the rollout's token in ``x-api-key`` was never looked at (401 "not an OpenForge rollout
    token"), though the same key beside ``Authorization: Basic`` was accepted."""
    auth = Authenticator(ProxySettings(credential_key=KEY))
    token = mint_token(KEY.encode(), "r-1", Role.AGENT, 60.0)
    assert auth.authenticate(_both("dummy", token), "r-1").rollout_id == "r-1"
    assert auth.authenticate(_both(token, "dummy"), "r-1").rollout_id == "r-1"
    # Each is verified in full: two tokens that are not rollout tokens are refused with the first's reason.
    other_key = mint_token(("x" * 32).encode(), "r-1", Role.AGENT, 60.0)
    with pytest.raises(UnauthorizedError, match="signature"):
        auth.authenticate(_both(other_key, "dummy"), "r-1")
    # Offering a second token gains nothing: another rollout's is still another rollout's.
    with pytest.raises(UnauthorizedError, match="another rollout"):
        auth.authenticate(_both("dummy", mint_token(KEY.encode(), "r-2", Role.AGENT, 60.0)), "r-1")


def test_when_neither_header_holds_a_valid_token_the_rollout_tokens_reason_is_given() -> None:
    """A gateway's key in Authorization and an expired rollout token in x-api-key: "expired" is
    what the operator needs to read, not "not an OpenForge rollout token"."""
    auth = Authenticator(ProxySettings(credential_key=KEY))
    expired = mint_token(KEY.encode(), "r-1", Role.AGENT, 5, now=time.time() - 10)
    with pytest.raises(UnauthorizedError, match="expired"):
        auth.authenticate(_both("sk-gateway-key", expired), "r-1")
