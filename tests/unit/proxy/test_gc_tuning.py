"""The proxy process's garbage-collector tuning (its effect is measured by bench/proxy.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_startup_heap_is_frozen_and_the_first_generation_enlarged() -> None:
    # In a fresh interpreter: freezing changes the whole process, which a test run must not share.
    script = ("import gc\nfrom proxy.app import _freeze_startup_heap\nbefore = gc.get_freeze_count()\n"
              "_freeze_startup_heap()\nprint(before, gc.get_freeze_count(), gc.get_threshold()[0])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    before, after, threshold = map(int, out.stdout.split())
    assert before == 0 and after > 10_000  # the imported modules and their objects
    assert threshold == 10_000
