"""`openforge token` reads the signing key where the proxy does: the setting, or its file."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from proxy.cli import token_command
from schemas.credentials import Role, verify_token

KEY = b"k" * 32


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in ("OPENFORGE_PROXY_CREDENTIAL_KEY", "OPENFORGE_PROXY_CREDENTIAL_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()


def test_a_key_in_a_file_mints_a_token_the_proxy_accepts(runner: CliRunner, tmp_path: Path) -> None:
    """Before, only the key's variable was read: with the key mounted as a file, as the chart
    mounts it, the command failed for want of --key."""
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    for args, env in ((["--key-file", str(key_file)], {}), ([], {"OPENFORGE_PROXY_CREDENTIAL_KEY_FILE": str(key_file)}),
                      ([], {"OPENFORGE_PROXY_CREDENTIAL_KEY": "", "OPENFORGE_PROXY_CREDENTIAL_KEY_FILE": str(key_file)})):
        result = runner.invoke(token_command, ["r-1", "--role", "verifier", *args], env=env)
        assert result.exit_code == 0, result.output
        credential = verify_token((KEY,), result.output.strip())
        assert (credential.rollout_id, credential.role) == ("r-1", Role.VERIFIER)


def test_no_key_or_an_unreadable_file_is_said_plainly(runner: CliRunner, tmp_path: Path) -> None:
    missing = runner.invoke(token_command, ["r-1"])
    assert missing.exit_code == 1 and "no signing key: pass --key or --key-file" in missing.output
    unreadable = runner.invoke(token_command, ["r-1", "--key-file", str(tmp_path / "absent")])
    assert unreadable.exit_code == 1 and "the key file cannot be read" in unreadable.output
