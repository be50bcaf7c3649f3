"""The private Kafka broker a benchmark starts when it is given no ``--bootstrap``."""

from __future__ import annotations

from pathlib import Path

from stream import BrokerSettings, LocalBroker
from stream.broker import free_port_pair


def private_broker(data_dir: Path) -> LocalBroker:
    """A single-node broker on free ports (its controller on the next one), its data in ``data_dir``; not started."""
    port = free_port_pair()
    return LocalBroker(BrokerSettings(port=port, controller_port=port + 1, data_dir=str(data_dir)))
