"""The proxy's journal shipper, in a process of its own.

Why a process: the proxy serves every call on one event loop, and shipping (building each call's
event from its raw capture, encoding it, aiokafka's produce path) took about a quarter of that
loop's CPU. Here it runs beside the proxy, on another core where there is one, and the proxy's
part of capture is one JSON dump and one ``write`` per call.

The two processes share the journal's folder and two pipes:

* the proxy writes a configuration line (JSON of :class:`WorkerSpec`) on the worker's stdin, then
  a ``w`` whenever something waits for Kafka (a reward); closing stdin, or the proxy dying, asks
  the worker to ship what is left and exit;
* the worker writes one JSON line per batch on its stdout: how far Kafka has the journal, whether
  Kafka is reachable, how many batches failed, whether the journal is damaged.

The worker holds a lock on :data:`producers.journal_tail.LOCK_NAME` for its whole life (an inline
shipper holds it too): a proxy that starts while an old worker still drains waits for it before
recovering the journal. The proxy restarts a worker that dies; it ships on from the ``shipped``
mark (re-sending at most what it had not marked, which the assembler drops by event id).

Run by the proxy as ``python -m producers.ship_worker <journal folder>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from producers.journal_tail import LOCK_WAIT_S, JournalTail, lock_shipping_async

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What the shipping process needs to know; sent as JSON on its stdin, never on its command line."""

    kafka: dict[str, object] = field(repr=False)
    """``KafkaSettings`` as JSON values (:meth:`KafkaSettings.worker_json`: the SASL password
    included, so never in a repr)."""
    client_id: str = "openforge-proxy"
    ack_timeout_s: float = 5.0
    batch_records: int = 1024
    batch_bytes: int = 4 * 1024 * 1024
    linger_s: float = 0.02


@dataclass
class _Status:
    shipped: int = -1
    kafka_ok: bool = False
    errors: int = 0
    failed: bool = False


class ShipperProcess:
    """The proxy's side: starts the worker, follows its progress, restarts it if it dies."""

    def __init__(self, directory: Path, spec: WorkerSpec, *, on_progress: Callable[[], object]) -> None:
        self.directory = directory
        self.spec = spec
        self._on_progress = on_progress
        self._status = _Status()
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()
        self._stopping = False
        self.restarts = 0
        """Times the worker died and was started again."""

    @property
    def shipped(self) -> int:
        """Every journal record up to this sequence number is in Kafka, as the worker last said."""
        return self._status.shipped

    @property
    def kafka_ok(self) -> bool:
        """The worker runs and its last batch reached Kafka."""
        return self._status.kafka_ok and self._process is not None and self._process.returncode is None

    @property
    def failed(self) -> bool:
        """The worker found the journal damaged."""
        return self._status.failed

    @property
    def publish_errors(self) -> int:
        """Batches that failed, over every worker this proxy started."""
        return self._status.errors

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the shipper lock (no worker reads the journal meanwhile), e.g. to recover the journal."""
        fd = await lock_shipping_async(self.directory, LOCK_WAIT_S)
        try:
            yield
        finally:
            os.close(fd)

    async def start(self) -> None:
        """Start the worker and wait for its first report (it has tried to reach Kafka by then)."""
        await self._spawn()
        self._task = asyncio.create_task(self._follow(), name="journal-shipper-process")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first.wait(), self.spec.ack_timeout_s * 2 + 30.0)

    async def _spawn(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "producers.ship_worker", str(self.directory),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self._process.stdin is not None
        self._process.stdin.write(orjson.dumps(asdict(self.spec)) + b"\n")

    async def _follow(self) -> None:
        """Read the worker's reports; start it again when it dies, unless stopping."""
        errors_before = 0
        backoff = 1.0
        while True:
            process = self._process
            assert process is not None
            assert process.stdout is not None
            while line := await process.stdout.readline():
                try:
                    report = orjson.loads(line)
                    self._status = _Status(int(report["shipped"]), bool(report["kafka_ok"]),
                                           errors_before + int(report["errors"]), bool(report["failed"]))
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    logger.warning("journal shipper said something unexpected: %r", line[:200])
                    continue
                backoff = 1.0
                self._first.set()
                self._on_progress()
            code = await process.wait()
            if self._stopping:
                return
            if self._status.failed:
                logger.error("journal shipper found the journal damaged (exit %s); not restarting it", code)
                return
            errors_before = self._status.errors
            self._status = _Status(self._status.shipped, False, errors_before, self._status.failed)
            self._on_progress()
            logger.error("journal shipper exited with %s; starting another in %.0fs", code, backoff)
            await asyncio.sleep(backoff)
            if self._stopping:
                return
            backoff = min(backoff * 2, 10.0)
            while True:
                try:
                    await self._spawn()
                    break
                except OSError as exc:  # no process could be made (no memory, no descriptor left)
                    logger.error("starting the journal shipper failed (%r); trying again in %.0fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    if self._stopping:
                        return
                    backoff = min(backoff * 2, 10.0)
            self.restarts += 1

    def wake(self) -> None:
        """Ask the worker to look at the journal now (something waits for Kafka)."""
        process = self._process
        if process is not None and process.stdin is not None and process.returncode is None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                process.stdin.write(b"w")

    async def stop(self, deadline_s: float) -> None:
        """Ask the worker to ship what is left and exit; kill it after ``deadline_s`` and some. Idempotent.

        The worker may spend ``deadline_s`` shipping and one acknowledgement timeout more
        closing its Kafka client; it writes its mark before that.
        """
        if self._stopping:
            return
        self._stopping = True
        stopped: set[int] = set()
        # A worker being restarted as the stop begins is stopped too, after the one seen first.
        while (process := self._process) is not None and id(process) not in stopped:
            stopped.add(id(process))
            if process.returncode is not None:
                continue
            assert process.stdin is not None
            process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), deadline_s + self.spec.ack_timeout_s + 5.0)
            except TimeoutError:
                logger.warning("journal shipper did not exit in time; killing it")
                process.kill()
                await process.wait()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5.0)


# -- the worker ------------------------------------------------------------------------------------


class _Reporter:
    """Progress lines to the proxy; silent once the proxy is gone (its pipe broke)."""

    def __init__(self) -> None:
        self.gone = False

    def __call__(self, shipped: int, kafka_ok: bool, errors: int, failed: bool) -> None:
        if self.gone:
            return
        try:
            line = orjson.dumps({"shipped": shipped, "kafka_ok": kafka_ok, "errors": errors, "failed": failed})
            sys.stdout.buffer.write(line + b"\n")
            sys.stdout.buffer.flush()
        except OSError:
            self.gone = True  # the proxy died: ship what is left anyway, without telling anyone


async def _work(directory: Path) -> int:
    from producers.journal import JournalCorruptError
    from producers.shipper import Shipper
    from stream import EventProducer, KafkaSettings, TopicRegistry

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    spec = WorkerSpec(**orjson.loads(await stdin.readline()))
    kafka = KafkaSettings.model_validate(spec.kafka)
    registry = TopicRegistry.from_settings(kafka)
    report = _Reporter()
    lock = await lock_shipping_async(directory, LOCK_WAIT_S)
    tail = JournalTail(directory)
    try:
        try:
            tail.open()
        except JournalCorruptError:
            logger.exception("the journal at %s is damaged; not shipping it", directory)
            report(-1, False, 0, True)
            return 1
        shipper = Shipper(lambda: EventProducer(kafka, registry=registry, client_id=spec.client_id), tail,
                          registry, ack_timeout_s=spec.ack_timeout_s, batch_records=spec.batch_records,
                          batch_bytes=spec.batch_bytes, linger_s=spec.linger_s,
                          idle_wait_s=max(spec.linger_s, 0.01),
                          on_progress=lambda: report(tail.shipped, shipper.kafka_ok, shipper.publish_errors,
                                                     shipper.failed))
        await shipper.connect()
        report(tail.shipped, shipper.kafka_ok, shipper.publish_errors, shipper.failed)
        runner = asyncio.create_task(shipper.run())

        async def listen() -> None:
            while data := await stdin.read(4096):
                if b"w" in data:
                    shipper.hurry()
            shipper.stop_when_done()  # the proxy closed stdin, or died

        listener = asyncio.create_task(listen())
        # A SIGTERM to the proxy's whole process group (systemd's default, a shell killing a job)
        # reaches this worker while the proxy still finishes its last calls. Ship what is there at
        # once, and go on until the proxy closes stdin after its drain (or dies, which closes it
        # too): exiting here would leave those last calls to a worker restarted mid-shutdown.
        loop.add_signal_handler(signal.SIGTERM, shipper.hurry)
        done, _ = await asyncio.wait({runner, listener}, return_when=asyncio.FIRST_COMPLETED)
        if listener in done:
            try:
                await asyncio.wait_for(asyncio.shield(runner), spec.ack_timeout_s * 2)
            except TimeoutError:
                logger.warning("Kafka did not take the journal in time; the rest stays in %s", directory)
        runner.cancel()
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        tail.close()  # the mark first: closing the Kafka client may take a while
        report(tail.shipped, shipper.kafka_ok, shipper.publish_errors, shipper.failed)
        await shipper.close()
        return 1 if shipper.failed else 0
    finally:
        tail.close()
        os.close(lock)


def main() -> None:
    """Entry point: ``python -m producers.ship_worker <journal folder>``."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s journal-shipper: %(message)s")
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m producers.ship_worker <journal folder>")
    # The proxy stops this worker by closing its stdin, after the proxy's own drain; a Ctrl-C
    # meant for the proxy must not cut the shipping short (nor may a SIGTERM, see _work).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Until _work installs its SIGTERM handler (after the journal's lock and Kafka, which can take
    # a while), a SIGTERM to the process group must not end the worker either.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.freeze()  # the imports' objects never die; keep collections short
    gc.set_threshold(10_000)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    raise SystemExit(asyncio.run(_work(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()


__all__ = ["ShipperProcess", "WorkerSpec", "main"]
