"""What the log says while Kafka is away: one line when it goes, a summary per interval, one when it is back."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from producers.outage import ClientLogGate, OutageLog, broker_reachable


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "producers.outage"]


def test_an_outage_is_one_line_then_a_summary_per_interval_then_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = OutageLog("/journal", interval_s=0.2)
    log.tick(0)
    log.went("k:9092", "refused", 3)
    log.went("k:9092", "refused again", 4)  # the same outage: nothing new to say
    log.tick(5)  # before the interval: nothing
    assert len(_lines(caplog)) == 1 and "k:9092 is unreachable (refused)" in _lines(caplog)[0]
    time.sleep(0.25)
    log.tick(6)
    log.tick(6)
    [_, summary] = _lines(caplog)
    assert summary.startswith("Kafka still unreachable") and "6 events wait" in summary
    log.back(7)
    log.back(7)
    assert len(_lines(caplog)) == 3 and _lines(caplog)[-1].startswith("Kafka is back") and not log.down


def test_the_kafka_clients_messages_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = OutageLog("/journal", interval_s=0.2)
    log.gate.install()
    try:
        client = logging.getLogger("aiokafka.conn")
        for n in range(40):  # a second of retries, as the client logs them when a broker goes
            client.error("Unable connect to node with id 1: try %d", n)
        assert not [r for r in caplog.records if r.name.startswith("aiokafka")]
        log.went("k:9092", "no broker took a connection", 0)
        [went] = _lines(caplog)
        assert "the client said: Unable connect to node with id 1: try 39" in went
        client.error("while away")
        log.back(0)
        assert "(1 messages of the Kafka client held back)" in _lines(caplog)[-1]
        # Without an outage, what the client said comes once an interval, summed up.
        client.warning("one")
        client.warning("two")
        log.tick(0)
        assert len(_lines(caplog)) == 2
        time.sleep(0.25)
        log.tick(0)
        assert _lines(caplog)[-1] == "the Kafka client logged 2 messages in 0.2 s, held back; the last: two"
        client.critical("always said")
        assert [r.getMessage() for r in caplog.records if r.name == "aiokafka.conn"] == ["always said"]
    finally:
        log.gate.uninstall()
    assert not [f for f in logging.getLogger("aiokafka.conn").filters if isinstance(f, ClientLogGate)]


async def test_the_probe_tells_a_listening_address_from_a_closed_one() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await broker_reachable(f"127.0.0.1:1,127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()
    assert not await broker_reachable(f"127.0.0.1:{port}")
