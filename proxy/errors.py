"""Errors the proxy turns into HTTP answers the harness understands."""

from __future__ import annotations


class ProxyError(Exception):
    """Base of errors with an HTTP status; the message is shown to the client."""

    status_code: int = 500
    error_type: str = "api_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(ProxyError):
    """The request is malformed: bad JSON, wrong types, missing fields (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedFeatureError(InvalidRequestError):
    """The request uses something that cannot be translated for the engine (400).

    ``field`` is the JSON path of the offending part (``messages[2].content[0].type``),
    so a harness author sees at once what to turn off.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"unsupported field {field}: {detail}")
        self.field = field
        self.detail = detail
