import re
from pathlib import Path

import pytest
from rollout_tasks import KEY, make_task

from consumers.rollouts.backend import (
    ENV_AGENT_KEYS,
    ENV_INSTRUCTION,
    ENV_OPENAI_BASE_URL,
    ENV_REWARD_URL,
    ENV_ROLLOUT_ID,
    ENV_VERIFIER_TOKEN,
    harness_argv,
)
from consumers.rollouts.launcher import LauncherSettings, build_spec, proxy_for, rollout_id_for
from consumers.rollouts.local import inherited_environment
from schemas.credentials import Role, verify_token
from schemas.rollout.v1 import Backend
from schemas.task.v1 import TaskV1

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@pytest.mark.parametrize("task_id", ["task-1", "My Task/With Spaces", "---", "ünïcødé", "x" * 256])
def test_rollout_ids_are_deterministic_dns_labels(task_id: str) -> None:
    ids = [rollout_id_for(task_id, i) for i in range(4096)]
    assert ids == [rollout_id_for(task_id, i) for i in range(4096)]
    assert len(set(ids)) == 4096
    assert all(DNS_LABEL.match(i) for i in (ids[0], ids[-1]))


def test_tasks_whose_slugs_collide_get_different_ids() -> None:
    assert rollout_id_for("Task A", 0) != rollout_id_for("task-a", 0)


def test_spec_gives_the_verifier_token_to_the_verifier_only() -> None:
    task = make_task("t")
    spec = build_spec(task, 2, proxy_url="http://proxy:8100/", key=KEY, token_ttl_s=600, backend=Backend.LOCAL)
    assert spec.rollout_id == rollout_id_for("t", 2) == spec.harness_env[ENV_ROLLOUT_ID]
    assert spec.harness_env[ENV_OPENAI_BASE_URL] == f"http://proxy:8100/rollouts/{spec.rollout_id}/v1"
    assert ENV_VERIFIER_TOKEN not in spec.harness_env and ENV_REWARD_URL not in spec.harness_env
    agent = verify_token(KEY, spec.harness_env[ENV_AGENT_KEYS[0]])
    assert {spec.harness_env[k] for k in ENV_AGENT_KEYS} == {spec.harness_env[ENV_AGENT_KEYS[0]]}
    assert (agent.rollout_id, agent.role, agent.task_id) == (spec.rollout_id, Role.AGENT, "t")
    verifier = verify_token(KEY, spec.verifier_env[ENV_VERIFIER_TOKEN])
    assert (verifier.rollout_id, verifier.role) == (spec.rollout_id, Role.VERIFIER)
    assert spec.verifier_env[ENV_REWARD_URL] == f"http://proxy:8100/rollouts/{spec.rollout_id}/reward"
    assert spec.deadline_s == task.timeout_s


def test_a_task_env_cannot_smuggle_verifier_names_into_the_harness() -> None:
    data = make_task("t").model_dump()
    data["harness"]["env"] = {ENV_VERIFIER_TOKEN: "forged", ENV_REWARD_URL: "http://evil", "MY_FLAG": "1"}
    from schemas import TaskV1

    spec = build_spec(TaskV1.model_validate(data), 0, proxy_url="http://p", key=KEY, token_ttl_s=60,
                      backend=Backend.LOCAL)
    assert spec.harness_env["MY_FLAG"] == "1"
    assert ENV_VERIFIER_TOKEN not in spec.harness_env and ENV_REWARD_URL not in spec.harness_env
    assert spec.verifier_env[ENV_VERIFIER_TOKEN] != "forged"


def test_tokens_outlive_a_task_longer_than_the_ttl() -> None:
    task = make_task("t", timeout_s=7200)
    spec = build_spec(task, 0, proxy_url="http://p", key=KEY, token_ttl_s=60, backend=Backend.LOCAL)
    claims = verify_token(KEY, spec.harness_env[ENV_AGENT_KEYS[0]])
    import time

    assert claims.expires_at >= time.time() + 7000


def test_rollout_processes_never_inherit_openforge_variables() -> None:
    env = inherited_environment({"PATH": "/bin", "OPENFORGE_PROXY_CREDENTIAL_KEY": "secret",
                                 "OPENFORGE_LAUNCHER_CREDENTIAL_KEY": "secret", "HOME": "/root"})
    assert env == {"PATH": "/bin", "HOME": "/root"}


def test_launcher_reads_the_proxy_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_PROXY_CREDENTIAL_KEY", KEY.decode())
    assert LauncherSettings().signing_key() == KEY
    monkeypatch.delenv("OPENFORGE_PROXY_CREDENTIAL_KEY")
    with pytest.raises(ValueError, match="OPENFORGE_PROXY_CREDENTIAL_KEY"):
        LauncherSettings().signing_key()


def test_launcher_reads_the_key_file_behind_an_empty_key_variable(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """As the proxy does: an unfilled template's ``KEY=`` returned an empty key, which then failed
    every token minted, though the file beside it held the key."""
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    monkeypatch.setenv("OPENFORGE_PROXY_CREDENTIAL_KEY", "")
    monkeypatch.setenv("OPENFORGE_PROXY_CREDENTIAL_KEY_FILE", str(key_file))
    assert LauncherSettings().signing_key() == KEY
    monkeypatch.setenv("OPENFORGE_PROXY_CREDENTIAL_KEY_FILE", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="the credential key file cannot be read"):
        LauncherSettings().signing_key()


def test_unloadable_kubernetes_backend_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from typing import cast

    from consumers.rollouts.launcher import make_backend
    from stream import EventProducer

    monkeypatch.setitem(sys.modules, "consumers.rollouts.kubernetes", None)  # import fails, as when absent
    settings = LauncherSettings(credential_key=KEY.decode(), backend=Backend.KUBERNETES)
    producer = cast(EventProducer, None)  # never reached: the kubernetes path fails first
    with pytest.raises(ValueError, match="kubernetes backend cannot be loaded.*OPENFORGE_LAUNCHER_BACKEND=local"):
        make_backend(settings, producer)


def test_instruction_reaches_the_harness_by_environment_and_placeholder() -> None:
    task = make_task("t").model_copy(deep=True)
    task = TaskV1.model_validate({**task.model_dump(mode="json"), "instruction": "fix the bug",
                                  "harness": {**task.harness.model_dump(mode="json"),
                                              "launch": {"kind": "local",
                                                         "command": ["agent", "-p", "{instruction}", "{x}"]}}})
    spec = build_spec(task, 0, proxy_url="http://proxy:8100", key=KEY, token_ttl_s=600, backend=Backend.LOCAL)
    assert spec.harness_env[ENV_INSTRUCTION] == "fix the bug"
    assert harness_argv(task) == ["agent", "-p", "fix the bug", "{x}"]


REPLICAS = [f"http://of-proxy-{i}.of-proxy-headless.ns.svc:8100" for i in range(4)]


def test_each_rollout_is_pinned_to_one_proxy_replica_whatever_launcher_asks() -> None:
    """Harness and verifier get the same replica, and the choice depends on the rollout alone, so a
    restarted launcher pins a relaunched rollout where the first one did."""
    settings = LauncherSettings(proxy_url=",".join(REPLICAS) + ",", credential_key="k")
    assert settings.proxy_url == REPLICAS
    chosen = {}
    for index in range(400):
        rollout_id = rollout_id_for("t", index)
        chosen[rollout_id] = proxy_for(rollout_id, settings.proxy_url)
        assert proxy_for(rollout_id, list(reversed(REPLICAS))) == chosen[rollout_id]  # order does not matter
        spec = build_spec(make_task("t"), index, proxy_url=chosen[rollout_id], key=KEY, token_ttl_s=600,
                          backend=Backend.LOCAL)
        assert spec.harness_env[ENV_OPENAI_BASE_URL].startswith(chosen[rollout_id] + "/rollouts/")
        assert spec.verifier_env[ENV_REWARD_URL].startswith(chosen[rollout_id] + "/rollouts/")
    per_replica = [list(chosen.values()).count(url) for url in REPLICAS]
    assert min(per_replica) > 60, per_replica  # spread over every replica (100 each on average)
    # One replica fewer moves only that replica's rollouts.
    moved = [r for r, url in chosen.items() if proxy_for(r, REPLICAS[:3]) != url]
    assert moved and all(chosen[r] == REPLICAS[3] for r in moved)


@pytest.mark.parametrize(("value", "says"), [("proxy:8100", "must start with http"),
                                             ("http://a,http://b,http://a/", "listed twice"),
                                             (" , ", "at least 1")])
def test_bad_proxy_url_lists_are_refused_by_name(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LauncherSettings(proxy_url=value, credential_key="k")
