"""Session-wide real parts: one real Kafka broker for the whole run.

The broker is started through the same code as `openforge kafka up`, on free
ports and in a temporary folder. ``--kafka HOST:PORT`` points the suite at an
existing cluster instead. A test that needs Kafka and cannot reach it fails.
"""

from __future__ import annotations

import atexit
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from netutil import free_port, free_port_pair

from stream.admin import KafkaAdmin
from stream.broker import BrokerError, LocalBroker
from stream.settings import BrokerSettings, KafkaSettings
from stream.topics import TopicRegistry

if TYPE_CHECKING:
    from kubeapi import KubeAPI
    from simcluster import SimCluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kafka", default=None, metavar="HOST:PORT",
                     help="use this Kafka cluster instead of starting a local broker")
    parser.addoption("--vllm", default=None, metavar="URL",
                     help="use this vLLM server (serving the tiny model) instead of starting one")
    parser.addoption("--kube-bin", default=None, metavar="DIR",
                     help="folder with the etcd, Kubernetes and kwok binaries (default: where `make kube` puts them)")


# The session's servers run in sessions of their own (a Ctrl-C meant for pytest
# must not kill them mid-teardown), so nothing else stops them if a teardown is cut short, as an
# interrupted or crashing run can do; stopping twice is harmless.


@pytest.fixture(scope="session")
def vllm_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM (CPU build) serving the tiny local model; installed and made once, cached."""
    given = request.config.getoption("--vllm")
    if given:
        yield str(given).rstrip("/")
        return
    from openforge.engine import LocalEngine, install_vllm, make_tiny_model
    from stream.broker import cache_root

    python = install_vllm()
    model = make_tiny_model(python, cache_root() / "models" / "tiny-qwen2-seed0")
    engine = LocalEngine(model, free_port(), python, tmp_path_factory.mktemp("vllm") / "vllm.log")
    atexit.register(engine.stop)  # also at exit (see the note above), even if cut short while starting
    engine.start()
    try:
        yield engine.url
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker | None]:
    """The session's local broker (None when --kafka names an existing cluster)."""
    if request.config.getoption("--kafka"):
        yield None
        return
    local = None
    for attempt in range(3):  # a free port can be taken by another process before Kafka binds it
        port = free_port_pair()
        local = LocalBroker(BrokerSettings(
            port=port, controller_port=port + 1, data_dir=str(tmp_path_factory.mktemp("kafka")),
        ))
        atexit.register(local.stop)  # also at exit (see the note above), even if cut short while starting
        try:
            local.start()
            break
        except BrokerError:
            if attempt == 2:
                raise
    assert local is not None
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest, broker: LocalBroker | None) -> str:
    """``host:port`` of the Kafka cluster under test."""
    return str(request.config.getoption("--kafka") or (broker.bootstrap if broker else ""))


@pytest.fixture
def kafka_settings(kafka_bootstrap: str) -> KafkaSettings:
    """Settings with a topic prefix unique to the test, so tests never see each other's records."""
    return KafkaSettings(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        partitions=2,
        linger_ms=0,
    )


@pytest.fixture
def registry(kafka_settings: KafkaSettings) -> TopicRegistry:
    return TopicRegistry.from_settings(kafka_settings)


@pytest.fixture
async def topics(kafka_settings: KafkaSettings, registry: TopicRegistry) -> TopicRegistry:
    """The registry's topics, created on the real broker under the test's prefix."""
    async with KafkaAdmin(kafka_settings, registry) as admin:
        await admin.create_topics()
    return registry


@pytest.fixture(scope="session")
def kube_api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    """A real etcd + kube-apiserver (RBAC, static tokens) for the session; fails if not built."""
    from pathlib import Path

    from kubeapi import KubeAPI, kube_bin_dir

    given = request.config.getoption("--kube-bin")
    api = KubeAPI(tmp_path_factory.mktemp("kube"), Path(given) if given else kube_bin_dir())
    atexit.register(api.stop)  # also at exit (see the note above), even if cut short while starting
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="session")
def sim_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    """The simulated cluster (real control plane, 20 kwok nodes, faulty rollout pods); fails if not built."""
    from pathlib import Path

    from kubeapi import kube_bin_dir
    from simcluster import SimCluster

    given = request.config.getoption("--kube-bin")
    cluster = SimCluster(tmp_path_factory.mktemp("sim"), Path(given) if given else kube_bin_dir(), nodes=20)
    atexit.register(cluster.stop)  # also at exit (see the note above), even if cut short while starting
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
