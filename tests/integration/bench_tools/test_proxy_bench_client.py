"""The proxy benchmark's load generator and verdicts (``bench.proxy``), against real servers.

The benchmark's throughput figures are only as good as the client's count of answered requests
and the requests it sends, so its count must equal what the server served, every request must
carry its connection's token and a counter of its own, and a refused request must be recorded as
an error rather than counted. The servers are the benchmark's own upstream and, for what that one
cannot show (chunk extensions, trailers, a server that closes after each answer), a small socket
server in this file.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import orjson
import pytest

from bench.proxy import (
    Cell,
    Results,
    Target,
    parse_args,
    round_order,
    summarize,
    throughput_cell,
)
from stream.broker import free_port


@pytest.fixture(scope="module")
def upstream_port() -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "bench.fast_upstream", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the fast upstream did not start") from None
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def _served(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as answer:
        return int(orjson.loads(answer.read())["chat"])


def test_a_cell_counts_what_the_server_answered(upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    before = _served(upstream_port)
    cell = asyncio.run(throughput_cell(target, 4, 0.5, 100_000, 0, None, None))
    assert cell.errors == 0 and not target.errors
    assert cell.requests > 20
    # The timed requests, and one untimed request per connection before the clock started.
    assert _served(upstream_port) - before == cell.requests + 4 == target.ok
    assert cell.requests / cell.rps >= 0.5  # the elapsed time covers the whole load
    assert 0 < cell.client_cpu_us < 5_000


def test_a_cell_stops_at_the_bound_of_requests_per_connection(upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    cell = asyncio.run(throughput_cell(target, 2, 30.0, 50, 0, None, None))
    assert cell.requests == 50 and target.ok == 52  # and each connection's untimed first request


def test_nothing_listening_is_an_error_not_a_count() -> None:
    target = Target("direct", "direct", free_port(), lambda _rollout: None)
    cell = asyncio.run(throughput_cell(target, 1, 0.2, 10, 0, None, None))
    assert cell.requests == 0 and target.ok == 0
    assert target.errors and "ConnectionRefusedError" in target.errors[0]


class _RecordingServer:
    """HTTP/1.1 on a socket: records every request; answers chunked (with a chunk extension and a
    trailer) or with a content length and ``connection: close``; or refuses with 400."""

    def __init__(self, *, close: bool = False, refuse: bool = False) -> None:
        self.close = close
        self.refuse = refuse
        self.requests: list[tuple[int, bytes, bytes]] = []  # connection number, head, body
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                with self.lock:
                    self.requests.append((number, head, body))
                if self.refuse:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\nno")
                elif self.close:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    return
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                 b"5;ext=1\r\nhello\r\n3\r\n\r\nx\r\n0\r\nx-trailer: 1\r\n\r\n")

    def stop(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("close", [False, True], ids=["chunked-with-trailer", "close-after-each"])
def test_every_request_is_its_connections_own(close: bool) -> None:
    server = _RecordingServer(close=close)
    target = Target("t", "t", server.port, lambda rollout: f"tok-{rollout.rsplit('-', 1)[1]}")
    try:
        cell = asyncio.run(throughput_cell(target, 2, 0.3, 80, 1000, None, None))
    finally:
        server.stop()
    assert cell.errors == 0, target.errors[:3]
    assert len(server.requests) == cell.requests + 2
    counters = []
    tokens: dict[int, set[bytes]] = {}
    for number, head, body in server.requests:
        token = re.search(rb"authorization: Bearer (tok-\d)\r\n", head)
        assert token is not None
        tokens.setdefault(number, set()).add(token.group(1))
        assert int(re.search(rb"content-length: (\d+)", head).group(1)) == len(body)  # type: ignore[union-attr]
        counters.append(int(re.match(r"Step (\d+):", orjson.loads(body)["messages"][1]["content"]).group(1)))  # type: ignore[union-attr]
    assert len(set(counters)) == len(counters)
    if not close:  # each connection is one rollout's, its token on every request
        assert sorted(tokens.values()) == [{b"tok-0"}, {b"tok-1"}]
    if close:
        assert server.connections == len(server.requests)  # a new connection after each answer
    else:
        assert server.connections == 2


def test_a_refused_request_is_an_error_not_a_count() -> None:
    server = _RecordingServer(refuse=True)
    target = Target("t", "t", server.port, lambda _rollout: None)
    try:
        cell = asyncio.run(throughput_cell(target, 1, 0.2, 10, 0, None, None))
    finally:
        server.stop()
    assert cell.requests == 0 and target.ok == 0
    assert target.errors and "HTTP 400" in target.errors[0]


def test_capture_on_and_off_run_back_to_back_in_alternating_order() -> None:
    """Every round runs the goal's two cells next to each other, each first in every other turn."""
    names = ["direct", "openforge", "openforge-nocap", "litellm"]
    targets = [Target(n, n, i, lambda _r: None) for i, n in enumerate(names)]
    firsts = []
    for turn in range(8):
        order = [t.name for t in round_order(targets, turn)]
        assert sorted(order) == sorted(names)
        on, off = order.index("openforge"), order.index("openforge-nocap")
        assert abs(on - off) == 1
        assert (on < off) == (turn % 2 == 0)
        firsts.append(order[0])
    assert set(firsts) >= {"direct", "litellm"}  # the order rotates
    # Without a capture-off target nothing is paired, and the order only rotates.
    rest = [t for t in targets if t.name != "openforge-nocap"]
    assert [t.name for t in round_order(rest, 1)] == ["openforge", "litellm", "direct"]


def _cells(*rps: float, cpu_us: float = 1) -> dict[int, list[Cell]]:
    return {16: [Cell(rps=r, requests=100, errors=0, server_cpu_us=cpu_us, upstream_cpu_us=1, broker_cpu_us=1,
                      client_cpu_us=1) for r in rps]}


def test_the_verdict_reads_the_paired_rounds() -> None:
    """A round disturbed for one side moves the ratio of medians, not the median of paired ratios."""
    targets = [Target("openforge", "openforge, capture on", 2, lambda _r: None),
               Target("openforge-nocap", "openforge, capture off", 3, lambda _r: None)]
    args = parse_args(["--concurrency", "16", "--skip-litellm"])
    # Rounds 1-3 ran on a slow machine, rounds 4-5 on a fast one, each pair keeping 85 %, except
    # that in round 3 capture off's cell alone had the fast machine.
    by_key = {"openforge": _cells(2550, 2550, 2550, 4250, 4250), "openforge-nocap": _cells(3000, 3000, 3000, 5000, 5000)}
    by_key["openforge-nocap"][16][2] = _cells(5000)[16][0]
    samples = {"openforge": [0.6] * 5, "openforge-nocap": [0.55] * 5}
    summary = summarize(targets, Results(samples, samples, by_key, None, {}), args)
    goal = summary["goals"]["capture_on_vs_off"]
    assert goal["ratios"]["16"] == pytest.approx(2550 / 5000)  # medians from different machines
    assert goal["paired"]["16"] == pytest.approx(0.85)
    assert goal["met"] is True
    by_key["openforge"][16][:] = _cells(2300, 2300, 2300, 3900, 3900)[16]
    assert summarize(targets, Results(samples, samples, by_key, None, {}), args)["goals"]["capture_on_vs_off"][
        "met"] is False


def test_the_goal_against_litellm_reads_requests_per_second_per_core() -> None:
    """Per core: how much less CPU a call costs, whatever share of the machine each server had."""
    targets = [Target("openforge", "openforge, capture on", 2, lambda _r: None),
               Target("litellm", "litellm", 3, lambda _r: None)]
    args = parse_args(["--concurrency", "16"])
    samples = {"openforge": [0.6] * 5, "litellm": [20.0] * 5}
    # LiteLLM served a fifth of the requests/s but spent 12 times the CPU on each.
    by_key = {"openforge": _cells(1000, 1000, cpu_us=300), "litellm": _cells(200, 200, cpu_us=3600)}
    goal = summarize(targets, Results(samples, samples, by_key, None, {}), args)["goals"]["vs_litellm_per_core"]
    assert goal["ratios"]["16"] == pytest.approx(12.0) and goal["rps_ratios"]["16"] == pytest.approx(5.0)
    assert goal["met"] is True
    by_key["litellm"] = _cells(200, 200, cpu_us=2400)
    assert summarize(targets, Results(samples, samples, by_key, None, {}), args)["goals"]["vs_litellm_per_core"][
        "met"] is False
