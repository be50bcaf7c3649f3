"""OpenForge's compiled fast path (``native/src/lib.rs``)."""

from collections.abc import Sequence

MAX_ID: int
MAX_VERSION: int
MAX_EVENT_ID: int
PROTOCOLS: list[str]
CREDENTIAL_HEADERS: list[str]
SAMPLING_KEYS: list[str]
CAPTURE_KEYS: list[str]
STRUCTURE_KEYS: list[str]

def exchange_event(record: bytes) -> tuple[bytes, str, list[tuple[str, bytes]]] | None:
    """A raw exchange journal record's ``ModelCallV1`` JSON, rollout id and trace headers.

    None when the Python path must decide (``producers.raw_calls.ship_record``).
    """

RECORD_MAGIC: bytes

def append_frame(fd: int, seq: int, topic: str, key: bytes, parts: Sequence[bytes]) -> int:
    """Append journal record ``seq``'s frame (no headers, the value ``parts`` joined) to ``fd``.

    Returns the frame's size in bytes. Raises ``OSError`` as ``os.writev`` would.
    """
