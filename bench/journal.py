"""The proxy's journal append of a whole answer: the compiled frame writer against the Python path.

Run from the repository root with ``python -m bench.journal``.

The proxy journals every whole answer on its event loop (``JournalPublisher.publish_call``): the
record's metadata is made (``raw_exchange_parts``) and the frame is written
(``Journal.append_parts``), by the compiled writer (``native/src/frame.rs``) when it is
installed. Both writers append the same records, of ``bench.proxy``'s call shape, to journals of
their own in one folder, alternating round by round in this process, so the machine's noise
falls on both alike. The figures are microseconds per record, wall and CPU (this process's user
and system time), medians over ``--rounds``; ``recorded`` includes making the metadata, as the
proxy does per call. Compare the two rows of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import producers.journal as journal_module
from bench.shipper import whole_answer_calls
from producers.capture import CallCapture
from producers.journal import Journal
from producers.raw_calls import EngineExchange, raw_exchange_parts

_WRITERS = ("compiled", "python")


def _call(prompt_tokens: int, completion_tokens: int) -> tuple[CallCapture, EngineExchange]:
    """One whole answer as the proxy holds it when it records the call (``bench.shipper``'s first)."""
    [call] = whole_answer_calls(prompt_tokens, completion_tokens, 1)
    return call


def _round(records: int, append: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU microseconds per record over ``records`` appends."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(records):
        append()
    return ((time.perf_counter() - wall) / records * 1e6, (time.process_time() - cpu) / records * 1e6)


def run(args: argparse.Namespace, folder: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Every round of both writers, written (the frame alone) and recorded (metadata and frame)."""
    native = journal_module._native_append_frame
    if native is None:
        raise SystemExit("openforge_native is not installed: `make install` builds it (needs cargo)")
    capture, exchange = _call(args.prompt_tokens, args.completion_tokens)
    topic, key, parts = raw_exchange_parts(capture, exchange, upstream_status_code=200, upstream_replica="r0")
    results: dict[str, dict[str, list[tuple[float, float]]]] = {w: {"written": [], "recorded": []} for w in _WRITERS}
    try:
        for number in range(args.rounds):
            for writer in _WRITERS if number % 2 == 0 else reversed(_WRITERS):
                journal_module._native_append_frame = native if writer == "compiled" else None
                # A journal of its own per round, removed after it: both writers append to new
                # files, as the proxy does after every segment roll, and the disk is not filled.
                journal = Journal(folder / f"{writer}-{number}", 1 << 40)
                journal.open()
                try:
                    results[writer]["written"].append(
                        _round(args.records, lambda j=journal: j.append_parts(topic, key, parts, ())))

                    def record(j: Journal = journal) -> None:
                        t, k, p = raw_exchange_parts(capture, exchange, upstream_status_code=200,
                                                     upstream_replica="r0")
                        j.append_parts(t, k, p, ())

                    results[writer]["recorded"].append(_round(args.records, record))
                finally:
                    journal.close()
                    shutil.rmtree(folder / f"{writer}-{number}")
            print(f"[bench] round {number + 1}/{args.rounds}", flush=True)
    finally:
        journal_module._native_append_frame = native
    return results


def report(results: dict[str, dict[str, list[tuple[float, float]]]], record_bytes: int) -> str:
    """The table: medians per writer, and the compiled writer's share of the Python path's time."""
    lines = [f"{'per whole answer (' + str(record_bytes) + ' B)':34}{'written wall':>14}{'CPU':>8}"
             f"{'recorded wall':>15}{'CPU':>8}  us", "-" * 79]
    medians = {w: {kind: tuple(statistics.median(r[i] for r in rows) for i in (0, 1))
                   for kind, rows in results[w].items()} for w in _WRITERS}
    for writer in _WRITERS:
        m = medians[writer]
        lines.append(f"{writer + ' writer':34}{m['written'][0]:14.2f}{m['written'][1]:8.2f}"
                     f"{m['recorded'][0]:15.2f}{m['recorded'][1]:8.2f}")
    c, p = medians["compiled"], medians["python"]
    w, r = [c["written"][i] / p["written"][i] for i in (0, 1)], [c["recorded"][i] / p["recorded"][i] for i in (0, 1)]
    lines.append(f"{'compiled / python':34}{w[0]:13.0%} {w[1]:7.0%}{r[0]:14.0%} {r[1]:7.0%}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.journal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000, help="appends per writer per round (default 10000)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the writers alternating (default 6)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="prompt_token_ids per answer (default 400)")
    parser.add_argument("--completion-tokens", type=int, default=32, help="completion tokens per answer (default 32)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder for the journals (default: a temporary one; put it on the proxy's disk)")
    args = parser.parse_args(argv)
    if args.records < 1 or args.rounds < 1:
        parser.error("--records and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="openforge-bench-journal-", dir=args.dir) as tmp:
        results = run(args, Path(tmp))
        capture, exchange = _call(args.prompt_tokens, args.completion_tokens)
        _topic, _key, parts = raw_exchange_parts(capture, exchange, upstream_status_code=200, upstream_replica="r0")
        print(report(results, sum(map(len, parts))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
