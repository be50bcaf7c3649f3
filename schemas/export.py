"""JSON Schema documents for every registered event, for readers outside Python.

Nothing is written to disk here (``schemas`` does no I/O); the command-line tooling decides where
the documents go.
"""

from __future__ import annotations

from typing import Any

from schemas._base import EventBase
from schemas.registry import all_events

__all__ = ["JSON_SCHEMA_DIALECT", "event_json_schema", "json_schemas", "schema_file_name"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
"""The JSON Schema dialect pydantic generates."""


def schema_file_name(cls: type[EventBase]) -> str:
    """Return the file name of an event's schema document, e.g. ``model_call.v1.schema.json``."""
    return f"{cls.SCHEMA}.v{cls.VERSION}.schema.json"


def event_json_schema(cls: type[EventBase]) -> dict[str, Any]:
    """Return the JSON Schema of one event class.

    The schema describes the value as producers write it. It is generated in validation mode,
    so fields with defaults are optional, which matches what :func:`schemas.decode` accepts;
    packed token arrays appear as base64 strings whose description gives the element format.
    """
    document = cls.model_json_schema(mode="validation")
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": schema_file_name(cls),
        "x-schema": cls.SCHEMA,
        "x-schema-version": cls.VERSION,
        **document,
    }


def json_schemas() -> dict[str, dict[str, Any]]:
    """Return the JSON Schema of every registered event, keyed by file name.

    Returns:
        ``{"model_call.v1.schema.json": {...}, ...}`` in name/version order.
    """
    return {schema_file_name(cls): event_json_schema(cls) for cls in all_events()}
