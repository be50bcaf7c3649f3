"""The local development broker: a real single-node Apache Kafka in KRaft mode.

Tests and the one-machine demo run against a genuine broker, because the bugs
that matter (transactions, rebalances, size limits) live there. The broker's jars
come from Maven Central once and are cached under the user's cache folder; a
rerun starts in seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from stream.settings import BrokerSettings

logger = logging.getLogger(__name__)

_LOG4J_VERSION = "2.24.3"
_SLF4J_VERSION = "2.0.17"
_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
_COMPLETE_MARKER = ".complete"

# Only these broker settings differ from Kafka's defaults. Each is here because a
# single node cannot satisfy the default (replication factors of 3), because
# startup on two cores matters (50-partition internal topics), or because the
# event sizes of this project need it (100k-token calls).
_BROKER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={log_dir}
auto.create.topics.enable=false
num.partitions=1
num.network.threads=2
num.io.threads=4
background.threads=2
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
share.coordinator.state.topic.num.partitions=1
group.initial.rebalance.delay.ms=0
message.max.bytes={message_max_bytes}
replica.fetch.max.bytes={message_max_bytes}
socket.request.max.bytes={socket_request_max_bytes}
"""

_LOG4J2_PROPERTIES = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
"""

#: Largest record the broker accepts at all; topics set their own, smaller limits.
BROKER_MESSAGE_MAX_BYTES = 64 * 1024 * 1024


class BrokerError(RuntimeError):
    """The local broker could not be fetched, started or stopped."""


def cache_root(configured: str | None = None) -> Path:
    """Return the folder that holds every download OpenForge caches.

    Order: an explicit setting, ``$OPENFORGE_CACHE``, ``$XDG_CACHE_HOME/openforge``,
    ``~/.cache/openforge``. The environment is read here and nowhere else.
    """
    if configured:
        return Path(configured).expanduser()
    if env := os.environ.get("OPENFORGE_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "openforge"


def _pom(version: str) -> str:
    deps = [
        ("org.apache.kafka", "kafka_2.13", version),
        # Kafka's own command-line tools (console consumer and producer, consumer groups, ...):
        # run with `java -cp "<libs>/*" org.apache.kafka.tools.consumer.ConsoleConsumer ...`.
        ("org.apache.kafka", "kafka-tools", version),
        ("org.apache.logging.log4j", "log4j-core", _LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-slf4j2-impl", _LOG4J_VERSION),
        # Kafka still declares slf4j 1.7; the log4j bridge needs the 2.x API.
        ("org.slf4j", "slf4j-api", _SLF4J_VERSION),
    ]
    body = "".join(
        f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>openforge.local</groupId><artifactId>kafka-broker</artifactId>"
        f"<version>{version}</version><packaging>pom</packaging>"
        f"<dependencies>{body}</dependencies></project>"
    )


def _fetched_set(version: str) -> str:
    """What a complete fetch holds, written into its marker.

    A cache fetched before an artifact was added (the tools) is fetched again, not used without it.
    """
    return hashlib.sha256(_pom(version).encode()).hexdigest()


def _marker(libs: Path) -> str | None:
    try:
        return (libs / _COMPLETE_MARKER).read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize concurrent fetches (parallel test workers, two shells)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_kafka_jars(version: str, cache_dir: str | None = None) -> Path:
    """Fetch Apache Kafka's broker jars from Maven Central once; return the libs folder.

    The download goes to a temporary folder and is renamed into place only when
    complete, so an interrupted fetch never leaves a half-populated cache behind.

    Raises:
        BrokerError: Maven is missing or the fetch failed (its output is included).
    """
    root = cache_root(cache_dir) / "kafka" / version
    libs = root / "libs"
    wanted = _fetched_set(version)
    if _marker(libs) == wanted:
        return libs
    with _file_lock(root.parent / f".{version}.lock"):
        if _marker(libs) == wanted:
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Maven (mvn) is needed once to fetch the Kafka broker jars; install it "
                "(e.g. apt-get install maven) and retry"
            )
        logger.info("fetching Apache Kafka %s broker jars from Maven Central (once)", version)
        root.mkdir(parents=True, exist_ok=True)
        # One Maven at a time in the shared local repository (the chart tests' Strimzi CRDs use it too).
        with tempfile.TemporaryDirectory(dir=root) as tmp, _file_lock(cache_root(cache_dir) / "m2.lock"):
            tmp_path = Path(tmp)
            (tmp_path / "pom.xml").write_text(_pom(version))
            started = time.monotonic()
            proc = subprocess.run(  # noqa: S603 - fixed argv, no shell
                [
                    mvn,
                    "-B",
                    "-q",
                    f"-Dmaven.repo.local={cache_root(cache_dir) / 'm2'}",
                    f"{_DEPENDENCY_PLUGIN}:copy-dependencies",
                    f"-DoutputDirectory={tmp_path / 'libs'}",
                    "-DincludeScope=runtime",
                ],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise BrokerError(
                    f"fetching Kafka {version} jars failed (mvn exit {proc.returncode}):\n"
                    f"{(proc.stdout + proc.stderr)[-4000:]}"
                )
            (tmp_path / "libs" / _COMPLETE_MARKER).write_text(wanted)
            if libs.exists():
                shutil.rmtree(libs)
            (tmp_path / "libs").rename(libs)
        logger.info("fetched Kafka %s in %.1fs into %s", version, time.monotonic() - started, libs)
    return libs


@dataclass(frozen=True)
class BrokerStatus:
    """What `openforge kafka status` reports."""

    running: bool
    pid: int | None
    bootstrap: str
    version: str
    data_dir: Path
    log_file: Path


class LocalBroker:
    """Start, probe and stop one single-node KRaft broker on 127.0.0.1.

    The broker is a child process in its own session, so ``openforge kafka up``
    can return while it keeps running; its pid lives in the data folder, which is
    how ``down`` and ``status`` find it again from another shell.
    """

    def __init__(self, settings: BrokerSettings | None = None) -> None:
        self.settings = settings or BrokerSettings()
        base = cache_root(self.settings.cache_dir)
        self.data_dir = (
            Path(self.settings.data_dir).expanduser() if self.settings.data_dir else base / "kafka" / "data"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """The ``host:port`` clients connect to."""
        return f"127.0.0.1:{self.settings.port}"

    @property
    def log_file(self) -> Path:
        """The broker's own output, kept for diagnosis."""
        return self.data_dir / "broker.log"

    @property
    def _pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    def _read_pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) else None

    def status(self) -> BrokerStatus:
        """Report whether this data folder's broker runs, without starting anything."""
        pid = self._read_pid()
        return BrokerStatus(
            running=pid is not None and _answers(self.bootstrap, timeout_s=5.0),
            pid=pid,
            bootstrap=self.bootstrap,
            version=self.settings.version,
            data_dir=self.data_dir,
            log_file=self.log_file,
        )

    def start(self) -> BrokerStatus:
        """Fetch (once), format (once) and start the broker; return when it answers.

        Idempotent: a broker already running from this data folder is left alone.

        Raises:
            BrokerError: the port is taken by something else, the JVM exited, or the
                broker did not answer within ``start_timeout_s`` (log tail included).
        """
        if self._read_pid() is not None:
            if _answers(self.bootstrap, timeout_s=10.0):
                return self.status()
            raise BrokerError(f"a broker process from {self.data_dir} runs but does not answer")
        for port in (self.settings.port, self.settings.controller_port):
            if _port_in_use(port):
                raise BrokerError(f"port {port} on 127.0.0.1 is already in use by another process")
        libs = ensure_kafka_jars(self.settings.version, self.settings.cache_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        log_dir = self.data_dir / "kraft-logs"
        if not (log_dir / "meta.properties").exists():
            self._format(libs, config)
        java = _java()
        cmd = [
            java,
            f"-Xmx{self.settings.heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            *self._jvm_options(),
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(config),
        ]
        logger.info("starting Kafka %s on %s", self.settings.version, self.bootstrap)
        log = self.log_file.open("ab")
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        self._pid_file.write_text(str(self._proc.pid))
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"Kafka exited with code {self._proc.returncode} during start; "
                    f"log tail:\n{self._log_tail()}"
                )
            if _answers(self.bootstrap, timeout_s=5.0):
                logger.info("Kafka answers on %s (pid %d)", self.bootstrap, self._proc.pid)
                return self.status()
            time.sleep(0.5)
        self.stop()
        raise BrokerError(
            f"Kafka did not answer on {self.bootstrap} within {self.settings.start_timeout_s:.0f}s; "
            f"log tail:\n{self._log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker: SIGTERM for a controlled shutdown, SIGKILL after ``timeout_s``.

        Returns:
            True when a running broker was stopped, False when none was running.
        """
        pid = self._proc.pid if self._proc and self._proc.poll() is None else self._read_pid()
        if pid is None:
            self._pid_file.unlink(missing_ok=True)
            return False
        logger.info("stopping Kafka (pid %d)", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._exited_now(pid):
            time.sleep(0.2)
        if not self._exited_now(pid):
            logger.warning("Kafka did not stop within %.0fs; killing it", timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while not self._exited_now(pid):
                time.sleep(0.1)
        self._pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """Kill the broker without a controlled shutdown (crash tests)."""
        pid = self._proc.pid if self._proc else self._read_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while not self._exited_now(pid):
                time.sleep(0.05)
        self._pid_file.unlink(missing_ok=True)

    def _exited_now(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is not None
        return not _alive(pid)

    def _jvm_options(self) -> list[str]:
        """System properties for the broker's JVM beyond the defaults (a subclass's listeners may need some)."""
        return []

    def _write_config(self) -> Path:
        props = _BROKER_PROPERTIES.format(
            port=self.settings.port,
            controller_port=self.settings.controller_port,
            log_dir=self.data_dir / "kraft-logs",
            message_max_bytes=BROKER_MESSAGE_MAX_BYTES,
            socket_request_max_bytes=2 * BROKER_MESSAGE_MAX_BYTES,
        )
        config = self.data_dir / "server.properties"
        config.write_text(props)
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2_PROPERTIES)
        return config

    def _format(self, libs: Path, config: Path) -> None:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        proc = subprocess.run(  # noqa: S603 - fixed argv, no shell
            [
                _java(),
                f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                "-cp",
                f"{libs}/*",
                "kafka.tools.StorageTool",
                "format",
                # The "=" form: a base64url id may start with "-", which would read as an option.
                f"--cluster-id={cluster_id}",
                "-c",
                str(config),
                "--standalone",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise BrokerError(f"formatting Kafka storage failed:\n{(proc.stdout + proc.stderr)[-4000:]}")

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Java 17 or newer is needed to run the Kafka broker; none is on PATH")
    return java


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as gone.
    try:
        with Path(f"/proc/{pid}/stat").open() as f:
            return f.read().split(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for local brokers, engines, proxies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def free_port_pair() -> int:
    """A port P such that P and P+1 are both free (a broker's client and controller listeners)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise BrokerError("no two adjacent free ports on 127.0.0.1")


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _answers(bootstrap: str, timeout_s: float) -> bool:
    """True when the broker serves metadata (not just an open port).

    Probed from a private thread and event loop, so this works whether or not the
    caller already runs an event loop (pytest fixtures, the CLI).
    """
    result: list[bool] = []

    async def probe() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            cluster = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
            return bool(cluster.get("brokers"))
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            return False
        finally:
            with contextlib.suppress(Exception):
                await admin.close()

    def run() -> None:
        result.append(asyncio.run(probe()))

    if not _port_in_use(int(bootstrap.rsplit(":", 1)[1])):
        return False
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s * 3)
    return bool(result and result[0])
