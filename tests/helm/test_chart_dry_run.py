"""Every rendered object, applied with a server-side dry run (strict field validation) to a real kube-apiserver.

Needs the `kube_api` fixture (a real kube-apiserver with etcd, from the Kubernetes backend's test setup),
which provides the API URL, an admin bearer token and the CA bundle that signed the server's certificate.
Accepted shapes: an object with `url`, `token` (or `admin_token`) and `ca_file` (or `ca`/`ca_path`) attributes, or a tuple
(url, token, ca_file). Strimzi's CRDs (generated from Maven Central) are installed for real first, so the
Strimzi resources are checked by the API server's own structural-schema validation too.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from helm_chart import NAMESPACE, Combo, Helm

FIELD_MANAGER = "openforge-chart-test"


def _connection(kube_api: Any) -> tuple[str, str, str]:
    if isinstance(kube_api, tuple | list):
        url, token, ca = kube_api
    else:
        url = kube_api.url
        token = next(getattr(kube_api, name) for name in ("token", "admin_token") if hasattr(kube_api, name))
        ca = next(getattr(kube_api, name) for name in ("ca_file", "ca", "ca_path") if hasattr(kube_api, name))
    return str(url).rstrip("/"), str(token), str(ca)


class Api:
    """A minimal client: discovery plus server-side apply, enough for a dry run of a chart."""

    def __init__(self, kube_api: Any) -> None:
        url, token, ca = _connection(kube_api)
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                   verify=ssl.create_default_context(cafile=ca), timeout=30)
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}

    def resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(plural, namespaced) of a kind, from the server's discovery documents."""
        key = (api_version, kind)
        if key not in self._resources:
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            answer = self.client.get(path)
            answer.raise_for_status()
            for item in answer.json()["resources"]:
                if "/" not in item["name"]:
                    self._resources[(api_version, item["kind"])] = (item["name"], item["namespaced"])
        assert key in self._resources, f"the API server does not serve {kind} in {api_version}"
        return self._resources[key]

    def apply(self, obj: dict[str, Any], *, dry_run: bool) -> httpx.Response:
        plural, namespaced = self.resource(obj["apiVersion"], obj["kind"])
        base = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        if namespaced:
            base += f"/namespaces/{obj['metadata'].get('namespace', NAMESPACE)}"
        params = {"fieldManager": FIELD_MANAGER, "fieldValidation": "Strict", "force": "true"}
        if dry_run:
            params["dryRun"] = "All"
        return self.client.patch(f"{base}/{plural}/{obj['metadata']['name']}", params=params,
                                 content=yaml.safe_dump(obj), headers={"Content-Type": "application/apply-patch+yaml"})

    def install_crds(self, crd_dir: Path) -> None:
        for path in sorted(crd_dir.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            answer = self.apply(crd, dry_run=False)
            assert answer.status_code in (200, 201), f"{path.name}: {answer.status_code} {answer.text[:2000]}"
        deadline = time.monotonic() + 60
        for path in sorted(crd_dir.glob("*.yaml")):
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            while True:
                status = self.client.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}").json()
                conditions = {c["type"]: c["status"] for c in status.get("status", {}).get("conditions", [])}
                if conditions.get("Established") == "True":
                    break
                assert time.monotonic() < deadline, f"CRD {name} not established: {conditions}"
                time.sleep(0.5)
        self._resources.clear()


@pytest.fixture(scope="module")
def api(kube_api: Any, crd_dir: Path) -> Iterator[Api]:
    client = Api(kube_api)
    client.install_crds(crd_dir)
    for namespace in (NAMESPACE, "rollouts"):
        answer = client.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, dry_run=False)
        assert answer.status_code in (200, 201), answer.text
        # No controller-manager runs beside a test API server, so nothing creates the namespace's default
        # ServiceAccount, which admission of a Pod without serviceAccountName (the helm test pod) looks up.
        default = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": namespace}}
        answer = client.apply(default, dry_run=False)
        assert answer.status_code in (200, 201), answer.text
    yield client
    client.client.close()


def _dry_run_all(api: Api, objects: list[dict[str, Any]]) -> None:
    failures = []
    for obj in objects:
        answer = api.apply(obj, dry_run=obj["kind"] != "Namespace")
        if answer.status_code not in (200, 201):
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {answer.status_code} {answer.text[:1000]}")
    assert not failures, "\n".join(failures)


def test_defaults_dry_run(api: Api, default_objects: list[dict[str, Any]]) -> None:
    _dry_run_all(api, default_objects)


def test_combination_dry_run(api: Api, rendered: dict[str, list[dict[str, Any]]], combo: Combo) -> None:
    _dry_run_all(api, rendered[combo.name])


def test_separate_rollout_namespace_dry_run(api: Api, helm: Helm, helm_tmp: Path) -> None:
    _dry_run_all(api, helm.render({"rollouts": {"namespace": "rollouts"}}, helm_tmp))


def test_proxy_spool_on_claims_dry_run(api: Api, helm: Helm, helm_tmp: Path) -> None:
    _dry_run_all(api, helm.render({"proxy": {"spoolVolume": "persistentVolumeClaim",
                                             "spoolStorageClassName": "standard"}}, helm_tmp))


def test_dry_run_rejects_an_unknown_field(api: Api, default_objects: list[dict[str, Any]]) -> None:
    """Guards the check itself: strict field validation must refuse a misspelt field."""
    topic = next(o for o in default_objects if o["kind"] == "KafkaTopic")
    broken = {**topic, "spec": {**topic["spec"], "partitionz": 3}}
    answer = api.apply(broken, dry_run=True)
    # Server-side apply refuses it while building the typed patch, which the API server reports as 500.
    assert answer.status_code in (400, 422, 500), answer.text
    assert ".spec.partitionz: field not declared in schema" in answer.text
