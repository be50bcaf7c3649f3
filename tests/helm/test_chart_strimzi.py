"""The Strimzi resources the chart renders are valid against Strimzi's own CRD schemas, and its topics are
exactly the registry's (stream/topics.py)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helm_chart import CHART, Helm, find

from stream.topics import ALL_TOPICS

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema that rejects unknown fields.

    The API server prunes unknown fields silently (or rejects them under fieldValidation=Strict); here an
    unknown field is an error, so a misspelt setting cannot vanish on its way to the operator.
    """
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="session")
def crd_schemas(crd_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON Schema of every version the generated CRDs serve."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        for version in crd["spec"]["versions"]:
            if version["served"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schema = _strict(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"type": "object"}  # checked separately below
                schemas[key] = schema
    assert {kind for _, kind in schemas} == {"Kafka", "KafkaNodePool", "KafkaTopic"}
    return schemas


def _validate(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert key in schemas, f"{key} is not served by the Strimzi CRDs; served: {sorted(schemas)}"
    jsonschema.validate(obj, schemas[key], cls=jsonschema.Draft7Validator)
    name = obj["metadata"]["name"]
    assert len(name) <= 253 and _DNS_SUBDOMAIN.match(name), f"{name!r} is not a valid resource name"


def test_strimzi_resources_match_the_crds(helm: Helm, helm_tmp: Path,
                                          crd_schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    for values in (None, {"kafka": {"strimzi": {"storage": {"type": "ephemeral"}, "replicas": 1,
                                                "replicationFactor": 1, "minInsyncReplicas": 1}},
                          "networkPolicy": {"enabled": False}, "learner": {"gpu": {"enabled": False}}}):
        objects = [o for o in helm.render(values, helm_tmp) if o["apiVersion"].startswith("kafka.strimzi.io/")]
        assert len(objects) == 2 + len(ALL_TOPICS)
        for obj in objects:
            _validate(obj, crd_schemas)


def test_crd_check_catches_a_misspelt_field(default_objects: list[dict[str, Any]],
                                            crd_schemas: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Guards the check itself: an unknown field or a wrong type must fail."""
    kafka = next(o for o in default_objects if o["kind"] == "Kafka")
    broken = copy.deepcopy(kafka)
    broken["spec"]["kafka"]["listenerz"] = broken["spec"]["kafka"]["listeners"]
    with pytest.raises(jsonschema.ValidationError, match="listenerz"):
        _validate(broken, crd_schemas)
    topic = copy.deepcopy(next(o for o in default_objects if o["kind"] == "KafkaTopic"))
    topic["spec"]["partitions"] = "six"
    with pytest.raises(jsonschema.ValidationError):
        _validate(topic, crd_schemas)


def test_one_kafka_topic_per_registry_topic(default_objects: list[dict[str, Any]]) -> None:
    topics = {t["spec"]["topicName"]: t for t in find(default_objects, "KafkaTopic")}
    assert set(topics) == {spec.base_name for spec in ALL_TOPICS}
    for spec in ALL_TOPICS:
        topic = topics[spec.base_name]
        assert topic["spec"]["partitions"] == spec.partitions, spec.base_name
        assert topic["spec"]["replicas"] == 3
        config = dict(topic["spec"]["config"])
        assert config.pop("min.insync.replicas") == "2"
        assert config == spec.configs(), spec.base_name
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == "of-openforge-kafka"


def test_values_topics_equal_the_registry() -> None:
    """values.yaml lists the registry's topics by hand (helm cannot read Python): they must not drift."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    declared = {t["name"]: (t["partitions"], t["config"]) for t in values["kafka"]["topics"]}
    registry = {s.base_name: (s.partitions, s.configs()) for s in ALL_TOPICS}
    assert declared == registry


def test_broker_accepts_the_largest_topic_record(default_objects: list[dict[str, Any]]) -> None:
    config = next(o for o in default_objects if o["kind"] == "Kafka")["spec"]["kafka"]["config"]
    largest = max(spec.max_message_bytes for spec in ALL_TOPICS)
    assert config["message.max.bytes"] >= largest
    assert config["replica.fetch.max.bytes"] >= largest
    assert config["auto.create.topics.enable"] is False
