"""Errors raised while encoding, decoding and registering events."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import ClassVar

__all__ = [
    "DeadLetterErrorType",
    "DecodeError",
    "DuplicateSchemaError",
    "InvalidEventError",
    "MissingSchemaHeaderError",
    "RegistryError",
    "UndecodableEventError",
    "UnknownSchemaError",
    "UnregisteredEventError",
]


class DeadLetterErrorType(StrEnum):
    """Why a record went to the dead-letter topic.

    Every :class:`DecodeError` carries one of these as ``kind`` so a consumer can dead-letter a
    record without mapping exception classes itself.
    """

    MISSING_SCHEMA = "missing_schema"
    """The record has no (or a malformed) schema name or version header."""
    UNKNOWN_SCHEMA = "unknown_schema"
    """The schema name/version pair is not registered in this consumer's build."""
    UNDECODABLE = "undecodable"
    """The value is not UTF-8 JSON (or is absent), so it could not be parsed at all."""
    INVALID_EVENT = "invalid_event"
    """The value is JSON but does not validate against the registered model."""
    HANDLER_ERROR = "handler_error"
    """The event decoded fine but the consumer's handler failed on it."""
    REFUSED_BY_BROKER = "refused_by_broker"
    """Kafka would not store the record (larger than its topic takes, a policy), so the proxy's
    shipper sent it here rather than stop every record behind it (``openforge topics redrive``
    sends it back once the topic takes it)."""


class DecodeError(Exception):
    """A Kafka record could not be turned into an event.

    Consumers catch this one class, dead-letter the record with ``kind`` and ``reason``, and keep
    running: one bad record must not stop a partition.
    """

    kind: ClassVar[DeadLetterErrorType]
    """Dead-letter category of this failure."""

    def __init__(self, reason: str) -> None:
        """Create the error.

        Args:
            reason: Human-readable explanation, stored on the dead letter as is.
        """
        super().__init__(reason)
        self.reason = reason


class MissingSchemaHeaderError(DecodeError):
    """The schema name or version header is absent or malformed."""

    kind = DeadLetterErrorType.MISSING_SCHEMA

    def __init__(self, reason: str, *, header: str) -> None:
        """Create the error.

        Args:
            reason: Human-readable explanation.
            header: Name of the header that is missing or malformed.
        """
        super().__init__(reason)
        self.header = header


class UnknownSchemaError(DecodeError):
    """No model is registered under the schema name and version of a record."""

    kind = DeadLetterErrorType.UNKNOWN_SCHEMA

    def __init__(self, name: str, version: int, known_versions: Sequence[int]) -> None:
        """Create the error.

        Args:
            name: Schema name from the record.
            version: Schema version from the record.
            known_versions: Versions of ``name`` that are registered (possibly none).
        """
        if known_versions:
            known = ", ".join(str(v) for v in sorted(known_versions))
            detail = f"known versions of {name!r}: {known}"
        else:
            detail = f"no version of {name!r} is registered"
        super().__init__(f"unknown schema {name!r} version {version}; {detail}")
        self.name = name
        self.version = version
        self.known_versions = tuple(sorted(known_versions))


class UndecodableEventError(DecodeError):
    """The record value is not UTF-8 JSON."""

    kind = DeadLetterErrorType.UNDECODABLE


class InvalidEventError(DecodeError):
    """The record value is JSON but fails validation against its registered model."""

    kind = DeadLetterErrorType.INVALID_EVENT

    def __init__(self, reason: str, *, name: str, version: int, error_count: int) -> None:
        """Create the error.

        Args:
            reason: Compact summary of the validation errors.
            name: Schema name the value was validated against.
            version: Schema version the value was validated against.
            error_count: Total number of validation errors (the reason may show fewer).
        """
        super().__init__(reason)
        self.name = name
        self.version = version
        self.error_count = error_count


class RegistryError(Exception):
    """Misuse of the event registry: a programming error, not bad data."""


class DuplicateSchemaError(RegistryError, ValueError):
    """A different class is already registered under the same schema name and version."""


class UnregisteredEventError(RegistryError, LookupError):
    """An event class was encoded without being registered, so no consumer could decode it."""
