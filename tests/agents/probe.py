"""A scriptable stand-in harness/verifier for backend tests (no model calls).

Usage: probe.py LOG [sleep SECONDS] [exit CODE] [env FILE] [hang]
Appends "<rollout id> start <time>" and "... end <time>" lines to LOG (outside the workspace),
optionally sleeps, dumps its environment as JSON to FILE, hangs ignoring SIGTERM, or exits CODE.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    log = Path(sys.argv[1])
    args = sys.argv[2:]
    rollout = os.environ.get("OPENFORGE_ROLLOUT_ID", "?")
    with log.open("a") as out:
        out.write(f"{rollout} start {time.time()}\n")
    code = 0
    while args:
        op = args.pop(0)
        if op == "sleep":
            time.sleep(float(args.pop(0)))
        elif op == "exit":
            code = int(args.pop(0))
        elif op == "env":
            Path(args.pop(0)).write_text(json.dumps(dict(os.environ)))
        elif op == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(3600)
    with log.open("a") as out:
        out.write(f"{rollout} end {time.time()}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
