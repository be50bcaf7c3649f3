"""The proxy benchmark's compiled load generator (``bench/loadgen``), against real servers.

The benchmark's throughput figures are only as good as the generator's count of answered
requests and the requests it sends, so its count must equal what the server served, every
request must carry its connection's token and a counter of its own, and a refused request must
end the run with an error rather than be counted. The servers are the benchmark's own upstream
and, for what that one cannot show (chunk extensions, trailers, a server that closes after each
answer), a small socket server in this file.
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
from pathlib import Path

import orjson
import pytest

from bench.proxy import (
    PYTHON_CLIENT,
    Cell,
    NativeLoad,
    Results,
    Target,
    build_loadgen,
    format_report,
    parse_args,
    request_template,
    round_order,
    summarize,
    throughput_cell,
)
from stream.broker import free_port

pytestmark = pytest.mark.timeout(300)  # the first build compiles the generator


@pytest.fixture(scope="module")
def loadgen() -> Path:
    return build_loadgen()


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


def _served(port: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as answer:
        stats = orjson.loads(answer.read())
    return stats["chat"], stats["streamed"]


def _spec(port: int, head: str, body: str, *, seconds: float = 0.5, base: int = 0, per_connection: int = 100,
          tokens: tuple[str, ...] = ("-",)) -> str:
    return "\n".join([str(port), str(seconds), head.replace("\r\n", "\\r\\n"), body, str(base), str(per_connection),
                      *tokens, "", "go", ""])


async def _native(loadgen: Path, target: Target, rollouts: list[str], seconds: float, base: int,
                  per_connection: int) -> tuple[int, float, float]:
    load = NativeLoad(loadgen, target, rollouts, seconds, base, per_connection)
    try:
        await load.ready()
        return await load.run()
    finally:
        await load.close()


def test_counts_what_the_server_answered(loadgen: Path, upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    before, _ = _served(upstream_port)
    ok, seconds, cpu_s = asyncio.run(_native(loadgen, target, ["a", "b", "c"], 0.5, 0, 1_000_000))
    assert ok > 100
    # The timed requests, and one untimed request per connection before the clock started.
    assert _served(upstream_port)[0] - before == ok + 3 == target.ok
    assert not target.errors
    assert 0.5 <= seconds < 5
    assert 0 < cpu_s / ok < 500e-6  # a generator that spun while waiting would exceed this


def test_stops_at_the_bound_of_requests_per_connection(loadgen: Path, upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    ok, _seconds, _cpu = asyncio.run(_native(loadgen, target, ["a", "b"], 30.0, 0, 25))
    assert ok == 2 * 24  # the untimed request is each connection's first
    assert target.ok == 50


def test_reads_chunked_answers_whole(loadgen: Path, upstream_port: int) -> None:
    head, body = request_template(upstream_port, authorized=False, stream=True)
    _, streamed_before = _served(upstream_port)
    result = subprocess.run([str(loadgen)], input=_spec(upstream_port, head, body.decode(), tokens=("-", "-")),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    fields = result.stdout.split()
    assert fields[0] == "ready"
    ok, warm = int(fields[2]), int(fields[10])
    assert ok > 10
    assert _served(upstream_port)[1] - streamed_before == ok + warm


def test_a_refused_request_is_an_error_not_a_count(loadgen: Path, upstream_port: int) -> None:
    head, _body = request_template(upstream_port, authorized=False, stream=False)
    result = subprocess.run([str(loadgen)], input=_spec(upstream_port, head, "not json {n}"),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stdout.split()[1:5] == ["ok", "0", "errors", "1"]
    assert "HTTP 400" in result.stderr


def test_nothing_listening_is_an_error(loadgen: Path) -> None:
    target = Target("direct", "direct", free_port(), lambda _rollout: None)
    ok, _seconds, _cpu = asyncio.run(_native(loadgen, target, ["a"], 0.2, 0, 10))
    assert ok == 0
    assert target.ok == 0
    assert target.errors
    assert "connect to port" in target.errors[0]


@pytest.mark.parametrize("spec", ["8000\n", "8000\n1\nhead\nbody\n0\n10\n\n", "x\n1\nhead\nbody\n0\n10\n-\n\n",
                                  "8000\n0\nhead\nbody\n0\n10\n-\n\n"],
                         ids=["one-line", "no-connection", "bad-port", "no-time"])
def test_a_malformed_spec_is_refused(loadgen: Path, spec: str) -> None:
    result = subprocess.run([str(loadgen)], input=spec, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "ready" not in result.stdout
    assert "openforge-loadgen:" in result.stderr


def test_no_go_no_load(loadgen: Path, upstream_port: int) -> None:
    head, body = request_template(upstream_port, authorized=False, stream=False)
    spec = _spec(upstream_port, head, body.decode()).replace("go\n", "stop\n")
    before, _ = _served(upstream_port)
    result = subprocess.run([str(loadgen)], input=spec, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert 'expected "go"' in result.stderr
    assert _served(upstream_port)[0] - before == 1  # the untimed request alone


class _RecordingServer:
    """HTTP/1.1 on a socket: records every request; answers chunked (with a chunk extension and a
    trailer) or with a content length and ``connection: close``."""

    def __init__(self, *, close: bool) -> None:
        self.close = close
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
                if self.close:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"5;ext=1\r\nhello\r\n3\r\n\r\nx\r\n0\r\nx-trailer: 1\r\n\r\n")

    def stop(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("close", [False, True], ids=["chunked-with-trailer", "close-after-each"])
def test_every_request_is_its_connections_own(loadgen: Path, close: bool) -> None:
    server = _RecordingServer(close=close)
    try:
        head, body = request_template(server.port, authorized=True, stream=False)
        result = subprocess.run([str(loadgen)], input=_spec(server.port, head, body.decode(), seconds=0.3, base=1000,
                                                            per_connection=40, tokens=("tok-0", "tok-1")),
                                capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    ok = int(result.stdout.split()[2])
    assert len(server.requests) == ok + 2
    counters = []
    for _number, req_head, req_body in server.requests:
        token = re.search(rb"authorization: Bearer (tok-\d)\r\n", req_head)
        assert token is not None
        assert int(re.search(rb"content-length: (\d+)", req_head).group(1)) == len(req_body)  # type: ignore[union-attr]
        message = orjson.loads(req_body)["messages"][1]["content"]
        counter = int(re.match(r"Step (\d+):", message).group(1))  # type: ignore[union-attr]
        # Connection k counts from base + k * per_connection.
        assert (counter - 1000) // 40 == int(token.group(1)[-1:])
        counters.append(counter)
    assert len(set(counters)) == len(counters)
    if close:
        assert server.connections == len(server.requests)  # a new connection after each answer
    else:
        assert server.connections == 2


def test_a_native_cell_counts_and_charges_the_generator(loadgen: Path, upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    before, _ = _served(upstream_port)
    cell = asyncio.run(throughput_cell(target, 4, 0.5, 100_000, 0, None, None, loadgen=loadgen))
    assert cell.errors == 0
    assert cell.requests > 100
    assert _served(upstream_port)[0] - before == cell.requests + 4 == target.ok
    assert cell.requests / cell.rps >= 0.5  # the elapsed time covers the whole load
    assert 0 < cell.client_cpu_us < 1_000


def test_both_generators_are_reported_side_by_side() -> None:
    """``--loadgen both``: each client's cells under their own key, ratio and rounds, in the table."""
    targets = [Target("direct", "direct (upstream)", 1, lambda _r: None),
               Target("openforge", "openforge, capture on", 2, lambda _r: None),
               Target("openforge-nocap", "openforge, capture off", 3, lambda _r: None)]
    args = parse_args(["--loadgen", "both", "--concurrency", "16", "--skip-litellm"])

    def cells(*rps: float) -> dict[int, list[Cell]]:
        return {16: [Cell(rps=r, requests=100, errors=0, server_cpu_us=1, server_own_cpu_us=1, upstream_cpu_us=1,
                          broker_cpu_us=1, client_cpu_us=1) for r in rps]}

    by_key = {"direct": cells(9e4), "direct" + PYTHON_CLIENT: cells(4e4),
              "openforge": cells(4000, 4200), "openforge" + PYTHON_CLIENT: cells(3700, 3600),
              "openforge-nocap": cells(5000, 5000), "openforge-nocap" + PYTHON_CLIENT: cells(5000, 4800)}
    samples = {"direct": [0.1] * 5, "openforge": [0.6] * 5, "openforge-nocap": [0.55] * 5}
    summary = summarize(targets, Results(samples, samples, by_key, None, {}), args)
    compiled, python = summary["goals"]["capture_on_vs_off"], summary["goals"]["capture_on_vs_off_python_client"]
    assert compiled["ratios"]["16"] == pytest.approx(4100 / 5000)
    assert compiled["rounds"]["16"] == pytest.approx([0.80, 0.84])
    assert compiled["paired"]["16"] == pytest.approx(0.82)
    assert python["ratios"]["16"] == pytest.approx(3650 / 4900)
    assert python["rounds"]["16"] == pytest.approx([0.74, 0.75])
    assert python["paired"]["16"] == pytest.approx(0.745)
    assert compiled["met"] is True
    assert python["met"] is False
    report = format_report(targets, summary, args)
    assert "openforge, capture on [python]" in report
    assert "openforge, capture on [native]" in report
    assert "throughput, compiled client: MET (c=16 82.0% (rounds 80%-84%; of medians 82%))" in report
    assert "throughput, python client: MISSED (c=16 74.5% (rounds 74%-75%; of medians 74%))" in report


def test_capture_on_and_off_run_back_to_back_in_alternating_order() -> None:
    """Every round runs the goal's two cells next to each other, each first in every other turn."""
    names = ["direct", "openforge", "openforge-inline", "openforge-ack", "openforge-nocap", "litellm"]
    targets = [Target(n, n, i, lambda _r: None) for i, n in enumerate(names)]
    firsts = []
    for turn in range(12):
        for generators in (["native"], ["native", "python"]):
            order = [(t.name, g) for t, g in round_order(targets, generators, turn)]
            assert sorted(order) == sorted((n, g) for n in names for g in generators)
            for k, g in enumerate(generators):
                cells = [n for n, gen in order if gen == g]
                on, off = cells.index("openforge"), cells.index("openforge-nocap")
                assert abs(on - off) == 1
                assert (on < off) == ((turn + k) % 2 == 0)  # each client's order alternates with the turn
            pairs = [i for i, (n, _g) in enumerate(order) if n in ("openforge", "openforge-nocap")]
            assert pairs == list(range(pairs[0], pairs[0] + 2 * len(generators)))
        single = [t.name for t, _g in round_order(targets, ["native"], turn)]
        firsts.append(single[0])
        assert (single.index("openforge") < single.index("openforge-nocap")) == (turn % 2 == 0)
    assert set(firsts) >= {"direct", "openforge-inline", "openforge-ack", "litellm"}  # the order rotates
    # Without a capture-off target nothing is paired, and the order only rotates.
    rest = [t for t in targets if t.name != "openforge-nocap"]
    assert [t.name for t, _g in round_order(rest, ["native"], 1)] == [*names[1:4], "litellm", "direct"]


def test_the_verdict_reads_the_paired_rounds() -> None:
    """A round disturbed for one side moves the ratio of medians, not the median of paired ratios."""
    targets = [Target("openforge", "openforge, capture on", 2, lambda _r: None),
               Target("openforge-nocap", "openforge, capture off", 3, lambda _r: None)]
    args = parse_args(["--concurrency", "16", "--skip-litellm"])

    def cells(*rps: float) -> dict[int, list[Cell]]:
        return {16: [Cell(rps=r, requests=100, errors=0, server_cpu_us=1, server_own_cpu_us=1, upstream_cpu_us=1,
                          broker_cpu_us=1, client_cpu_us=1) for r in rps]}

    # Rounds 1-3 ran on a slow machine, rounds 4-5 on a fast one, each pair keeping 85 %, except
    # that in round 3 capture off's cell alone had the fast machine.
    by_key = {"openforge": cells(2550, 2550, 2550, 4250, 4250), "openforge-nocap": cells(3000, 3000, 3000, 5000, 5000)}
    by_key["openforge-nocap"][16][2] = Cell(rps=5000, requests=100, errors=0, server_cpu_us=1, server_own_cpu_us=1,
                                            upstream_cpu_us=1, broker_cpu_us=1, client_cpu_us=1)
    samples = {"openforge": [0.6] * 5, "openforge-nocap": [0.55] * 5}
    summary = summarize(targets, Results(samples, samples, by_key, None, {}), args)
    goal = summary["goals"]["capture_on_vs_off"]
    assert goal["ratios"]["16"] == pytest.approx(2550 / 5000)  # medians from different machines
    assert goal["paired"]["16"] == pytest.approx(0.85)
    assert goal["met"] is True
    by_key["openforge"][16][:] = cells(2300, 2300, 2300, 3900, 3900)[16]
    assert summarize(targets, Results(samples, samples, by_key, None, {}), args)["goals"]["capture_on_vs_off"][
        "met"] is False
