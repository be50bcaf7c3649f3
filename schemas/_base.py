"""Base classes shared by every event and its nested parts."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Annotated, ClassVar

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field

__all__ = ["EventBase", "FrozenModel", "UtcDatetime", "new_event_id"]


def _to_utc(value: datetime) -> datetime:
    # Producers run in pods with arbitrary TZ settings; normalising to UTC keeps the wire form
    # ("...Z") and comparisons uniform no matter which offset a producer used.
    return value.astimezone(UTC)


UtcDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc)]
"""A timezone-aware instant, normalised to UTC. Naive datetimes are rejected: their meaning
depends on the producing machine's clock settings, which consumers cannot know."""


_ID_BYTES = 16
_IDS_PER_READ = 256
_random_ids: list[bytearray] = []
"""Random bytes for the next ids, read from the OS 256 ids at a time: the proxy takes two ids per
call, and under load each ``getrandom`` call cost it microseconds. ``list.pop`` is atomic, so
threads never share an id; a refill that races another only reads more."""


def _forget_random_ids() -> None:
    # A forked child must not hand out the ids its parent will hand out too.
    _random_ids.clear()


os.register_at_fork(after_in_child=_forget_random_ids)


def new_event_id() -> str:
    """A random uuid4 in hex, as ``uuid.uuid4().hex`` gives but in a fraction of its time.

    Every event and every proxied call needs one; ``uuid.UUID``'s constructor is pure Python
    and showed up in profiles of the proxy.
    """
    try:
        raw = _random_ids.pop()
    except IndexError:
        # Built apart and one kept: other threads may empty the list again before this one
        # would pop from it.
        block = os.urandom(_ID_BYTES * _IDS_PER_READ)
        fresh = [bytearray(block[i:i + _ID_BYTES]) for i in range(0, len(block), _ID_BYTES)]
        raw = fresh.pop()
        _random_ids.extend(fresh)
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()


def _utc_now() -> datetime:
    return datetime.now(UTC)


class FrozenModel(BaseModel):
    """Immutable, closed pydantic model used for events and their nested parts.

    ``extra="forbid"`` turns a producer/consumer version skew into a loud validation error at
    the consumer (and a dead letter) instead of silently dropped data; ``frozen`` lets events be
    shared between tasks without defensive copies. Floats must be finite because plain JSON has
    no spelling for NaN or infinity; token logprobs, which may legitimately be ``-inf``, use the
    packed :class:`~schemas.Logprobs` type instead.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )


class EventBase(FrozenModel):
    """Common envelope of every event published to Kafka.

    Subclasses set ``SCHEMA`` and ``VERSION`` (carried in Kafka headers, see
    :mod:`schemas.registry`) and implement :meth:`partition_key`. Additive, optional fields are
    a minor change within a version; anything else is a new major version in a new module.
    """

    SCHEMA: ClassVar[str]
    """Schema name, stable across versions (e.g. ``"model_call"``)."""
    VERSION: ClassVar[int]
    """Major version of the schema; bumped only for breaking changes."""

    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=128)
    """Unique id of this event (uuid4 hex by default). Consumers use it to drop duplicates that
    producer retries or spool replays can create, so a re-sent event must keep its id."""

    created_at: UtcDatetime = Field(default_factory=_utc_now)
    """When the producer created the event (UTC). Not the Kafka timestamp: spooled events are
    produced later than they happened, and this keeps the original time."""

    def partition_key(self) -> str:
        """Return the Kafka record key as text, per the topic table in the architecture.

        The key decides the partition, and so which consumer instance sees the event and in
        which order: every event of one rollout shares a key so one assembler joins it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define a partition key")

    def packed_items(self) -> int:
        """How many packed array items (token ids, logprobs, mask entries) the event holds.

        Lets the encoder pick the faster JSON path for the event's shape; events without
        packed arrays hold none.
        """
        return 0

    def kafka_key(self) -> bytes | None:
        """Return the exact bytes to use as the Kafka record key.

        This is :meth:`partition_key` in UTF-8 for every event except dead letters, which keep
        the original record's key byte for byte (possibly not UTF-8, possibly absent). Producers
        should always use this method rather than encoding :meth:`partition_key` themselves.
        """
        return self.partition_key().encode("utf-8")
