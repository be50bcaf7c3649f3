"""The chart lints, renders and validates offline (strict) for its defaults and every switch combination."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from helm_chart import CHART, KUBE_VERSION, NAMESPACE, Combo, Helm, env_of, find, one, process, workloads

from stream.topics import ALL_TOPICS

STRIMZI_GROUP = "kafka.strimzi.io/"


def test_lint_defaults(helm: Helm, helm_tmp: Path) -> None:
    proc = helm.lint(None, helm_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_lint_combination(helm: Helm, helm_tmp: Path, combo: Combo) -> None:
    proc = helm.lint(combo.values, helm_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _validate_strict(objects: list[dict[str, Any]]) -> int:
    checked = 0
    for obj in objects:
        if obj["apiVersion"].startswith(STRIMZI_GROUP):
            continue  # custom resources: checked against Strimzi's CRDs in test_chart_strimzi.py
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")
        checked += 1
    return checked


def test_defaults_validate_strict(default_objects: list[dict[str, Any]]) -> None:
    assert _validate_strict(default_objects) >= 25


def test_combination_validates_strict(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    objects = rendered[combo.name]
    assert _validate_strict(objects) >= 20
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"


def test_strict_validation_catches_an_unknown_field(default_objects: list[dict[str, Any]]) -> None:
    """Guards the validator itself: a misspelt field must fail, or the tests above prove nothing."""
    deployment = dict(one(default_objects, "Deployment", "-launcher"))
    broken = {**deployment, "spec": {**deployment["spec"], "replicaz": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


def test_kafka_switch(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    objects = rendered[combo.name]
    env = env_of(one(objects, "StatefulSet", "-proxy"))
    strimzi = [o for o in objects if o["apiVersion"].startswith(STRIMZI_GROUP)]
    if combo.kafka == "strimzi":
        assert env["OPENFORGE_KAFKA_BOOTSTRAP_SERVERS"] == "of-openforge-kafka-kafka-bootstrap:9092"
        assert {o["kind"] for o in strimzi} == {"Kafka", "KafkaNodePool", "KafkaTopic"}
    else:
        assert env["OPENFORGE_KAFKA_BOOTSTRAP_SERVERS"] == "kafka-0.example:9092,kafka-1.example:9092"
        assert strimzi == []


def test_otel_switch(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    objects = rendered[combo.name]
    collector = find(objects, "Deployment", "-otel-collector")
    for deployment in find(objects, "Deployment"):
        if deployment in collector:
            continue
        env = env_of(deployment)
        expected = ("http://of-openforge-otel-collector:4318" if combo.otel == "collector"
                    else "http://otel.monitoring:4318")
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == expected, deployment["metadata"]["name"]
        assert env["OTEL_SERVICE_NAME"].startswith("openforge-")
    assert len(collector) == (1 if combo.otel == "collector" else 0)


def test_otel_off_entirely(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"otel": {"collector": {"enabled": False}, "endpoint": ""}}, helm_tmp)
    env = env_of(one(objects, "StatefulSet", "-proxy"))
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert env["OTEL_METRICS_EXPORTER"] == "none"


def test_learner_switch(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    learner = one(rendered[combo.name], "Deployment", "-learner")
    resources = learner["spec"]["template"]["spec"]["containers"][0]["resources"]
    env = env_of(learner)
    container = learner["spec"]["template"]["spec"]["containers"][0]
    if combo.learner == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == "8"
        assert resources["requests"]["nvidia.com/gpu"] == "8"
        assert env["OPENFORGE_LEARNER_DEVICE"] == "cuda"
        # Eight GPUs, eight ranks: torchrun runs the openforge learner once per GPU, sharded.
        assert container["command"] == ["python", "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", "8", "-m", "openforge"]
        assert container["args"] == ["learner"] and env["OPENFORGE_LEARNER_ENGINE"] == "fsdp"
    else:
        assert "nvidia.com/gpu" not in resources["limits"]
        assert env["OPENFORGE_LEARNER_DEVICE"] == "cpu"
        assert "command" not in container and env["OPENFORGE_LEARNER_ENGINE"] == "hf"
    assert learner["spec"]["strategy"]["type"] == "Recreate"


def test_one_gpu_runs_one_plain_learner_process(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"learner": {"gpu": {"count": 1}}}, helm_tmp)
    learner = one(objects, "Deployment", "-learner")
    assert "command" not in learner["spec"]["template"]["spec"]["containers"][0]
    assert env_of(learner)["OPENFORGE_LEARNER_ENGINE"] == "hf"


def test_every_process_has_a_deployment(default_objects: list[dict[str, Any]]) -> None:
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        deployment = process(default_objects, name)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["args"] == [name]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > 0
        env = env_of(deployment)
        assert env["OPENFORGE_KAFKA_BOOTSTRAP_SERVERS"]
        # Read-only root filesystem: home and caches live on the /tmp emptyDir.
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert env["HOME"] == "/tmp" and env["XDG_CACHE_HOME"].startswith("/tmp/")
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_the_proxy_readiness_probe_waits_longer_than_its_engine_check(default_objects: list[dict[str, Any]]) -> None:
    # /ready asks the engines with a 2 s timeout; Kubernetes' default probe timeout is 1 s.
    container = one(default_objects, "StatefulSet", "-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["timeoutSeconds"] > 2


def test_each_rollout_is_pinned_to_one_proxy_replica_at_its_own_address(
        default_objects: list[dict[str, Any]], helm: Helm, helm_tmp: Path) -> None:
    """The proxy is a StatefulSet of a fixed size behind a headless Service, and the launcher gets
    every replica's own address: it pins each rollout to one, so the rollout's calls and its
    reward meet in one replica (no autoscaler could remove a replica under pinned rollouts)."""
    proxy = one(default_objects, "StatefulSet", "-proxy")
    spec = proxy["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert find(default_objects, "Deployment", "-proxy") == []
    assert find(default_objects, "HorizontalPodAutoscaler") == []
    headless = one(default_objects, "Service", "-proxy-headless")
    assert spec["serviceName"] == headless["metadata"]["name"] and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert headless["spec"]["publishNotReadyAddresses"] is True
    launcher = env_of(one(default_objects, "Deployment", "-launcher"))
    assert launcher["OPENFORGE_LAUNCHER_PROXY_URL"] == (
        "http://of-openforge-proxy-0.of-openforge-proxy-headless.openforge.svc:8100,"
        "http://of-openforge-proxy-1.of-openforge-proxy-headless.openforge.svc:8100")
    three = helm.render({"proxy": {"replicas": 3}}, helm_tmp)
    assert one(three, "StatefulSet", "-proxy")["spec"]["replicas"] == 3
    assert env_of(one(three, "Deployment", "-launcher"))["OPENFORGE_LAUNCHER_PROXY_URL"].count(",") == 2
    with pytest.raises(RuntimeError, match="autoscaling"):
        helm.render({"proxy": {"autoscaling": {"enabled": True}}}, helm_tmp)


def test_proxy_spool_on_claims_outlives_its_pods(default_objects: list[dict[str, Any]], helm: Helm,
                                                helm_tmp: Path) -> None:
    """By default the spool is an emptyDir; on claims, each proxy replica keeps its own through
    deletion and scale-in."""
    spool = next(v for v in one(default_objects, "StatefulSet", "-proxy")["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "spool")
    assert spool == {"name": "spool", "emptyDir": {"sizeLimit": "2Gi"}}
    assert "volumeClaimTemplates" not in one(default_objects, "StatefulSet", "-proxy")["spec"]
    kept = helm.render({"proxy": {"spoolVolume": "persistentVolumeClaim", "spoolSizeLimit": "5Gi",
                                  "spoolStorageClassName": "fast-ssd", "replicas": 3}}, helm_tmp)
    proxy = one(kept, "StatefulSet", "-proxy")
    spec = proxy["spec"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert spec["podManagementPolicy"] == "Parallel" and spec["replicas"] == 3
    assert spec["volumeClaimTemplates"] == [{"metadata": {"name": "spool"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "fast-ssd"}}]
    pod = spec["template"]["spec"]
    assert "spool" not in {v["name"] for v in pod["volumes"]}
    assert {"name": "spool", "mountPath": "/var/spool/openforge"} in pod["containers"][0]["volumeMounts"]
    assert env_of(proxy)["OPENFORGE_PROXY_SPOOL_DIR"] == "/var/spool/openforge"
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    fixed = helm.render({"proxy": {"spoolVolume": "persistentVolumeClaim"}}, helm_tmp)
    assert "storageClassName" not in one(fixed, "StatefulSet", "-proxy")["spec"]["volumeClaimTemplates"][0]["spec"]


@pytest.mark.parametrize(("size", "bound"), [("2Gi", 2 * 2**30 - 2**29), ("1Gi", 2**29), ("3Ti", 3 * 2**40 - 2**29)])
def test_the_proxy_refuses_work_before_its_spool_volume_fills(helm: Helm, helm_tmp: Path, size: str,
                                                              bound: int) -> None:
    """The proxy answers 503 at its spool bound; the volume must not fill first (a full emptyDir
    gets the pod evicted with what it held): the bound is the volume less 512 MiB."""
    for volume in ("emptyDir", "persistentVolumeClaim"):
        objects = helm.render({"proxy": {"spoolSizeLimit": size, "spoolVolume": volume}}, helm_tmp)
        proxy = one(objects, "StatefulSet", "-proxy")
        assert env_of(proxy)["OPENFORGE_PROXY_SPOOL_MAX_BYTES"] == str(bound)


def test_vllm_replicas_have_the_rl_endpoints(default_objects: list[dict[str, Any]]) -> None:
    vllm = one(default_objects, "StatefulSet", "-vllm")
    container = vllm["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("vllm/vllm-openai:")
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]
    for flag in ("--enable-auto-tool-choice", "--enable-scale-out", "--logprobs-mode=processed_logprobs",
                 "--tool-call-parser=hermes", "--served-model-name=policy"):
        assert flag in container["args"]
    upstreams = "http://of-openforge-vllm-0.of-openforge-vllm-headless.openforge.svc:8000," \
                "http://of-openforge-vllm-1.of-openforge-vllm-headless.openforge.svc:8000"
    assert env_of(one(default_objects, "StatefulSet", "-proxy"))["OPENFORGE_PROXY_UPSTREAMS"] == upstreams
    assert env_of(one(default_objects, "Deployment", "-publisher"))["OPENFORGE_PUBLISHER_REPLICAS"] == upstreams


def test_credentials_secret_is_mounted_where_tokens_are_signed(default_objects: list[dict[str, Any]]) -> None:
    secret = one(default_objects, "Secret", "-credentials")
    assert set(secret["data"]) == {"signing-key"}
    for name in ("proxy", "launcher"):
        spec = process(default_objects, name)["spec"]["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "credentials")
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    for name in ("assembler", "learner", "publisher", "watcher"):
        spec = process(default_objects, name)["spec"]["template"]["spec"]
        assert all(v["name"] != "credentials" for v in spec["volumes"]), name


def test_given_signing_key_is_used(helm: Helm, helm_tmp: Path) -> None:
    import base64
    objects = helm.render({"credentials": {"signingKey": "0123456789abcdef-given"}}, helm_tmp)
    data = one(objects, "Secret", "-credentials")["data"]["signing-key"]
    assert base64.b64decode(data) == b"0123456789abcdef-given"


def test_during_a_key_rotation_the_proxy_alone_reads_the_other_key(helm: Helm, helm_tmp: Path,
                                                                   tmp_path: Path) -> None:
    import base64

    from proxy.auth import Authenticator
    from proxy.settings import ProxySettings
    from schemas.credentials import Role, mint_token, verify_token

    new, old = "0123456789abcdef-new", "0123456789abcdef-old"
    objects = helm.render({"credentials": {"signingKey": new, "otherSigningKey": old}}, helm_tmp)
    data = one(objects, "Secret", "-credentials")["data"]
    assert {name: base64.b64decode(value).decode() for name, value in data.items()} == {
        "signing-key": new, "other-signing-key": old}
    proxy = one(objects, "StatefulSet", "-proxy")["spec"]["template"]["spec"]
    mount = next(m for m in proxy["containers"][0]["volumeMounts"] if m["name"] == "credentials")
    env = env_of(one(objects, "StatefulSet", "-proxy"))
    # The files the Secret's volume holds, where the proxy's settings look for them.
    mounted = tmp_path / "credentials"
    mounted.mkdir()
    files = {}
    for name in ("OPENFORGE_PROXY_CREDENTIAL_KEY_FILE", "OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY_FILE"):
        path = Path(env[name])
        assert path.parent == Path(mount["mountPath"])
        (mounted / path.name).write_bytes(base64.b64decode(data[path.name]))
        files[name] = mounted / path.name
    auth = Authenticator(ProxySettings(credential_key_file=files["OPENFORGE_PROXY_CREDENTIAL_KEY_FILE"],
                                       credential_other_key_file=files["OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY_FILE"]))
    assert auth.keys == (new.encode(), old.encode())
    for key in (new, old):
        assert verify_token(auth.keys, mint_token(key.encode(), "r-1", Role.AGENT, 60.0)).rollout_id == "r-1"
    # The launcher signs with the one key only.
    launcher = env_of(one(objects, "Deployment", "-launcher"))
    assert launcher["OPENFORGE_LAUNCHER_CREDENTIAL_KEY_FILE"].endswith("/signing-key")
    assert not any("OTHER" in name for name in launcher)
    # Without a rotation under way, the Secret has no other key and the proxy reads none.
    plain_objects = helm.render({"credentials": {"signingKey": new}}, helm_tmp)
    assert set(one(plain_objects, "Secret", "-credentials")["data"]) == {"signing-key"}
    # Each step restarts the processes that read the keys, and only those (the learner would stop training).
    def restarted(rendered: list[dict[str, Any]]) -> set[str]:
        return {d["metadata"]["name"].rsplit("-", 1)[-1] for d in workloads(rendered)
                if "checksum/credentials" in (d["spec"]["template"]["metadata"].get("annotations") or {})}

    def checksums(rendered: list[dict[str, Any]]) -> dict[str, str]:
        return {d["metadata"]["name"]: (d["spec"]["template"]["metadata"].get("annotations") or {}).get(
            "checksum/credentials", "") for d in workloads(rendered)}

    assert restarted(objects) == {"proxy", "launcher"}
    changed = {name for name, value in checksums(objects).items() if checksums(plain_objects)[name] != value}
    assert {name.rsplit("-", 1)[-1] for name in changed} == {"proxy", "launcher"}


def test_existing_secret_is_referenced_not_created(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"credentials": {"existingSecret": "my-keys"}}, helm_tmp)
    assert find(objects, "Secret") == []
    spec = one(objects, "StatefulSet", "-proxy")["spec"]["template"]["spec"]
    assert {"name": "credentials", "secret": {"secretName": "my-keys", "defaultMode": 0o440}} in spec["volumes"]


def test_least_privilege_rbac(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"rollouts": {"namespace": "rollouts", "createNamespace": True}}, helm_tmp)
    assert find(objects, "ClusterRole") == [] and find(objects, "ClusterRoleBinding") == []
    launcher = one(objects, "Role", "-launcher")
    assert launcher["metadata"]["namespace"] == "rollouts"
    assert launcher["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                  "verbs": ["create", "delete", "get", "list", "watch"]}]
    watcher = one(objects, "Role", "-watcher")
    assert watcher["metadata"]["namespace"] == "rollouts"
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in watcher["rules"])
    binding = one(objects, "RoleBinding", "-launcher")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "of-openforge-launcher", "namespace": NAMESPACE}]
    assert one(objects, "Namespace", "rollouts")
    for deployment in find(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        talks_to_api = deployment["metadata"]["name"].endswith(("-launcher", "-watcher"))
        assert spec["automountServiceAccountToken"] is talks_to_api, deployment["metadata"]["name"]
    assert env_of(one(objects, "Deployment", "-launcher"))["OPENFORGE_KUBE_NAMESPACE"] == "rollouts"


def test_rollout_pods_reach_only_the_proxy(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"rollouts": {"namespace": "rollouts"}}, helm_tmp)
    egress = one(objects, "NetworkPolicy", "-rollout-egress")
    assert egress["metadata"]["namespace"] == "rollouts"
    assert egress["spec"]["policyTypes"] == ["Egress"]
    assert egress["spec"]["podSelector"] == {"matchExpressions": [{"key": "openforge.dev/rollout", "operator": "Exists"}]}
    rules = egress["spec"]["egress"]
    assert len(rules) == 2
    proxy_rule, dns_rule = rules
    assert proxy_rule["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "proxy"
    assert proxy_rule["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert proxy_rule["ports"] == [{"port": 8100, "protocol": "TCP"}]
    assert {p["port"] for p in dns_rule["ports"]} == {53}
    # Stack pods take traffic from stack pods only; rollout pods never carry the stack label.
    stack = one(objects, "NetworkPolicy", "-stack-ingress")
    assert stack["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"openforge.io/stack": "of"}}}]}]
    into_proxy = one(objects, "NetworkPolicy", "-proxy-from-rollouts")["spec"]["ingress"][0]["from"][0]
    assert into_proxy["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "rollouts"}}
    vllm = one(objects, "NetworkPolicy", "-vllm-ingress")["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert vllm["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["proxy", "publisher"]}]
    kafka = one(objects, "Kafka", "-kafka")["spec"]["kafka"]["listeners"][0]
    assert kafka["networkPolicyPeers"] == [{"podSelector": {"matchLabels": {"openforge.io/stack": "of"}}}]
    for workload in find(objects, "Deployment") + find(objects, "StatefulSet"):
        assert workload["spec"]["template"]["metadata"]["labels"]["openforge.io/stack"] == "of"


def test_checkpoints_on_a_read_write_many_claim(default_objects: list[dict[str, Any]]) -> None:
    claim = one(default_objects, "PersistentVolumeClaim", "-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = {}
    for kind, name in (("Deployment", "-learner"), ("Deployment", "-publisher"), ("StatefulSet", "-vllm")):
        spec = one(default_objects, kind, name)["spec"]["template"]["spec"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in spec["volumes"]
        mounts[name] = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "checkpoints")
    assert mounts["-learner"]["readOnly"] is False
    assert mounts["-publisher"]["readOnly"] is True and mounts["-vllm"]["readOnly"] is True


def test_checkpoints_in_an_object_store_are_refused_until_a_process_reads_them(helm: Helm, helm_tmp: Path) -> None:
    proc = helm.template({"checkpoints": {"storage": "objectStore",
                                          "objectStore": {"url": "s3://bucket/run1", "credentialsSecret": "s3"}}},
                         helm_tmp)
    assert proc.returncode != 0
    assert "checkpoints.storage=objectStore is not supported yet" in proc.stderr


def test_helm_test_hook_checks_proxy_health(default_objects: list[dict[str, Any]]) -> None:
    pod = one(default_objects, "Pod", "-test-proxy-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    assert "http://of-openforge-proxy:8100" in script and '"/health"' in script


def test_extra_env_overrides_by_name(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"assembler": {"extraEnv": {"OPENFORGE_ASSEMBLER_GROUP_ID": "mine", "EXTRA": 1}}}, helm_tmp)
    env = env_of(one(objects, "Deployment", "-assembler"))
    assert env["OPENFORGE_ASSEMBLER_GROUP_ID"] == "mine"
    assert env["EXTRA"] == "1"


def test_topic_prefix_reaches_topics_and_processes(helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"kafka": {"topicPrefix": "exp42."}}, helm_tmp)
    names = {t["spec"]["topicName"] for t in find(objects, "KafkaTopic")}
    assert names == {"exp42." + spec.base_name for spec in ALL_TOPICS}
    assert env_of(one(objects, "Deployment", "-assembler"))["OPENFORGE_KAFKA_TOPIC_PREFIX"] == "exp42."


_SECURED_KAFKA = {"kafka": {"mode": "external", "bootstrapServers": "kafka.example:9093", "security": {
    "protocol": "SASL_SSL", "saslMechanism": "SCRAM-SHA-512", "credentialsSecret": "kafka-user",
    "tlsSecret": "kafka-tls", "clientCertificate": True}}}


def test_kafka_security_reaches_every_process_and_the_settings_take_it(helm: Helm, helm_tmp: Path) -> None:
    from stream.settings import KafkaSettings

    own = {"secretRef": {"name": "learner-extra"}}
    objects = helm.render({**_SECURED_KAFKA, "learner": {"extraEnvFrom": [own]}}, helm_tmp)
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        workload = process(objects, name)
        env = env_of(workload)
        assert env["OPENFORGE_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["OPENFORGE_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        paths = {key: env[f"OPENFORGE_KAFKA_SSL_{key}"] for key in ("CAFILE", "CERTFILE", "KEYFILE")}
        assert paths == {"CAFILE": "/etc/openforge/kafka-tls/ca.crt", "CERTFILE": "/etc/openforge/kafka-tls/tls.crt",
                         "KEYFILE": "/etc/openforge/kafka-tls/tls.key"}, name
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        # The password comes from the operator's secret, never from values or the rendered manifest.
        assert {"secretRef": {"name": "kafka-user"}} in container["envFrom"], name
        assert "OPENFORGE_KAFKA_SASL_PASSWORD" not in {e["name"] for e in container["env"]}
        assert {"name": "kafka-tls", "mountPath": "/etc/openforge/kafka-tls", "readOnly": True} in container[
            "volumeMounts"], name
        assert {"name": "kafka-tls", "secret": {"secretName": "kafka-tls", "defaultMode": 288}} in pod["volumes"]
        # The rendered variables and what the secret adds are settings the process takes (the
        # certificate paths are left out: their files exist only in the pod).
        env_vars = {k: v for k, v in env.items() if k.startswith("OPENFORGE_KAFKA_") and "SSL_" not in k}
        settings = KafkaSettings(**{k.removeprefix("OPENFORGE_KAFKA_").lower(): v for k, v in env_vars.items()},
                                 sasl_username="u", sasl_password="p")
        assert settings.security_protocol == "SASL_SSL" and settings.sasl_mechanism == "SCRAM-SHA-512"
    # The learner keeps its own envFrom beside the Kafka credentials.
    learner = one(objects, "Deployment", "-learner")["spec"]["template"]["spec"]["containers"][0]
    assert own in learner["envFrom"] and {"secretRef": {"name": "kafka-user"}} in learner["envFrom"]


def test_kafka_oauthbearer_gives_every_process_the_token_endpoint(helm: Helm, helm_tmp: Path) -> None:
    from stream.settings import KafkaSettings

    security = {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER", "credentialsSecret": "kafka-oauth-client",
                "oauthTokenUrl": "https://idp.example/realms/kafka/protocol/openid-connect/token",
                "oauthScope": "kafka"}
    objects = helm.render({"kafka": {**_SECURED_KAFKA["kafka"], "security": security}}, helm_tmp)
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        container = process(objects, name)["spec"]["template"]["spec"]["containers"][0]
        env = env_of(process(objects, name))
        assert env["OPENFORGE_KAFKA_SASL_MECHANISM"] == "OAUTHBEARER", name
        assert env["OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL"] == security["oauthTokenUrl"], name
        assert env["OPENFORGE_KAFKA_SASL_OAUTH_SCOPE"] == "kafka", name
        assert {"secretRef": {"name": "kafka-oauth-client"}} in container["envFrom"], name
        assert "OPENFORGE_KAFKA_SASL_OAUTH_CA_FILE" not in env, name
        assert "OPENFORGE_KAFKA_SASL_OAUTH_HEADER_URLENCODE" not in env, name
        settings = KafkaSettings(**{k.removeprefix("OPENFORGE_KAFKA_").lower(): v for k, v in env.items()
                                    if k.startswith("OPENFORGE_KAFKA_")}, sasl_username="id", sasl_password="secret")
        assert settings.oauth_token_provider().token_url == security["oauthTokenUrl"], name
    # An identity provider whose certificate the cluster's private authority signed.
    trusting = helm.render({"kafka": {**_SECURED_KAFKA["kafka"], "security": {
        **security, "tlsSecret": "kafka-ca", "oauthTrustsTlsSecretCa": True}}}, helm_tmp)
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        env = env_of(process(trusting, name))
        assert env["OPENFORGE_KAFKA_SASL_OAUTH_CA_FILE"] == env["OPENFORGE_KAFKA_SSL_CAFILE"], name
    # An identity provider that form-decodes the client's id and secret.
    encoding = helm.render({"kafka": {**_SECURED_KAFKA["kafka"], "security": {
        **security, "oauthHeaderUrlencode": True}}}, helm_tmp)
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        env = env_of(process(encoding, name))
        settings = KafkaSettings(**{k.removeprefix("OPENFORGE_KAFKA_").lower(): v for k, v in env.items()
                                    if k.startswith("OPENFORGE_KAFKA_")}, sasl_username="id", sasl_password="secret")
        assert settings.oauth_token_provider().header_urlencode, name
    # Confluent Cloud's extensions, in the form the setting reads.
    extended = helm.render({"kafka": {**_SECURED_KAFKA["kafka"], "security": {
        **security, "oauthExtensions": {"logicalCluster": "lkc-abc12", "identityPoolId": "pool-Xy1"}}}}, helm_tmp)
    for name in ("proxy", "assembler", "learner", "launcher", "watcher", "publisher"):
        env = env_of(process(extended, name))
        assert env["OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS"] == "identityPoolId=pool-Xy1,logicalCluster=lkc-abc12", name
        settings = KafkaSettings(**{k.removeprefix("OPENFORGE_KAFKA_").lower(): v for k, v in env.items()
                                    if k.startswith("OPENFORGE_KAFKA_")}, sasl_username="id", sasl_password="secret")
        assert settings.oauth_token_provider().extensions()["logicalCluster"] == "lkc-abc12", name


# --- bad input: a clear error, nothing rendered ---------------------------------------------------

@pytest.mark.parametrize(("values", "message"), [
    ({"kafka": {"mode": "bogus"}}, "at '/kafka/mode': value must be one of 'strimzi', 'external'"),
    ({"kafka": {"mode": "external"}}, "kafka.bootstrapServers is required"),
    ({"kafka": {"mode": "external", "bootstrapServers": "no-port"}}, "bootstrapServers"),
    ({"credentials": {"signingKey": "short"}}, "signingKey"),
    ({"credentials": {"otherSigningKey": "short"}}, "otherSigningKey"),
    ({"checkpoints": {"storage": "objectStore"}}, "checkpoints.storage=objectStore is not supported yet"),
    ({"kafka": {"strimzi": {"replicas": 1, "replicationFactor": 3}}}, "replicationFactor cannot exceed"),
    ({"proxy": {"replicaz": 3}}, "replicaz"),
    ({"learner": {"gpu": {"count": 0}}}, "count"),
    ({"rollouts": {"namespace": "Not_A_Namespace"}}, "namespace"),
    ({"proxy": {"extraEnv": {"OPENFORGE_PROXY_DRAIN_S": "300"}}}, "set those instead"),
    ({"assembler": {"drainSeconds": 0}}, "drainSeconds"),
    ({"proxy": {"spoolVolume": "hostPath"}}, "at '/proxy/spoolVolume': value must be one of"),
    ({"proxy": {"spoolSizeLimit": "1500Mi"}}, "at '/proxy/spoolSizeLimit': '1500Mi' does not match pattern"),
    ({"proxy": {"spoolSizeLimit": "9999999Ti"}}, "at '/proxy/spoolSizeLimit': '9999999Ti' does not match pattern"),
    ({"proxy": {"sampling": {"seed": 1}}}, "additional properties 'seed' not allowed"),  # the harness's, not forced
    ({"proxy": {"sampling": {"temperature": "hot"}}}, "at '/proxy/sampling/temperature'"),
    ({"proxy": {"images": "url"}}, "at '/proxy/images': value must be one of 'refuse', 'inline', 'placeholder'"),
    ({"kafka": {"security": {"protocol": "SASL_SSL"}}}, "kafka.security applies to kafka.mode external"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "PLAIN"}}},
     "kafka.security.protocol SASL_SSL needs kafka.security.saslMechanism and kafka.security.credentialsSecret"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SSL", "credentialsSecret": "s"}}},
     "saslMechanism and credentialsSecret need protocol SASL_SSL or SASL_PLAINTEXT, not SSL"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_PLAINTEXT", "saslMechanism": "PLAIN",
                                                         "credentialsSecret": "s", "tlsSecret": "t"}}},
     "kafka.security.tlsSecret needs protocol SSL or SASL_SSL, not SASL_PLAINTEXT"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SSL", "clientCertificate": True}}},
     "kafka.security.clientCertificate needs kafka.security.tlsSecret"),
    ({"kafka": {"security": {"protocol": "TLS"}}}, "at '/kafka/security/protocol': value must be one of"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER",
                                                         "credentialsSecret": "s"}}},
     "kafka.security.saslMechanism OAUTHBEARER needs kafka.security.oauthTokenUrl"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "PLAIN",
                                                         "credentialsSecret": "s", "oauthScope": "kafka"}}},
     "kafka.security.oauthTokenUrl, oauthScope, oauthTrustsTlsSecretCa, oauthHeaderUrlencode and oauthExtensions "
     "need saslMechanism OAUTHBEARER"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "SCRAM-SHA-512",
                                                         "credentialsSecret": "s", "oauthHeaderUrlencode": True}}},
     "oauthHeaderUrlencode and oauthExtensions need saslMechanism OAUTHBEARER"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER",
                                                         "credentialsSecret": "s", "oauthTokenUrl": "https://i/t",
                                                         "oauthExtensions": {"logical_cluster": "lkc-1"}}}},
     "'logical_cluster' does not match pattern '^[A-Za-z]+$'"),  # helm names a wrong path for property names
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER",
                                                         "credentialsSecret": "s", "oauthTokenUrl": "https://i/t",
                                                         "oauthExtensions": {"logicalCluster": "a,b=c"}}}},
     "at '/kafka/security/oauthExtensions/logicalCluster'"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER",
                                                         "credentialsSecret": "s", "oauthTokenUrl": "https://i/t",
                                                         "oauthTrustsTlsSecretCa": True}}},
     "kafka.security.oauthTrustsTlsSecretCa needs kafka.security.tlsSecret (its ca.crt)"),
    ({"kafka": {**_SECURED_KAFKA["kafka"], "security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER",
                                                         "credentialsSecret": "s", "oauthTokenUrl": "idp/token"}}},
     "at '/kafka/security/oauthTokenUrl': 'idp/token' does not match pattern"),
])
def test_bad_values_fail_with_a_clear_error(helm: Helm, helm_tmp: Path, values: dict[str, Any], message: str) -> None:
    proc = helm.template(values, helm_tmp)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert proc.stdout.strip() == ""


def test_values_schema_matches_values_file() -> None:
    import json

    import jsonschema
    import yaml
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


def _metadata_blocks(obj: dict[str, Any]) -> list[dict[str, Any]]:
    blocks = [obj["metadata"]]
    template = obj.get("spec", {}).get("template") if isinstance(obj.get("spec"), dict) else None
    if isinstance(template, dict):
        blocks.append(template.get("metadata", {}))
    return blocks


def test_labels_and_annotations_are_strings(rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    for obj in rendered[combo.name]:
        for metadata in _metadata_blocks(obj):
            for field in ("labels", "annotations"):
                for key, value in (metadata.get(field) or {}).items():
                    assert isinstance(value, str), f"{obj['kind']}/{obj['metadata']['name']} {field} {key}={value!r}"


def test_checksums_are_quoted() -> None:
    """A hex digest prefix can read as a number in YAML (all digits, or digits-e-digits for Go's parser);
    only a quoted one is always the string an annotation must be. Rendering alone rarely shows it."""
    lines = [line for path in sorted((CHART / "templates").rglob("*")) if path.is_file()
             for line in path.read_text().splitlines() if "checksum/" in line and "sha256sum" in line]
    assert len(lines) >= 2
    for line in lines:
        assert line.rstrip().endswith("| quote }}"), line


def test_drain_seconds_reach_the_processes_and_the_grace_period_covers_the_proxys_shipping(
        helm: Helm, helm_tmp: Path) -> None:
    objects = helm.render({"proxy": {"drainSeconds": 40, "publishTimeoutSeconds": 6},
                           "assembler": {"drainSeconds": 25}, "learner": {"drainSeconds": 90}}, helm_tmp)
    proxy = one(objects, "StatefulSet", "-proxy")
    assert env_of(proxy)["OPENFORGE_PROXY_DRAIN_S"] == "40"
    assert env_of(proxy)["OPENFORGE_PROXY_PUBLISH_TIMEOUT_S"] == "6"
    # Calls drain (40), calls of harnesses that left are recorded (10), the journal ships (3 x 6 + 5).
    assert proxy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 40 + 10 + 3 * 6 + 5
    assert env_of(one(objects, "Deployment", "-assembler"))["OPENFORGE_ASSEMBLER_DRAIN_TIMEOUT_S"] == "25"
    learner = one(objects, "Deployment", "-learner")
    assert env_of(learner)["OPENFORGE_LEARNER_DRAIN_TIMEOUT_S"] == "90"
    assert learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 90
    # The settings exist under those names: a misspelt variable would be ignored silently.
    from consumers.assembler.settings import AssemblerSettings
    from learner.settings import LearnerSettings
    from proxy.settings import ProxySettings
    assert "drain_s" in ProxySettings.model_fields and "publish_timeout_s" in ProxySettings.model_fields
    assert "drain_timeout_s" in AssemblerSettings.model_fields and "drain_timeout_s" in LearnerSettings.model_fields


def test_the_proxy_samples_as_the_policy_unless_told_otherwise(default_objects: list[dict[str, Any]], helm: Helm,
                                                               helm_tmp: Path) -> None:
    from proxy.settings import POLICY_SAMPLING, ProxySettings

    def sampling(objects: list[dict[str, Any]]) -> dict[str, Any]:
        value = env_of(one(objects, "StatefulSet", "-proxy"))["OPENFORGE_PROXY_SAMPLING"]
        return ProxySettings(sampling=json.loads(value)).sampling  # what the proxy will read

    assert sampling(default_objects) == POLICY_SAMPLING
    # null, not {} (which Helm merges into the default): each harness's own sampling.
    assert sampling(helm.render({"proxy": {"sampling": None}}, helm_tmp)) == {}


def test_the_proxy_refuses_images_unless_told_to_inline_them(default_objects: list[dict[str, Any]], helm: Helm,
                                                               helm_tmp: Path) -> None:
    from proxy.settings import ProxySettings

    def images(objects: list[dict[str, Any]]) -> str:
        value = env_of(one(objects, "StatefulSet", "-proxy"))["OPENFORGE_PROXY_IMAGES"]
        return ProxySettings(images=value).images  # what the proxy will read

    assert images(default_objects) == "refuse"
    assert images(helm.render({"proxy": {"images": "inline"}}, helm_tmp)) == "inline"
    assert images(helm.render({"proxy": {"images": "placeholder"}}, helm_tmp)) == "placeholder"


@pytest.mark.parametrize(("values", "message"), [
    ({"publisher": {"enabled": False}},
     "learner.enabled needs publisher.enabled: without the publisher the engines keep serving the initial weights"),
    ({"learner": {"enabled": False}}, "launcher.pace needs the learner (learner.enabled)"),
])
def test_settings_that_could_never_train_fail_the_render_saying_what_to_set(
        helm: Helm, helm_tmp: Path, values: dict[str, Any], message: str) -> None:
    proc = helm.template(values, helm_tmp)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_staleness_checkpoints_and_pacing_reach_learner_and_launcher(default_objects: list[dict[str, Any]],
                                                                    helm: Helm, helm_tmp: Path) -> None:
    learner = env_of(one(default_objects, "Deployment", "-learner"))
    assert (learner["OPENFORGE_LEARNER_MAX_STALENESS"], learner["OPENFORGE_LEARNER_CHECKPOINT_EVERY"]) == ("4", "10")
    launcher = env_of(one(default_objects, "Deployment", "-launcher"))
    assert launcher["OPENFORGE_LAUNCHER_PACE"] == "true"
    assert launcher["OPENFORGE_LAUNCHER_LEARNER_MODEL"] == learner["OPENFORGE_LEARNER_MODEL_NAME"]
    # Collecting rollouts without a learner: pacing off, and nothing is left that waits for one.
    alone = helm.render({"learner": {"enabled": False}, "launcher": {"pace": False}}, helm_tmp)
    env = env_of(one(alone, "Deployment", "-launcher"))
    assert env["OPENFORGE_LAUNCHER_PACE"] == "false" and "OPENFORGE_LAUNCHER_LEARNER_MODEL" not in env
