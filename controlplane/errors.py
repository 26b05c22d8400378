"""The one error shape of the API: ``{"detail": "...", "code": "..."}``.

Services raise :class:`ApiError` (or its subclasses); the handlers registered on the NinjaAPI
root turn it, ninja's validation errors and Django's usual exceptions into that shape.
"""

from __future__ import annotations

from typing import Any


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


def location_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """Render a validation location as a key path: ``profiles[1].prefill_seconds[3]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
