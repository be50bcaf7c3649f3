"""Proxy overhead: OpenForge's proxy (capture on and off) against LiteLLM's, both over one fast upstream.

Run from the repository root with ``python -m bench.proxy``.

What runs, each in its own process, all on 127.0.0.1:

* **upstream**: ``bench.fast_upstream``, a canned vLLM-compatible server that answers from
  precomputed bytes (``prompt_token_ids``, ``token_ids``, logprobs, usage; SSE when streaming), so
  the proxies in front of it are what is measured;
* **openforge**: the real proxy (``openforge proxy``: uvicorn, one worker) publishing every call
  to Kafka (a private single-node broker on free ports, or ``--bootstrap``; topics are created under
  a fresh ``benchproxy<hex>.`` prefix); its journal is shipped to Kafka from its own event loop;
* **openforge-nocap**: the same proxy started with ``OPENFORGE_PROXY_CAPTURE=false`` (the
  ``capture`` setting), which answers the same way but publishes nothing. Proxy code without that
  setting cannot be measured this way; this target is then left out, with a warning;
* **litellm**: LiteLLM's proxy server (``litellm.proxy.proxy_cli``, one worker) from its own
  virtual environment (``scripts/litellm/install.sh``), one model routed to the upstream as an
  OpenAI-compatible base, no database, no callbacks, no cache, no retries;
* **direct**: the upstream itself, the baseline the others are compared with.

Every target gets the same request: a harness-style chat completion (system prompt and one user
turn, about 1.6 KB; a counter in the user turn keeps requests distinct). OpenForge gets a rollout
token (one rollout per client connection), LiteLLM its master key.

Measured, in one run, alternating targets so that a noisy machine disturbs them alike:

0. untimed: one whole and one streamed call per target, checked; then a second of load per target
   (warms the servers, their connection pools and the broker's JIT);
1. non-streaming latency: sequential requests on one keep-alive connection per target, the target
   order rotating every request; p50/p99 and the added latency over direct (difference of the
   percentiles). LiteLLM's samples are taken in a loop of their own afterwards: it goes on working
   for milliseconds after each answer, and that work would otherwise overlap the next target's
   request (it added about 0.5 ms to the OpenForge targets' p50);
2. streaming time to first token (the first SSE chunk with content), measured the same way;
3. throughput: non-streaming requests/s with 1, 16 and 64 concurrent keep-alive connections, each
   cell running for a fixed time (``--duration``) after a warm-up request per connection; rounds
   rotate the target order and the table shows the median over rounds. Capture on and capture off
   run back to back in every round, in alternating order, and the goal's verdict reads the median
   of their round-by-round ratios (the ratio of the two medians is printed beside it). The CPU
   time that the target's server process (with its children) used per request is read from
   /proc; it depends much less on how busy the machine was than requests/s do, and its inverse
   is the target's requests per second per core, the figure compared with LiteLLM's. After a
   capturing target's cell the benchmark waits until Kafka holds every event answered so far and
   reads the CPU figures only then, so a journalling proxy's shipping backlog is charged to its
   own cell rather than slowing the next target's (the ``drained in`` figure of each cell;
   requests/s count the load's time alone);
4. equal load: every OpenForge target at one offered rate that all of them sustain (``--paced-rate``;
   by default half the slowest one's median at the middle concurrency), the connections sending
   on a fixed schedule. In the closed-loop cells a slower target also serves fewer calls per
   pass of each event loop, which raises every process's CPU per call; at one rate the
   difference between capture on and off is what capture itself costs. Besides each process,
   the whole machine's busy CPU per call is read from /proc/stat (the kernel's own work
   included).

The load generator is this process: a minimal HTTP/1.1 client on raw asyncio streams that parses
only what it needs, one keep-alive connection per client, each sending its next request as soon as
the last is answered. It spends 50 to 65 µs of CPU per request, and one event loop sends the
connections' requests in bursts (every answer that arrived in one pass of its loop is followed by
the next request in that same pass), which lets a proxy serve several calls per pass of its own
loop. On a two-core machine the load generator competes for CPU with the proxy, the upstream and
the Kafka broker, which all share the same two cores, so absolute requests/s are a lower bound and
the direct target at high concurrency mostly measures the load generator; the ratios and the
per-request CPU columns are the robust figures.

Knob for what capture costs: ``--compression`` (the capturing proxy's batch compression,
``OPENFORGE_KAFKA_COMPRESSION``).

``--json PATH`` also writes the results as JSON, ``--plot PATH`` draws them (throughput with every
round, capture's paired ratios against the goal, added latency, CPU per call at equal load;
``bench/proxy_plot.py``, which also draws a saved ``--json`` again).

Checks: every target's answer is validated once before timing; after the run (once the
journalling proxy has shipped its backlog) the calls topic must hold exactly one event per call
answered by the capturing proxies, and the upstream must have served
at least one call per answered request. Goals (reported, not enforced): added p50 latency of at
most 1 ms (non-streaming, capture on), and OpenForge (capture on) serving at least 10x LiteLLM's
requests per second per core at every concurrency; capture-on throughput is also compared with
capture-off's (at least 80%). Exit status 0 when the benchmark ran, non-zero on any error (a
process that did not start, a failed request, a check); every process is stopped at the end, also
on SIGTERM. The defaults take about 3.5 to 4 minutes on two cores, the broker's start included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.broker import private_broker
from bench.fast_upstream import MODEL
from schemas.credentials import Role, mint_token
from stream.admin import KafkaAdmin
from stream.broker import LocalBroker, free_port
from stream.settings import KafkaSettings
from stream.topics import CALLS

GOAL_CAPTURE_RATIO = 0.80
"""Capture-on throughput must be at least this fraction of capture-off's."""
GOAL_ADDED_P50_MS = 1.0
"""Added p50 latency of a non-streaming call through the capturing proxy must be at most this."""
GOAL_VS_LITELLM_PER_CORE = 10.0
"""OpenForge (capture on) must serve at least this many times LiteLLM's requests per second per
core (per CPU-second of the target's own processes)."""

SLOW = frozenset({"litellm"})
"""Targets whose latency is sampled apart from the others' (:func:`measure`)."""

REPO = Path(__file__).resolve().parent.parent
CHAT_PATH = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

SYSTEM_PROMPT = (
    "You are a coding agent working in a sandboxed repository. Use the tools you are given to read "
    "files, run commands and edit code. Think step by step, keep edits minimal, run the tests after "
    "every change and report what you did. "
) * 6


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- the load generator: a minimal HTTP/1.1 client ----------------------------------------------


class RequestError(RuntimeError):
    """A request failed: transport error, timeout, non-200 status or a malformed answer."""


@dataclass
class Answer:
    """One response: seconds to the end (and to the first content chunk when streamed), body bytes."""

    total_s: float
    first_s: float | None
    body: bytes


class Connection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def send(self, data: bytes, *, stream: bool = False, keep_body: bool = False) -> Answer:
        """Send one request (head and body in ``data``) and read its whole answer."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                return await self._send(data, stream, keep_body)
        except (OSError, EOFError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError) as exc:
            await self.close()
            raise RequestError(f"{type(exc).__name__}: {exc}") from exc
        except RequestError:
            await self.close()
            raise

    async def _send(self, data: bytes, stream: bool, keep_body: bool) -> Answer:
        if self.writer is None:
            await self.open()
        reader, writer = self.reader, self.writer
        assert reader is not None
        assert writer is not None
        started = time.perf_counter()
        writer.write(data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = -1
        chunked = close = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        first: float | None = None
        parts: list[bytes] = []
        if chunked:
            pending = b""  # SSE text not yet split into events, until the first content chunk
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, to the empty line
                        pass
                    break
                chunk = (await reader.readexactly(size + 2))[:-2]
                if stream and first is None:
                    pending += chunk
                    events = pending.split(b"\n\n")
                    pending = events.pop()
                    if any(_has_content(event) for event in events):
                        first = time.perf_counter() - started
                if keep_body or status != b"200" or not stream or first is None:
                    parts.append(chunk)
                else:
                    parts = [chunk]  # the last chunk is enough to check the end of the stream
        elif length >= 0:
            parts.append(await reader.readexactly(length))
        else:
            parts.append(await reader.read())
            close = True
        total = time.perf_counter() - started
        if close:
            await self.close()
        body = b"".join(parts)
        if status != b"200":
            raise RequestError(f"HTTP {status.decode()}: {body[:300]!r}")
        if stream:
            if first is None:
                raise RequestError(f"stream without content: {body[-300:]!r}")
            if b"[DONE]" not in body:
                raise RequestError(f"stream without [DONE]: {body[-300:]!r}")
        return Answer(total, first, body)


def _has_content(event: bytes) -> bool:
    """True for an SSE event carrying generated text (a chat chunk with non-empty delta content)."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                return True
    return False


# -- targets ------------------------------------------------------------------------------------


@dataclass
class Target:
    """Something to send chat completions to."""

    name: str
    label: str
    port: int
    auth: Callable[[str], str | None]
    """The bearer token for a rollout id (None: no authorization header)."""
    pid: int | None = None
    """The server process whose CPU time is measured (its children included)."""
    ok: int = 0
    """Successful chat calls answered, over the whole run."""
    errors: list[str] = field(default_factory=list)

    def request(self, rollout: str, counter: int, *, stream: bool) -> bytes:
        return build_request(self.port, self.auth(rollout), counter, stream=stream)


def request_template(port: int, *, authorized: bool, stream: bool) -> tuple[str, bytes]:
    """Every request's head and body, with ``{token}``, ``{len}`` (in the head) and ``{n}`` (the body's
    counter) left to fill: the one place the benchmark's request is written."""
    body = orjson.dumps({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Step {n}: the test suite fails in tests/unit; find out why "
                                        "and fix it without changing the tests."},
        ],
        "max_tokens": 256,
        "temperature": 0.7,
        **({"stream": True} if stream else {}),
    })
    auth = "authorization: Bearer {token}\r\n" if authorized else ""
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"accept: {'text/event-stream' if stream else 'application/json'}\r\n"
            f"user-agent: openforge-bench/1\r\n{auth}content-length: {{len}}\r\n\r\n")
    return head, body


def build_request(port: int, token: str | None, counter: int, *, stream: bool) -> bytes:
    head, template = request_template(port, authorized=token is not None, stream=stream)
    body = template.replace(b"{n}", str(counter).encode())
    return head.replace("{token}", token or "").replace("{len}", str(len(body))).encode() + body


async def call(target: Target, conn: Connection, rollout: str, counter: int, *, stream: bool = False,
               keep_body: bool = False) -> Answer | None:
    """One request; a failure is recorded on the target and returns None."""
    try:
        answer = await conn.send(target.request(rollout, counter, stream=stream), stream=stream,
                                 keep_body=keep_body)
    except RequestError as exc:
        target.errors.append(str(exc))
        return None
    target.ok += 1
    return answer


async def validate(target: Target) -> None:
    """One whole and one streamed call, checked against the canned completion."""
    conn = Connection("127.0.0.1", target.port)
    try:
        answer = await call(target, conn, "bench-check", 0, keep_body=True)
        if answer is None:
            raise RuntimeError(f"{target.label}: validation call failed: {target.errors[-1]}")
        body = orjson.loads(answer.body)
        text = body["choices"][0]["message"]["content"]
        if not text or not text.startswith(" w0 w1"):
            raise RuntimeError(f"{target.label}: unexpected answer {answer.body[:300]!r}")
        streamed = await call(target, conn, "bench-check", 1, stream=True, keep_body=True)
        if streamed is None:
            raise RuntimeError(f"{target.label}: validation stream failed: {target.errors[-1]}")
        pieces = [(choice.get("delta") or {}).get("content") or ""
                  for line in streamed.body.split(b"\n")
                  if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]")
                  for choice in orjson.loads(line[5:]).get("choices") or ()]
        if "".join(pieces) != text:
            raise RuntimeError(f"{target.label}: streamed text differs from the whole answer")
    finally:
        await conn.close()


# -- CPU accounting -----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, from /proc."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_s(root: int | None) -> float:
    """CPU seconds used so far by ``root`` and its descendants (0 when unknown)."""
    if root is None:
        return 0.0
    stats = [_stat(pid) for pid in (root, *descendants(root))]
    return sum(stat[1] for stat in stats if stat is not None)


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all CPUs, kernel work included), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / CLK_TCK


def descendants(root: int) -> list[int]:
    """The pids of ``root``'s children, their children, and so on."""
    table: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            table.setdefault(stat[0], []).append(int(entry.name))
    out, todo = [], list(table.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(table.get(pid, ()))
    return out


# -- the measurements ---------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Cell:
    """One throughput measurement: a target at one concurrency, one round."""

    rps: float
    requests: int
    errors: int
    server_cpu_us: float
    upstream_cpu_us: float
    broker_cpu_us: float
    client_cpu_us: float
    drain_s: float = 0.0
    """Seconds from the load's end until Kafka held every event of the capturing targets."""
    machine_cpu_us: float = math.nan
    """The whole machine's busy CPU per request (every process and the kernel's own work)."""
    late: float = 0.0
    """Paced cells: the share of requests sent more than one interval after their slot."""


async def sequential(targets: Sequence[Target], count: int, warmup: int, *, stream: bool) -> dict[str, list[float]]:
    """Latency (or time to first token) samples in ms, one request per target in turn, order rotating."""
    conns = {t.name: Connection("127.0.0.1", t.port) for t in targets}
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    kind = "streaming TTFT" if stream else "non-streaming latency"
    try:
        gc.collect()
        for i in range(warmup + count):
            if i == warmup:
                progress(f"{kind}: warm-up done, timing {count} requests per target")
            shift = i % len(targets)
            for target in [*targets[shift:], *targets[:shift]]:
                answer = await call(target, conns[target.name], "bench-seq", 10_000_000 + i, stream=stream)
                if answer is not None and i >= warmup:
                    seconds = answer.first_s if stream else answer.total_s
                    assert seconds is not None
                    samples[target.name].append(seconds * 1e3)
    finally:
        for conn in conns.values():
            await conn.close()
    return samples


def cpu_snapshot(target: Target, upstream_pid: int | None,
                 broker_pid: int | None) -> tuple[float, float, float, float, float]:
    """CPU seconds so far: the target's tree, upstream, broker, load generator, machine."""
    return (tree_cpu_s(target.pid), tree_cpu_s(upstream_pid), tree_cpu_s(broker_pid), time.process_time(),
            machine_busy_s())


def make_cell(cpu0: Sequence[float], cpu1: Sequence[float], done: int, elapsed: float, errors: int, drain_s: float,
              late: int = 0) -> Cell:
    per = 1e6 / max(done, 1)
    return Cell(rps=done / elapsed, requests=done, errors=errors,
                server_cpu_us=(cpu1[0] - cpu0[0]) * per, upstream_cpu_us=(cpu1[1] - cpu0[1]) * per,
                broker_cpu_us=(cpu1[2] - cpu0[2]) * per, client_cpu_us=(cpu1[3] - cpu0[3]) * per,
                drain_s=drain_s, machine_cpu_us=(cpu1[4] - cpu0[4]) * per, late=late / max(done, 1))


async def throughput_cell(target: Target, concurrency: int, duration_s: float, max_requests: int,
                          counter_base: int, upstream_pid: int | None, broker_pid: int | None,
                          drain: Callable[[], Awaitable[float]] | None = None, *, rate: float | None = None) -> Cell:
    """One timed load of ``target``; ``drain``, for a capturing target, waits until Kafka holds its events.

    Without ``rate`` every connection sends its next request as soon as the last is answered (a
    closed loop: the target runs flat out). With ``rate`` the connections send on a fixed
    schedule that adds up to ``rate`` requests per second; a request whose slot has passed goes
    at once and counts as late.

    A journalling proxy answers before its events reach Kafka, so when the load stops its shipper
    may still hold a batch or more. Its CPU and the broker's are read only after that drain: the
    cell pays for all of its own capture and none of it spills into the next target's cell.
    Requests per second count the load's time alone.
    """
    rollouts = [f"bench-c{concurrency}-{k}" for k in range(concurrency)]
    per_worker = max(1, max_requests // concurrency)
    errors_before = len(target.errors)
    conns = [Connection("127.0.0.1", target.port) for _ in range(concurrency)]
    try:
        # Connect and warm every connection (and the server's per-connection state) before timing.
        await asyncio.gather(*(call(target, c, r, counter_base + k) for k, (c, r) in
                               enumerate(zip(conns, rollouts, strict=True))))
        counts = [0] * concurrency
        late = [0] * concurrency
        interval = concurrency / rate if rate else 0.0  # between one connection's requests
        gc.collect()
        cpu0 = cpu_snapshot(target, upstream_pid, broker_pid)
        started = time.perf_counter()
        deadline = started + duration_s

        async def worker(k: int) -> None:
            conn, rollout = conns[k], rollouts[k]
            base = counter_base + concurrency + k * per_worker
            slot = started + k * interval / concurrency  # connections spread over one interval
            n = 0
            while n < per_worker:
                if interval:
                    if slot >= deadline:
                        break
                    wait = slot - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    elif wait < -interval:
                        late[k] += 1
                    slot += interval
                elif time.perf_counter() >= deadline:
                    break
                if await call(target, conn, rollout, base + n) is not None:
                    counts[k] += 1
                n += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
        drain_s = await drain() if drain is not None else 0.0
        cpu1 = cpu_snapshot(target, upstream_pid, broker_pid)
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    return make_cell(cpu0, cpu1, sum(counts), elapsed, len(target.errors) - errors_before, drain_s, sum(late))


@dataclass
class Results:
    latency: dict[str, list[float]]
    ttft: dict[str, list[float]]
    cells: dict[str, dict[int, list[Cell]]]
    paced_rate: float | None = None
    """The offered rate of the equal-load cells (None: not run)."""
    paced: dict[str, list[Cell]] = field(default_factory=dict)


CAPTURING = ("openforge",)
"""The targets that publish a call event for every call they answer."""


class KafkaDrain:
    """Waits until the calls topic holds an event for every call the capturing targets answered."""

    def __init__(self, admin: KafkaAdmin, topic: str, targets: Sequence[Target], timeout_s: float = 60.0) -> None:
        self.admin = admin
        self.topic = topic
        self.targets = [t for t in targets if t.name in CAPTURING]
        self.timeout_s = timeout_s
        self.timeouts = 0
        """Drains that gave up: the cells they ended undercount capture's CPU (reported in the checks)."""
        self._partitions: list[Any] | None = None

    async def stored(self) -> int:
        if self._partitions is None:
            self._partitions = await self.admin.partitions(self.topic)
        return sum((await self.admin.end_offsets(self._partitions)).values())

    async def __call__(self) -> float:
        """Seconds it took; gives up (and says so) after ``timeout_s``."""
        started = time.perf_counter()
        expected = sum(t.ok for t in self.targets)
        while await self.stored() < expected:
            if time.perf_counter() - started > self.timeout_s:
                self.timeouts += 1
                progress(f"Kafka still lacks events after {self.timeout_s:.0f}s of draining; measuring on")
                break
            await asyncio.sleep(0.05)
        return time.perf_counter() - started


PAIRED = ("openforge", "openforge-nocap")
"""The targets whose ratio is a goal: their cells of a round run back to back, in alternating order."""


def round_order(targets: Sequence[Target], turn: int) -> list[Target]:
    """The cells of one round of a concurrency, in order: ``turn`` counts rounds plus concurrency index.

    The target order rotates by ``turn`` so that no target always follows the same one. Capture on
    and capture off run next to each other, their order swapped every turn: the machine's load
    drifts over seconds (other work, the broker's background tasks), and two cells minutes apart
    in one round could differ by that drift alone, while two adjacent cells see nearly the same
    machine. Their round-by-round ratio is then the least disturbed figure of the goal.
    """
    shift = turn % len(targets)
    rotated = [*targets[shift:], *targets[:shift]]
    by_name = {t.name: t for t in targets}
    pair = [by_name[n] for n in PAIRED if n in by_name]
    if len(pair) < 2:
        return rotated
    order: list[Target] = []
    for target in rotated:
        if target.name == PAIRED[1]:
            continue
        if target.name != PAIRED[0]:
            order.append(target)
            continue
        order.extend(pair if turn % 2 == 0 else pair[::-1])
    return order


async def measure(targets: Sequence[Target], args: argparse.Namespace, upstream_pid: int | None,
                  broker_pid: int | None, drain: KafkaDrain | None = None) -> Results:
    for target in targets:
        progress(f"validating {target.label}")
        await validate(target)
    # Untimed load first: warms each server, its connection pools and the broker's JIT.
    counter = 30_000_000
    for target in targets:
        cell = await throughput_cell(target, 16, args.warmup_s, args.max_requests, counter, None, None)
        counter += args.max_requests + 32
        progress(f"warm-up burst {target.label:<26} {cell.rps:8,.0f} req/s (untimed)")
    if drain is not None:
        await drain()  # the bursts' events, before latency is timed
    # LiteLLM keeps working for milliseconds after each answer (its callbacks and accounting),
    # which would land on whichever target's request comes next: its samples are taken in a loop
    # of their own, after the others'.
    fast = [t for t in targets if t.name not in SLOW]
    slow = [t for t in targets if t.name in SLOW]
    latency = await sequential(fast, args.requests, args.warmup, stream=False)
    ttft = await sequential(fast, args.requests, args.warmup, stream=True)
    if slow:
        latency.update(await sequential(slow, args.requests, args.warmup, stream=False))
        ttft.update(await sequential(slow, args.requests, args.warmup, stream=True))
    cells: dict[str, dict[int, list[Cell]]] = {t.name: {c: [] for c in args.concurrency} for t in targets}
    counter = 20_000_000
    if drain is not None:
        await drain()  # the latency loops' events, before any cell is timed
    for round_no in range(args.rounds):
        for ci, concurrency in enumerate(args.concurrency):
            for target in round_order(targets, round_no + ci):
                cell = await throughput_cell(target, concurrency, args.duration, args.max_requests, counter,
                                             upstream_pid, broker_pid,
                                             drain if target.name in CAPTURING else None)
                counter += args.max_requests + 2 * concurrency
                cells[target.name][concurrency].append(cell)
                progress(f"round {round_no + 1}/{args.rounds} c={concurrency:<3} {target.label:<26} "
                         f"{cell.rps:8,.0f} req/s  server CPU {cell.server_cpu_us:7,.0f} us/req  "
                         f"client CPU {cell.client_cpu_us:5,.0f} us/req"
                         + (f"  drained in {cell.drain_s:.2f}s" if target.name in CAPTURING else "")
                         + (f"  {cell.errors} errors" if cell.errors else ""))
    rate, paced = await equal_load(targets, args, cells, counter, upstream_pid, broker_pid, drain)
    return Results(latency, ttft, cells, rate, paced)


async def equal_load(targets: Sequence[Target], args: argparse.Namespace, cells: dict[str, dict[int, list[Cell]]],
                     counter: int, upstream_pid: int | None, broker_pid: int | None,
                     drain: KafkaDrain | None) -> tuple[float | None, dict[str, list[Cell]]]:
    """Every OpenForge target at one offered rate: what capture costs per call, without feedback.

    In the closed-loop cells a slower target also serves fewer calls per pass of each event
    loop, which raises every process's CPU per call, so their CPU columns mix what capture does
    with what running slower costs. At one rate that both sustain, the difference between
    capture on and off is capture's own. The rate is ``--paced-rate``, by default half the
    slowest OpenForge target's median at the middle concurrency.
    """
    proxies = [t for t in targets if t.name.startswith("openforge")]
    concurrency = args.concurrency[len(args.concurrency) // 2]
    rate = args.paced_rate
    if rate is None:
        medians = [statistics.median(c.rps for c in cells[t.name][concurrency]) for t in proxies
                   if cells[t.name][concurrency]]
        rate = 0.5 * min(medians) if medians else 0.0
    if rate <= 0 or len(proxies) < 2:
        return None, {}
    paced: dict[str, list[Cell]] = {t.name: [] for t in proxies}
    for round_no in range(args.equal_load_rounds):
        shift = round_no % len(proxies)
        for target in [*proxies[shift:], *proxies[:shift]]:
            cell = await throughput_cell(target, concurrency, args.duration, args.max_requests, counter,
                                         upstream_pid, broker_pid, drain if target.name in CAPTURING else None,
                                         rate=rate)
            counter += args.max_requests + 2 * concurrency
            paced[target.name].append(cell)
            progress(f"equal load {round_no + 1}/{args.equal_load_rounds} {rate:,.0f} req/s offered, "
                     f"{target.label:<26} "
                     f"{cell.rps:8,.0f} served ({cell.late:.1%} late)  machine CPU {cell.machine_cpu_us:5,.0f} "
                     f"us/req, server {cell.server_cpu_us:5,.0f}")
    return rate, paced


# -- processes ----------------------------------------------------------------------------------


class Process:
    """A server started in its own session, its output kept in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n{self.tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


async def wait_ready(process: Process, port: int, path: str, timeout_s: float) -> float:
    """Poll GET ``path`` until it answers 200; return the seconds waited."""
    started = time.perf_counter()
    request = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()
    while time.perf_counter() - started < timeout_s:
        process.check_alive()
        conn = Connection("127.0.0.1", port)
        try:
            await conn.send(request)
            return time.perf_counter() - started
        except RequestError:
            await asyncio.sleep(0.1)
        finally:
            await conn.close()
    raise RuntimeError(f"{process.name} did not answer {path} within {timeout_s:.0f}s:\n{process.tail()}")


async def http_get_json(port: int, path: str) -> Any:
    conn = Connection("127.0.0.1", port)
    try:
        answer = await conn.send(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode(), keep_body=True)
    finally:
        await conn.close()
    return orjson.loads(answer.body)


def base_env() -> dict[str, str]:
    """This process's environment without OpenForge's own settings (each server gets its own)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OPENFORGE_PROXY_", "OPENFORGE_KAFKA_", "LITELLM_"))}


def openforge_env(kafka: KafkaSettings, key: str, spool: Path, *, capture: bool, journal_linger_ms: int | None = None,
                  journal_fsync_ms: int | None = None) -> dict[str, str]:
    return {
        "OPENFORGE_KAFKA_COMPRESSION": kafka.compression,
        **base_env(),
        "OPENFORGE_PROXY_CREDENTIAL_KEY": key,
        "OPENFORGE_PROXY_SPOOL_DIR": str(spool),
        "OPENFORGE_PROXY_CAPTURE": "true" if capture else "false",
        **({"OPENFORGE_PROXY_JOURNAL_LINGER_MS": str(journal_linger_ms)} if journal_linger_ms is not None else {}),
        **({"OPENFORGE_PROXY_JOURNAL_FSYNC_INTERVAL_MS": str(journal_fsync_ms)}
           if journal_fsync_ms is not None else {}),
        "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "PYTHONUNBUFFERED": "1",
    }


def capture_switch_exists() -> bool:
    """Whether the proxy has the ``capture`` setting that ``OPENFORGE_PROXY_CAPTURE`` sets."""
    from proxy.settings import ProxySettings

    return "capture" in ProxySettings.model_fields


LITELLM_CONFIG = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: sk-upstream-not-checked
      timeout: 60
      max_retries: 0
litellm_settings:
  callbacks: []
  success_callback: []
  failure_callback: []
  num_retries: 0
  request_timeout: 60
  cache: false
  telemetry: false
  drop_params: true
  set_verbose: false
router_settings:
  num_retries: 0
  allowed_fails: 1000000
  cooldown_time: 0
general_settings:
  master_key: {master_key}
  disable_spend_logs: true
  disable_error_logs: true
  background_health_checks: false
"""


def litellm_env(master_key: str) -> dict[str, str]:
    env = {k: v for k, v in base_env().items() if k not in ("DATABASE_URL", "DIRECT_URL", "REDIS_URL", "REDIS_HOST")}
    env.update({
        "LITELLM_TELEMETRY_DISABLED": "True",
        "LITELLM_OFFLINE_MODE": "True",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_MODE": "PRODUCTION",
        "LITELLM_MASTER_KEY": master_key,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def litellm_python(explicit: str | None) -> str:
    """The interpreter of LiteLLM's environment: as given, or from the install script (idempotent)."""
    if explicit:
        return explicit
    script = REPO / "scripts" / "litellm" / "install.sh"
    progress(f"ensuring LiteLLM's environment ({script.relative_to(REPO)}; the first install takes minutes)")
    done = subprocess.run(["bash", str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed with status {done.returncode}")
    return done.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def stopped_at_exit(processes: list[Process]) -> Iterator[None]:
    try:
        yield
    finally:
        for process in reversed(processes):
            progress(f"stopping {process.name}")
            process.stop()


# -- report -------------------------------------------------------------------------------------


def summarize(targets: Sequence[Target], results: Results, args: argparse.Namespace) -> dict[str, Any]:
    def percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        out = {}
        base = samples.get("direct")
        for target in targets:
            values = samples[target.name]
            if not values:
                continue
            row = {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99),
                   "mean_ms": statistics.fmean(values)}
            if base:
                row["added_p50_ms"] = row["p50_ms"] - pct(base, 0.5)
                row["added_p99_ms"] = row["p99_ms"] - pct(base, 0.99)
            out[target.name] = row
        return out

    throughput: dict[str, dict[str, Any]] = {}
    for key, by_concurrency in results.cells.items():
        per_c = {}
        for concurrency, cells in by_concurrency.items():
            if not cells:
                continue
            per_c[str(concurrency)] = {
                "rps_rounds": [c.rps for c in cells],
                "rps_median": statistics.median(c.rps for c in cells),
                "requests": sum(c.requests for c in cells),
                "errors": sum(c.errors for c in cells),
                "server_cpu_us_median": statistics.median(c.server_cpu_us for c in cells),
                "upstream_cpu_us_median": statistics.median(c.upstream_cpu_us for c in cells),
                "broker_cpu_us_median": statistics.median(c.broker_cpu_us for c in cells),
                "client_cpu_us_median": statistics.median(c.client_cpu_us for c in cells),
                "drain_s_max": max(c.drain_s for c in cells),
            }
        throughput[key] = per_c

    def ratio(a: str, b: str) -> dict[str, float]:
        if a not in throughput or b not in throughput:
            return {}
        return {c: throughput[a][c]["rps_median"] / throughput[b][c]["rps_median"]
                for c in throughput[a] if c in throughput[b] and throughput[b][c]["rps_median"] > 0}

    def round_ratios(a: str, b: str) -> dict[str, list[float]]:
        """Round by round (capture on and off ran back to back; see ``round_order``)."""
        if a not in throughput or b not in throughput:
            return {}
        return {c: [x / y for x, y in zip(throughput[a][c]["rps_rounds"], throughput[b][c]["rps_rounds"],
                                          strict=False) if y > 0]
                for c in throughput[a] if c in throughput[b]}

    def capture_goal() -> dict[str, Any]:
        # The verdict reads the median of the paired rounds' ratios; the ratio of the two medians
        # (the verdict's figure before the cells were paired) is kept beside it.
        ratios = ratio("openforge", "openforge-nocap")
        rounds = round_ratios("openforge", "openforge-nocap")
        paired = {c: statistics.median(r) for c, r in rounds.items() if r}
        return {"goal": GOAL_CAPTURE_RATIO, "ratios": ratios, "rounds": rounds, "paired": paired,
                "met": (min(paired.values()) >= GOAL_CAPTURE_RATIO) if paired else None}

    def per_core(a: str, b: str) -> dict[str, float]:
        """How many times ``b``'s CPU per request ``a`` needs less: their requests/s per core, divided."""
        if a not in throughput or b not in throughput:
            return {}
        return {c: throughput[b][c]["server_cpu_us_median"] / throughput[a][c]["server_cpu_us_median"]
                for c in throughput[a] if c in throughput[b] and throughput[a][c]["server_cpu_us_median"] > 0}

    latency = percentiles(results.latency)
    vs_litellm = per_core("openforge", "litellm")
    added = latency.get("openforge", {}).get("added_p50_ms")
    goals = {
        "added_p50_ms": {"goal": GOAL_ADDED_P50_MS, "value": added,
                         "met": None if added is None else added <= GOAL_ADDED_P50_MS},
        "vs_litellm_per_core": {"goal": GOAL_VS_LITELLM_PER_CORE, "ratios": vs_litellm,
                                "rps_ratios": ratio("openforge", "litellm"),
                                "met": (min(vs_litellm.values()) >= GOAL_VS_LITELLM_PER_CORE) if vs_litellm else None},
        "capture_on_vs_off": capture_goal(),
    }
    equal_load: dict[str, Any] | None = None
    if results.paced_rate is not None:
        keys = ("rps", "late", "machine_cpu_us", "server_cpu_us", "upstream_cpu_us", "broker_cpu_us",
                "client_cpu_us")
        equal_load = {"offered_rps": results.paced_rate, "targets": {
            name: {key: statistics.median(getattr(c, key) for c in cells) for key in keys}
            for name, cells in results.paced.items() if cells}}
    return {
        "targets": {t.name: t.label for t in targets},
        "latency": latency,
        "equal_load": equal_load,
        "ttft": percentiles(results.ttft),
        "throughput": throughput,
        "goals": goals,
        "config": {"requests": args.requests, "warmup": args.warmup, "rounds": args.rounds,
                   "equal_load_rounds": args.equal_load_rounds,
                   "duration_s": args.duration, "concurrency": args.concurrency,
                   "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
                   "partitions": args.partitions, "compression": args.compression,
                   "cpus": os.cpu_count()},
    }


def _verdict(met: bool | None) -> str:
    return {True: "MET", False: "MISSED", None: "n/a"}[met]


def format_report(targets: Sequence[Target], summary: dict[str, Any], args: argparse.Namespace) -> str:
    labels = {t.name: t.label for t in targets}
    width = max(len(label) for label in labels.values()) + 2
    lines: list[str] = []

    def latency_table(title: str, rows: dict[str, dict[str, float]]) -> None:
        header = f"{title:<{width}} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
        lines.extend([header, "-" * len(header)])
        for name, row in rows.items():
            if name == "direct":
                extra = f"{'-':>8} {'-':>8}"
            else:
                extra = f"{row.get('added_p50_ms', math.nan):>8.2f} {row.get('added_p99_ms', math.nan):>8.2f}"
            lines.append(f"{labels[name]:<{width}} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {extra}")
        lines.append("")

    latency_table(f"non-streaming ({args.requests}/target)", summary["latency"])
    latency_table(f"streaming TTFT ({args.requests}/target)", summary["ttft"])

    conc = [str(c) for c in args.concurrency]
    mid = conc[len(conc) // 2]
    header = (f"{'req/s (median of ' + str(args.rounds) + ')':<{width}} "
              + " ".join(f"{'c=' + c:>8}" for c in conc)
              + f" {'CPU us/req c=' + mid:>16} {'upstream':>9} {'broker':>7} {'client':>7}")
    lines.extend([header, "-" * len(header)])
    for name, per_c in summary["throughput"].items():
        cells = " ".join(f"{per_c[c]['rps_median']:>8,.0f}" if c in per_c else f"{'-':>8}" for c in conc)
        m = per_c.get(mid, {})
        lines.append(f"{labels[name]:<{width}} {cells} {m.get('server_cpu_us_median', math.nan):>16,.0f} "
                     f"{m.get('upstream_cpu_us_median', math.nan):>9,.0f} "
                     f"{m.get('broker_cpu_us_median', math.nan):>7,.0f} "
                     f"{m.get('client_cpu_us_median', math.nan):>7,.0f}")
    lines.append("")
    lines.append("+p50/+p99: added over direct (difference of percentiles). CPU us/req: CPU time per request of "
                 "the target's server (with its children), the upstream, the Kafka broker and the load generator "
                 f"(this process), at c={mid}; the broker's includes its background work (tens of ms per second), "
                 "which dominates at low request rates.")
    lines.append(f"All processes share {os.cpu_count()} cores with the load generator; req/s are lower bounds "
                 "and direct at high concurrency mostly measures the load generator.")
    lines.append("")

    equal = summary.get("equal_load")
    if equal:
        header = (f"{'equal load, median of ' + str(args.equal_load_rounds):<{width}} {'req/s':>8} {'late':>6}   "
                  "CPU us/req: "
                  f"{'machine':>7} {'server':>7} {'upstream':>9} {'broker':>7} {'client':>7}")
        lines.extend([header, "-" * len(header)])
        for name, row in equal["targets"].items():
            lines.append(f"{labels[name]:<{width}} {row['rps']:>8,.0f} {row['late']:>6.1%}   {'':>11}"
                         f"{row['machine_cpu_us']:>7,.0f} {row['server_cpu_us']:>7,.0f} "
                         f"{row['upstream_cpu_us']:>9,.0f} "
                         f"{row['broker_cpu_us']:>7,.0f} {row['client_cpu_us']:>7,.0f}")
        on, off = equal["targets"].get("openforge"), equal["targets"].get("openforge-nocap")
        lines.append(f"Every OpenForge target offered {equal['offered_rps']:,.0f} req/s on "
                     f"{args.concurrency[len(args.concurrency) // 2]} connections; machine: all busy CPU of the "
                     "machine (every process and the kernel) per request.")
        if on and off:
            lines.append(
                f"At equal load capture costs the machine {on['machine_cpu_us'] - off['machine_cpu_us']:,.0f} us per "
                f"call: the proxy {on['server_cpu_us'] - off['server_cpu_us']:+,.0f}, the broker "
                f"{on['broker_cpu_us'] - off['broker_cpu_us']:+,.0f}, the load generator "
                f"{on['client_cpu_us'] - off['client_cpu_us']:+,.0f}. On a machine they all share, keeping "
                f"{GOAL_CAPTURE_RATIO:.0%} of capture-off throughput allows capture a quarter of a capture-off "
                f"call: about {off['machine_cpu_us'] * (1 / GOAL_CAPTURE_RATIO - 1):,.0f} us at this load.")
        lines.append("")

    goals = summary["goals"]
    added = goals["added_p50_ms"]
    value = "not measured" if added["value"] is None else f"{added['value']:.2f} ms"
    lines.append(f"goal added p50 latency (non-streaming, capture on) <= {GOAL_ADDED_P50_MS:g} ms: "
                 f"{_verdict(added['met'])} ({value})")
    versus = goals["vs_litellm_per_core"]
    ratios = "  ".join(f"c={c} {r:.1f}x (req/s {versus['rps_ratios'].get(c, math.nan):.1f}x)"
                       for c, r in versus["ratios"].items()) or "not measured"
    lines.append(f"goal OpenForge (capture on) >= {GOAL_VS_LITELLM_PER_CORE:g}x LiteLLM's requests/s per core: "
                 f"{_verdict(versus['met'])} ({ratios})")
    capture = goals["capture_on_vs_off"]
    ratios = "  ".join(
        f"c={c} {r:.1%} (rounds {min(capture['rounds'][c]):.0%}-{max(capture['rounds'][c]):.0%}; "
        + (f"of medians {capture['ratios'][c]:.0%})" if c in capture["ratios"] else "of medians n/a)")
        for c, r in capture["paired"].items()) or "not measured"
    lines.append(f"capture-on >= {GOAL_CAPTURE_RATIO:.0%} of capture-off throughput: "
                 f"{_verdict(capture['met'])} ({ratios})")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, tmp: Path) -> tuple[list[Target], dict[str, Any]]:
    processes: list[Process] = []
    with stopped_at_exit(processes):
        # Slow starters first, so that they boot while the broker does.
        upstream_port = free_port()
        upstream = Process("fast upstream", [
            sys.executable, "-m", "bench.fast_upstream", "--port", str(upstream_port),
            "--prompt-tokens", str(args.prompt_tokens), "--completion-tokens", str(args.completion_tokens),
        ], {**base_env(), "PYTHONUNBUFFERED": "1"}, tmp / "upstream.log")
        processes.append(upstream)

        litellm: Process | None = None
        litellm_port = free_port()
        master_key = "sk-bench-" + secrets.token_hex(12)
        if not args.skip_litellm:
            python = litellm_python(args.litellm_python)
            config = tmp / "litellm.yaml"
            config.write_text(LITELLM_CONFIG.format(model=MODEL, upstream_port=upstream_port, master_key=master_key))
            litellm = Process("litellm proxy", [
                python, "-m", "litellm.proxy.proxy_cli", "--config", str(config), "--host", "127.0.0.1",
                "--port", str(litellm_port), "--num_workers", "1",
            ], litellm_env(master_key), tmp / "litellm.log", cwd=tmp)
            processes.append(litellm)

        broker: LocalBroker | None = None
        broker_pid: int | None = None
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            broker = private_broker(tmp / "kafka")
            progress(f"starting a private Kafka broker on {broker.bootstrap} ...")
            started = time.perf_counter()
            broker.start()
            bootstrap = broker.bootstrap
            broker_pid = broker.status().pid
            progress(f"broker up after {time.perf_counter() - started:.1f}s")
        try:
            kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"benchproxy{uuid.uuid4().hex[:10]}.",
                                  partitions=args.partitions, compression=args.compression)
            progress(f"creating registry topics under prefix {kafka.topic_prefix!r}")
            async with KafkaAdmin(kafka) as admin:
                await admin.create_topics()

            key = secrets.token_hex(24)
            of_port, nocap_port = free_port(), free_port()
            of_argv = [sys.executable, "-m", "openforge", "--log-level", "WARNING", "proxy", "--host", "127.0.0.1",
                       "--upstream", f"http://127.0.0.1:{upstream_port}", "--port"]
            openforge = Process("openforge proxy (capture on)", [*of_argv, str(of_port)],
                                openforge_env(kafka, key, tmp / "spool-on", capture=True,
                                              journal_linger_ms=args.journal_linger_ms,
                                              journal_fsync_ms=args.journal_fsync_ms),
                                tmp / "openforge.log")
            processes.append(openforge)
            nocap: Process | None = None
            if capture_switch_exists():
                nocap = Process("openforge proxy (capture off)", [*of_argv, str(nocap_port)],
                                openforge_env(kafka, key, tmp / "spool-off", capture=False),
                                tmp / "openforge-nocap.log")
                processes.append(nocap)
            else:
                progress("WARNING: proxy.settings.ProxySettings has no `capture` field, so "
                         "OPENFORGE_PROXY_CAPTURE=false would be ignored; the capture-off target is left out")

            def agent(rollout: str) -> str:
                return mint_token(key.encode(), rollout, Role.AGENT, 3600.0)

            targets = [Target("direct", "direct (upstream)", upstream_port, lambda _r: None, upstream.pid),
                       Target("openforge", "openforge, capture on", of_port, agent, openforge.pid)]
            if nocap is not None:
                targets.append(Target("openforge-nocap", "openforge, capture off", nocap_port, agent, nocap.pid))
            if litellm is not None:
                targets.append(Target("litellm", "litellm", litellm_port, lambda _r: master_key, litellm.pid))

            waited = await wait_ready(upstream, upstream_port, "/health", 30)
            progress(f"fast upstream ready on :{upstream_port} ({waited:.1f}s)")
            for process, port in ((openforge, of_port), (nocap, nocap_port)):
                if process is not None:
                    waited = await wait_ready(process, port, "/health", 60)
                    progress(f"{process.name} ready on :{port} ({waited:.1f}s)")
            if litellm is not None:
                waited = await wait_ready(litellm, litellm_port, "/health/liveliness", 120)
                progress(f"{litellm.name} ready on :{litellm_port} ({waited:.1f}s)")

            before = (await http_get_json(upstream_port, "/stats"))["chat"]
            async with KafkaAdmin(kafka) as admin:
                drain = KafkaDrain(admin, f"{kafka.topic_prefix}{CALLS.base_name}", targets)
                results = await measure(targets, args, upstream.pid, broker_pid, drain)
            for process in processes:
                process.check_alive()
            summary = summarize(targets, results, args)

            # Checks: one event per call the capturing proxies answered, none from the other. The
            # journalling proxy answers before Kafka has the event: give its shipper time to finish.
            topic = f"{kafka.topic_prefix}{CALLS.base_name}"
            expected = sum(t.ok for t in targets if t.name in CAPTURING)
            async with KafkaAdmin(kafka) as admin:
                deadline = time.monotonic() + 30
                while True:
                    stored = sum((await admin.end_offsets(await admin.partitions(topic))).values())
                    if stored >= expected or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
            served = (await http_get_json(upstream_port, "/stats"))["chat"] - before
            answered = sum(t.ok for t in targets)
            summary["checks"] = {"calls_topic_events": stored, "capture_on_calls": expected,
                                 "upstream_calls": served, "answered_calls": answered,
                                 "errors": {t.name: len(t.errors) for t in targets},
                                 "drains_timed_out": drain.timeouts}
            progress(f"checks: {topic} holds {stored:,} events for {expected:,} calls answered with capture on; "
                     f"upstream served {served:,} calls for {answered:,} answered")
            failures = [f"{t.label}: {len(t.errors)} failed requests, first: {t.errors[0]}"
                        for t in targets if t.errors]
            if stored != expected:
                failures.append(f"{topic} holds {stored:,} events but the capturing proxy answered {expected:,} calls "
                                "(the capture-off proxy must publish nothing)")
            if served < answered:
                failures.append(f"the upstream served {served:,} calls but {answered:,} were answered")
            if drain.timeouts:
                failures.append(f"{drain.timeouts} cells ended before Kafka held their events: their CPU figures "
                                "undercount capture")
            summary["failures"] = failures
            return targets, summary
        finally:
            if broker is not None:
                progress("stopping the broker")
                broker.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="use this Kafka cluster instead of starting a private local broker")
    parser.add_argument("--requests", type=int, default=300,
                        help="timed sequential requests per target, for latency and for TTFT (default 300)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed sequential requests per target first (30)")
    parser.add_argument("--warmup-s", type=float, default=1.0,
                        help="seconds of untimed load (16 connections) per target before timing (default 1)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="closed-loop throughput rounds (default 6: even, so that capture on and off each go "
                             "first in half of them)")
    parser.add_argument("--equal-load-rounds", type=int, default=3, help="equal-load rounds (default 3)")
    parser.add_argument("--duration", type=float, default=2.5, help="seconds per throughput cell (default 2.5)")
    parser.add_argument("--max-requests", type=int, default=20_000,
                        help="upper bound of requests per throughput cell (default 20000)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 64],
                        help="comma-separated client connections per throughput cell (default 1,16,64)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="prompt_token_ids per answer (default 400)")
    parser.add_argument("--completion-tokens", type=int, default=32,
                        help="completion tokens (stream chunks) per answer (default 32)")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of each benchmark topic (default 3)")
    parser.add_argument("--litellm-python", metavar="PATH",
                        help="python of LiteLLM's environment (default: run scripts/litellm/install.sh)")
    parser.add_argument("--compression", choices=["zstd", "lz4", "gzip", "none"], default="zstd",
                        help="batch compression of the capturing proxy's producer (zstd, "
                             "the default of OPENFORGE_KAFKA_COMPRESSION)")
    parser.add_argument("--paced-rate", type=float, default=None, metavar="REQ_PER_S",
                        help="offered rate of the equal-load cells (default: half the slowest OpenForge target's "
                             "median at the middle concurrency; 0 leaves them out)")
    parser.add_argument("--skip-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument("--journal-linger-ms", type=int, default=None,
                        help="the journalling proxy's OPENFORGE_PROXY_JOURNAL_LINGER_MS (default: the setting's)")
    parser.add_argument("--journal-fsync-ms", type=int, default=None,
                        help="the journalling proxies' OPENFORGE_PROXY_JOURNAL_FSYNC_INTERVAL_MS "
                             "(default: the setting's)")
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the results as JSON here")
    parser.add_argument("--plot", metavar="PATH", type=Path,
                        help="also draw the results here (.png, .svg, .pdf); bench/proxy_plot.py draws a --json again")
    args = parser.parse_args(argv)
    if min(args.requests, args.rounds, args.equal_load_rounds, args.max_requests, *args.concurrency) < 1 \
            or args.warmup < 0:
        parser.error("counts must be positive")
    if args.duration <= 0 or args.warmup_s < 0:
        parser.error("--duration must be positive, --warmup-s not negative")
    return args


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="openforge-bench-proxy-") as tmp:
        try:
            targets, summary = asyncio.run(run(args, Path(tmp)))
        except (RuntimeError, OSError) as exc:
            progress(f"ERROR: {exc}")
            return 1
    wall_s = time.perf_counter() - started
    summary["wall_s"] = wall_s
    print(format_report(targets, summary, args))
    print(f"(prompt {args.prompt_tokens} / completion {args.completion_tokens} tokens per call, "
          f"{args.rounds} rounds of {args.duration:g}s per throughput cell; compression {args.compression}; "
          f"wall {wall_s:.0f}s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.plot:
        from bench.proxy_plot import PlotError, write_plot

        try:
            write_plot(summary, args.plot)
        except PlotError as exc:
            summary["failures"].append(f"cannot draw {args.plot}: {exc}")
        else:
            progress(f"drew {args.plot}")
    for failure in summary["failures"]:
        progress(f"ERROR: {failure}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
