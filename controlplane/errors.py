"""The one error shape of the API: ``{"detail": "...", "code": "..."}``.

Services raise :class:`ApiError` (or its subclasses); the handlers registered on the NinjaAPI
root turn it, ninja's validation errors and Django's usual exceptions into that shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from ninja import Schema

# The scenario reader names key paths the same way: one rendering for both.
from scheduling.core.scenario_types import location_path

#: What a caller is told when no usable credential came with the request.
UNAUTHORIZED_DETAIL = "missing, invalid, expired or revoked API token"
#: Where ninja says a value came from; the key path a client reads leaves it out.
_LOCATION_SOURCES = frozenset({"body", "query", "path", "payload"})


class ApiError(Exception):
    """An error a client caused, with a stable machine-readable ``code``."""

    status = 400
    code = "bad_request"

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None):
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def payload(self) -> dict[str, Any]:
        return {"detail": self.detail, "code": self.code}


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class Invalid(ApiError):
    """Input that parses but breaks a domain rule (sorted tables, link direction, ...)."""

    status = 422
    code = "invalid"


class Forbidden(ApiError):
    status = 403
    code = "forbidden"


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


class PayloadTooLarge(ApiError):
    status = 413
    code = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")


class ErrorOut(Schema):
    """The one error shape, as the OpenAPI document states it."""

    detail: str
    code: str


def error_json(detail: str, code: str) -> bytes:
    return orjson.dumps({"detail": detail, "code": code})


def validation_detail(errors: Iterable[Mapping[str, Any]]) -> str:
    """pydantic/ninja validation errors as one line: ``key.path: message; ...``."""
    messages = []
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p not in _LOCATION_SOURCES]
        path = location_path(loc)
        msg = err.get("msg", "invalid")
        messages.append(f"{path}: {msg}" if path else msg)
    return "; ".join(messages) or "invalid input"
