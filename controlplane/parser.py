"""Strict JSON bodies for the API: RFC 8259 JSON, or a clear 4xx in the error shape.

Python's ``json`` reads more than JSON: ``NaN``, ``Infinity`` and ``1e400`` (as infinity,
which then failed the audit write with a 500), UTF-16 and UTF-32 bodies (detected from the
bytes), and ninja took any content type. Here a body may not be declared as anything but JSON
(415; none declared is read as JSON), must be UTF-8 (400), hold only finite numbers (422), no
NUL character (PostgreSQL text cannot store one: 422), nest less than orjson's limit (400) and
be an object (every body of this API is one: 422).

The check runs in :class:`controlplane.middleware.StrictJsonMiddleware`, before ninja: ninja
turns any error of its parser into a bare 400. The parsed body is kept on the request and
:class:`StrictJsonParser` hands it to ninja, so a body is parsed once.
"""

from __future__ import annotations

from typing import Any, cast

import orjson
from django.http import HttpRequest
from ninja.parser import Parser
from ninja.types import DictStrAny

from controlplane.errors import ApiError, Invalid

JSON_TYPES = ("application/json",)
# Bodies another parser reads: the KV-event frames endpoint checks its own, and forms (a page's
# htmx post of an operation without a body) are no JSON to check; an operation that wants JSON
# refuses them when it parses.
OTHER_BODY_TYPES = (
    "application/msgpack",
    "application/x-msgpack",
    "application/vnd.msgpack",
    "multipart/form-data",
    "application/x-www-form-urlencoded",
)
_PARSED = "_strict_json_body"


def json_content_type_check(content_type: str | None) -> None:
    """415 for a body declared as something else than JSON (``text/plain``, a form). No
    declaration at all is read as JSON: routers and scripts often send none."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype and ctype not in JSON_TYPES and not ctype.endswith("+json"):
        raise ApiError(
            f"content type {ctype or 'none'!r}: send application/json",
            code="unsupported_media_type",
            status=415,
        )


def json_strict_loads(body: bytes) -> Any:
    """``body`` as strict JSON, or the 4xx that says why not."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError("the body must be UTF-8 JSON", code="invalid_encoding", status=400) from None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "infinity" in str(exc):
            raise Invalid(f"a number out of range (must be finite): {exc}") from None
        raise ApiError(f"Cannot parse request body: {exc}", code="http_400", status=400) from None
    if b"\\u0000" in body:
        raise Invalid("the body contains a NUL character (\\u0000)")
    if not isinstance(data, dict):
        raise Invalid(f"the body must be a JSON object, got {type(data).__name__}")
    return data


def json_body_check(request: HttpRequest) -> None:
    """Check an API request's JSON body (raises the 4xx) and keep it parsed on the request."""
    if request.method not in ("POST", "PUT", "PATCH") or not request.body:
        return
    ctype = (request.content_type or "").split(";")[0].strip().lower()
    if ctype in OTHER_BODY_TYPES:
        return
    json_content_type_check(ctype)
    setattr(request, _PARSED, json_strict_loads(request.body))


class StrictJsonParser(Parser):
    """Ninja's parser: the body the middleware checked (parsed once)."""

    def parse_body(self, request: HttpRequest) -> DictStrAny:
        parsed = getattr(request, _PARSED, None)
        if parsed is None:
            parsed = json_strict_loads(request.body)
        return cast(DictStrAny, parsed)
