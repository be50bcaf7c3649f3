"""The proxy benchmark's compiled load generator (``bench/loadgen``) against the benchmark's real upstream.

The benchmark's throughput figures are only as good as its count of answered requests, so the
generator's count must equal what the server says it served, and a refused request must end the
run with an error rather than be counted.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from bench.proxy import Target, build_loadgen, native_load, request_template
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


def _served(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as answer:
        served: int = orjson.loads(answer.read())["chat"]
    return served


def test_counts_what_the_server_answered(loadgen: Path, upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    before = _served(upstream_port)
    ok, seconds, cpu_s = asyncio.run(native_load(loadgen, target, ["a", "b", "c"], 0.5, 0, 1_000_000))
    assert ok > 0
    assert _served(upstream_port) - before == ok
    assert target.ok == ok and not target.errors
    assert 0.5 <= seconds < 5
    assert cpu_s >= 0


def test_stops_at_the_bound_of_requests_per_connection(loadgen: Path, upstream_port: int) -> None:
    target = Target("direct", "direct", upstream_port, lambda _rollout: None)
    ok, _seconds, _cpu = asyncio.run(native_load(loadgen, target, ["a", "b"], 30.0, 0, 25))
    assert ok == 50


def test_a_refused_request_is_an_error_not_a_count(loadgen: Path, upstream_port: int) -> None:
    head, _body = request_template(upstream_port, authorized=False, stream=False)
    spec = "\n".join([str(upstream_port), "0.5", head.replace("\r\n", "\\r\\n"), "not json {n}", "0", "100", "-"])
    result = subprocess.run([str(loadgen)], input=spec + "\n", capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stdout.split()[:4] == ["ok", "0", "errors", "1"]
    assert "HTTP 400" in result.stderr


def test_nothing_listening_is_an_error(loadgen: Path) -> None:
    target = Target("direct", "direct", free_port(), lambda _rollout: None)
    ok, _seconds, _cpu = asyncio.run(native_load(loadgen, target, ["a"], 0.2, 0, 10))
    assert ok == 0
    assert target.errors and "connect to port" in target.errors[0]


def test_a_malformed_spec_is_refused(loadgen: Path) -> None:
    result = subprocess.run([str(loadgen)], input="8000\n", capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "expected at least 7 lines" in result.stderr
