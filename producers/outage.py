"""What the shipper does and says while Kafka is away.

A broker that goes away makes the Kafka client retry every tenth of a second and log each try
(about 40 ERROR and WARNING lines a second), and a batch in flight only fails after the whole
acknowledgement timeout, so readiness said Kafka was fine for seconds after it went. Instead:

* a batch unacknowledged after :data:`STALL_S` has the brokers' addresses probed
  (:func:`broker_reachable`, a TCP connection); none taking one is an outage at once;
* during an outage the addresses are probed every :data:`PROBE_EVERY_S`, and the shipper
  connects again as soon as one takes a connection, so sending resumes within a fraction of a
  second of the broker's return rather than after a retry backoff of up to 10 s;
* the log says it once when Kafka goes, once per interval while it is away (how long, what
  waits), and once when it is back (:class:`OutageLog`). The client's own messages are held
  back (:class:`ClientLogGate`): counted in those lines, the last one quoted when Kafka goes,
  and without an outage summed up in one line per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

logger = logging.getLogger(__name__)

STALL_S = 1.0
"""A batch unacknowledged this long has the brokers' addresses probed: readiness turns false
within about this (and the probe's timeout) of a broker going away under load."""

PROBE_EVERY_S = 0.25
"""How often the brokers' addresses are probed during an outage."""

PROBE_TIMEOUT_S = 0.5
"""How long one probe waits for a connection (a broker's host that drops packets answers nothing)."""


def _address(entry: str) -> tuple[str, int]:
    host, _, port = entry.strip().rpartition(":")
    return host.strip("[]"), int(port)


async def broker_reachable(bootstrap_servers: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether any of the bootstrap addresses takes a TCP connection within ``timeout_s``.

    Not a Kafka request: it needs no credentials and makes the client log nothing. A broker that
    takes connections but does not serve is found by the send that follows, as before.
    """
    async def one(host: str, port: int) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    entries = [entry for entry in bootstrap_servers.split(",") if entry.strip()]
    return any(await asyncio.gather(*(one(*_address(entry)) for entry in entries)))


class ClientLogGate(logging.Filter):
    """Holds back the Kafka client's messages (all but CRITICAL), counted for :class:`OutageLog`'s lines.

    Installed on every ``aiokafka`` logger (a filter on a logger sees only the records made by
    that logger, not its children's). The client logs every retry, ten a second per broker it
    misses; what it said reaches the log in the outage's lines, or once an interval otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        """Messages held back since the last :meth:`take_held`."""
        self.last_held: str | None = None
        """The last message held back."""
        self.first_held_at: float | None = None
        """When the first message since the last :meth:`take_held` was held back (monotonic)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is logged."""
        if record.levelno >= logging.CRITICAL:
            return True
        if not self.held:
            self.first_held_at = time.monotonic()
        self.held += 1
        self.last_held = record.getMessage()
        return False

    def take_held(self) -> int:
        """Messages held back since the last call."""
        held, self.held, self.first_held_at = self.held, 0, None
        return held

    def install(self) -> None:
        """Filter every ``aiokafka`` logger that exists (the client's modules make theirs when imported)."""
        import aiokafka.producer  # noqa: F401 - its modules' loggers, made at import

        names = ["aiokafka", *(name for name in logging.root.manager.loggerDict if name.startswith("aiokafka."))]
        for name in names:
            log = logging.getLogger(name)
            if self not in log.filters:
                log.addFilter(self)

    def uninstall(self) -> None:
        """Take the filter off every logger it was put on."""
        for name in ["aiokafka", *(n for n in logging.root.manager.loggerDict if n.startswith("aiokafka."))]:
            logging.getLogger(name).removeFilter(self)


class OutageLog:
    """One line when Kafka goes, a summary every ``interval_s`` while it is away, one line when it is back."""

    def __init__(self, journal: str, interval_s: float) -> None:
        """Say nothing until :meth:`went`.

        Args:
            journal: Where the events wait (named in the lines).
            interval_s: Least time between two summaries, and between two of the client's messages.
        """
        self.journal = journal
        self.interval_s = interval_s
        self.gate = ClientLogGate()
        self.down_since: float | None = None
        """When the outage began (monotonic), or None while Kafka takes events."""
        self._summary_at = 0.0

    @property
    def down(self) -> bool:
        """Whether an outage is under way."""
        return self.down_since is not None

    def went(self, bootstrap: str, reason: str, waiting: int) -> None:
        """Kafka did not answer: said once per outage."""
        if self.down_since is not None:
            return
        self.down_since = self._summary_at = time.monotonic()
        said = self.gate.last_held
        logger.warning("Kafka at %s is unreachable (%s%s); %d events wait in the journal at %s, and new ones are "
                       "kept there until it is back; a summary follows every %.0f s", bootstrap, reason,
                       f"; the client said: {said}" if said and self.gate.held else "", waiting, self.journal,
                       self.interval_s)
        self.gate.take_held()

    def tick(self, waiting: int) -> None:
        """Say what is due: during an outage its summary, else what the client said, once an interval.

        Called often (at least once a second) by the shipper.
        """
        now = time.monotonic()
        if self.down_since is None:
            if self.gate.first_held_at is not None and now - self.gate.first_held_at >= self.interval_s:
                said = self.gate.last_held
                logger.warning("the Kafka client logged %d messages in %g s, held back; the last: %s",
                               self.gate.take_held(), self.interval_s, said)
            return
        if now - self._summary_at < self.interval_s:
            return
        self._summary_at = now
        logger.warning("Kafka still unreachable after %.0f s: %d events wait in the journal at %s (%d messages of "
                       "the Kafka client held back)", now - self.down_since, waiting, self.journal,
                       self.gate.take_held())

    def back(self, waiting: int) -> None:
        """A batch reached Kafka: the end of an outage, said once."""
        if self.down_since is None:
            return
        logger.info("Kafka is back after %.1f s; shipping the %d events that waited (%d messages of the Kafka "
                       "client held back)", time.monotonic() - self.down_since, waiting, self.gate.take_held())
        self.down_since = None


__all__ = ["PROBE_EVERY_S", "PROBE_TIMEOUT_S", "STALL_S", "ClientLogGate", "OutageLog", "broker_reachable"]
