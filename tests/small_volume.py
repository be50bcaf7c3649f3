"""A small filesystem of a test's own: a tmpfs, mounted where only the test's commands see it.

The journal's space rules are about small volumes, and a test's temporary folder sits on a disk
of hundreds of GiB. Mounting a tmpfs of a few MiB needs no root where unprivileged user
namespaces are allowed (the kernel's default): ``unshare --user --map-root-user --mount`` makes
the commands root of a namespace of their own, whose mount nobody outside sees. The test reaches
them over the network (one network namespace for all) and reads what they print.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path


def on_small_volume(size_mib: int, mount_at: Path, *commands: Sequence[str]) -> list[str]:
    """argv that mounts a tmpfs of ``size_mib`` MiB at ``mount_at`` (an existing folder), then runs
    ``commands`` one after the other on it; it exits with the last one's status."""
    script = " && ".join([f"mount -t tmpfs -o size={size_mib}m openforge-test {shlex.quote(str(mount_at))}",
                          *(shlex.join(command) for command in commands[:1])])
    for command in commands[1:]:
        # Each later command runs whatever became of the one before (a test may kill it).
        script += f"; {shlex.join(command)}"
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]
