"""A tiny verifier for tests: scores the workspace's answer file and reports with `openforge reward`.

Usage: check_answer.py [crash]. With "crash" it dies before reporting, as a broken verifier would.
"""

import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "crash":
        raise RuntimeError("verifier crashed on purpose")
    answer = Path("answer.txt")
    value = 1.0 if answer.is_file() and answer.read_text().strip() else 0.0
    info = {"answer_chars": len(answer.read_text()) if answer.is_file() else 0}
    return subprocess.call([sys.executable, "-m", "openforge", "reward", "--value", str(value),
                            "--info", json.dumps(info)])


if __name__ == "__main__":
    sys.exit(main())
