"""The API's JSON body parser: strict JSON, as RFC 8259 says it, or a clear 4xx.

Python's ``json`` reads more than JSON: ``NaN``, ``Infinity`` and ``1e400`` (as infinity,
which then failed the audit write with a 500), UTF-16 and UTF-32 bodies (detected from the
bytes), and any content type. Here a body must not be declared as anything but JSON (415), be UTF-8
(400), hold only finite numbers and no NUL character (PostgreSQL text cannot store one: 422),
nest no deeper than the interpreter can parse (400, not a RecursionError), and be an object
(every body of this API is one: 422).
"""

from __future__ import annotations

import json
import math
from typing import Any, cast

from django.http import HttpRequest
from ninja.parser import Parser
from ninja.types import DictStrAny

from controlplane.errors import ApiError, Invalid

JSON_TYPES = ("application/json",)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Invalid(f"number {text[:40]}: out of range (must be finite)", code="invalid")
    return value


def _no_constants(name: str) -> Any:
    raise Invalid(f"{name}: not a JSON number (must be finite)", code="invalid")


def json_strict_loads(body: bytes) -> Any:
    """``body`` as strict JSON, or the 4xx that says why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError("the body must be UTF-8 JSON", code="invalid_encoding", status=400) from None
    if "\\u0000" in text:
        raise Invalid("the body contains a NUL character (\\u0000)", code="invalid")
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise ApiError(f"Cannot parse request body: {exc}", code="http_400", status=400) from None
    except RecursionError:
        raise ApiError("the body nests too deeply", code="http_400", status=400) from None


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


class StrictJsonParser(Parser):
    """Ninja's parser, strict (see the module docstring)."""

    def parse_body(self, request: HttpRequest) -> DictStrAny:
        json_content_type_check(request.content_type)
        data = json_strict_loads(request.body)
        # Every body of this API is an object; a list read as a schema of optional fields
        # was an empty change (PATCH ``[null, null]`` answered 200 and bumped the version).
        if not isinstance(data, dict):
            raise Invalid(f"the body must be a JSON object, got {type(data).__name__}")
        return cast(DictStrAny, data)
