"""Parts of the stream layer that need no broker: registry, settings, replay records."""

from __future__ import annotations

import pytest

from stream.settings import BrokerSettings, KafkaSettings
from stream.tooling import RawRecord, read_jsonl
from stream.topics import ALL_TOPICS, CALLS, CHECKPOINTS, DEAD_LETTERS, TRAJECTORIES, TopicRegistry


def test_registry_applies_prefix_and_partition_override() -> None:
    registry = TopicRegistry("exp42.", partitions=2)
    assert registry[CALLS].name == "exp42.openforge.calls.v1"
    assert {t.partitions for t in registry} == {2}
    assert registry.resolve("calls") is registry[CALLS]
    assert registry.resolve("openforge.calls.v1") is registry[CALLS]
    assert registry.resolve("exp42.openforge.dlq.v1") is registry[DEAD_LETTERS]
    with pytest.raises(KeyError, match="registry topics: tasks, calls"):
        registry.resolve("nope")


def test_topic_configs_hold_the_contract() -> None:
    assert CHECKPOINTS.configs()["cleanup.policy"] == "compact"
    assert CHECKPOINTS.configs()["retention.ms"] == "-1"
    # A dead letter carries a base64 copy of the largest record of any other topic.
    largest = max(t.max_message_bytes for t in ALL_TOPICS if t is not DEAD_LETTERS)
    assert DEAD_LETTERS.max_message_bytes > largest * 4 // 3
    assert TRAJECTORIES.max_message_bytes >= CALLS.max_message_bytes
    assert len({t.base_name for t in ALL_TOPICS}) == len(ALL_TOPICS)


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_KAFKA_BOOTSTRAP_SERVERS", "kafka-0:9092,kafka-1:9092")
    monkeypatch.setenv("OPENFORGE_KAFKA_TOPIC_PREFIX", "exp7.")
    monkeypatch.setenv("OPENFORGE_KAFKA_COMPRESSION", "lz4")
    monkeypatch.setenv("OPENFORGE_BROKER_PORT", "19092")
    settings = KafkaSettings()
    assert settings.bootstrap_servers == "kafka-0:9092,kafka-1:9092"
    assert TopicRegistry.from_settings(settings)[CALLS].name == "exp7.openforge.calls.v1"
    assert settings.compression == "lz4"
    assert BrokerSettings().port == 19092


def test_the_broker_port_moves_the_controller_port_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # A second broker on one machine (OPENFORGE_BROKER_PORT) used to keep 9093 for its controller.
    assert (BrokerSettings().port, BrokerSettings().controller_port) == (9092, 9093)
    monkeypatch.setenv("OPENFORGE_BROKER_PORT", "29092")
    assert BrokerSettings().controller_port == 29093
    monkeypatch.setenv("OPENFORGE_BROKER_CONTROLLER_PORT", "29500")
    assert BrokerSettings().controller_port == 29500
    with pytest.raises(ValueError, match="different ports"):
        BrokerSettings(port=29500)


def test_bad_settings_are_refused_with_the_field_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_KAFKA_COMPRESSION", "brotli")
    with pytest.raises(ValueError, match="compression"):
        KafkaSettings()


def test_replay_record_round_trips_text_and_binary(tmp_path) -> None:
    records = [
        RawRecord("t", 0, 5, 1700000000000, b"r-1", b'{"a": 1}', (("schema", b"reward"),)),
        RawRecord("t", 1, 6, 1700000000001, b"\xff\x00", b"\x80binary", (("x", b"\xfe"),)),
        RawRecord("t", 1, 7, 1700000000002, None, None, ()),
    ]
    path = tmp_path / "dump.jsonl"
    path.write_bytes(b"".join(r.to_json_line() for r in records))
    assert list(read_jsonl(path)) == records


def test_replay_file_errors_name_file_and_line(tmp_path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_bytes(RawRecord("t", 0, 0, 0, None, b"ok", ()).to_json_line() + b'{"value": {"b64": "%%%"}}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2"):
        list(read_jsonl(path))



def test_group_ids_are_scoped_by_the_topic_prefix() -> None:
    assert KafkaSettings(topic_prefix="exp42.").scoped("openforge-assembler") == "exp42.openforge-assembler"
    assert KafkaSettings().scoped("openforge-launcher") == "openforge-launcher"
