"""Event ids: random uuid4s, never repeated, not even across a fork or between threads."""

from __future__ import annotations

import os
import threading
import uuid

from schemas._base import _random_ids, new_event_id


def test_ids_are_uuid4_hex_and_unique_over_many_refills() -> None:
    ids = [new_event_id() for _ in range(5_000)]  # about twenty reads from the OS
    assert len(set(ids)) == len(ids)
    for value in ids[:300]:
        parsed = uuid.UUID(value)
        assert parsed.hex == value
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122


def test_a_forked_child_does_not_repeat_its_parents_next_ids() -> None:
    while not _random_ids:  # the parent holds random bytes for its next ids
        new_event_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent, and nothing else
        try:
            os.close(read)
            os.write(write, " ".join(new_event_id() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {new_event_id() for _ in range(50)}
    assert len(child) == 50
    assert not child & parent


def test_threads_never_share_an_id() -> None:
    taken: list[list[str]] = [[] for _ in range(4)]

    def take(into: list[str]) -> None:
        into.extend(new_event_id() for _ in range(3_000))

    threads = [threading.Thread(target=take, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for into in taken for value in into]
    assert len(set(every)) == len(every) == 12_000
