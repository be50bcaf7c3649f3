"""A verifier for tests: the first digit of the workspace's answer, over 3, reported with `openforge reward`."""

import json
import re
import subprocess
import sys
from pathlib import Path


def main() -> int:
    answer = Path("answer.txt").read_text() if Path("answer.txt").is_file() else ""
    found = re.search(r"\d", answer)
    value = min(int(found.group()), 3) / 3 if found else 0.0
    return subprocess.call([sys.executable, "-m", "openforge", "reward", "--value", str(value),
                            "--info", json.dumps({"answer": answer[:80]})])


if __name__ == "__main__":
    sys.exit(main())
