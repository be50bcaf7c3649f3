"""Dead letters, version 1: records a consumer could not handle, on ``openforge.dlq.v1``.

A dead letter keeps the original record byte for byte (key, value, headers) so an operator can
inspect it and, once the cause is fixed, re-produce it unchanged to its topic.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from schemas._arrays import RawBytes
from schemas._base import EventBase
from schemas._errors import DeadLetterErrorType

__all__ = ["DeadLetterErrorType", "DeadLetterV1"]


class DeadLetterV1(EventBase):
    """A record that failed decoding or handling, with the reason.

    The Kafka key of a dead letter is the original record's key, byte for byte, so dead letters of
    one rollout stay together and in order; see :meth:`kafka_key`.
    """

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1

    topic: str = Field(min_length=1, max_length=249)
    """Topic the record was read from."""

    partition: int = Field(ge=0)
    """Partition the record was read from."""

    offset: int = Field(ge=0)
    """Offset of the record in its partition."""

    key: RawBytes | None = None
    """Original record key (base64 in JSON); absent when the record had none."""

    value: RawBytes | None = None
    """Original record value (base64 in JSON); absent for a tombstone."""

    value_truncated: bool = False
    """Whether ``value`` was cut short to fit the dead-letter topic's size limit."""

    headers: list[tuple[str, RawBytes | None]] = Field(default_factory=list)
    """Original record headers in order, as ``[name, value]`` pairs (value base64, or null)."""

    timestamp_ms: int | None = None
    """Original record timestamp, milliseconds since the epoch, when it had one."""

    error_type: DeadLetterErrorType
    """Category of the failure, for filtering and alerting."""

    reason: str = Field(min_length=1)
    """What went wrong, for a human."""

    exception_type: str | None = None
    """Qualified name of the exception class, for handler errors."""

    consumer_group: str = Field(min_length=1)
    """Consumer group that gave up on the record."""

    def partition_key(self) -> str:
        """Return the original key as text (invalid UTF-8 replaced), or ``""`` when there was none.

        For logs and metrics only; producers must use :meth:`kafka_key`, which is exact.
        """
        if self.key is None:
            return ""
        return self.key.decode("utf-8", errors="replace")

    def kafka_key(self) -> bytes | None:
        """Return the original record key unchanged (``None`` when it had none)."""
        return self.key
