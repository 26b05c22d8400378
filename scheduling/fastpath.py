"""The route endpoints' fast path: bearer-token calls of ``POST /api/v1/route`` and
``/api/v1/route/batch`` answered straight from ASGI, without Django's middleware stack.

Why: Django's built-in middlewares are sync; under ASGI each one hops to the single
thread-sensitive executor twice per request, so concurrent route calls queue behind each other
in that one thread. The route path needs none of them (no session, no CSRF, no messages): a
router presents a bearer token. This path does exactly what the ninja operations in
:mod:`scheduling.api.route` do (same schemas, same service, same auth rules and error shapes, the
body limit, ``X-Request-ID``), and everything else, including route calls without a bearer
token (browsers with a session), goes to Django unchanged.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
import pydantic
from django.conf import settings

from controlplane.auth import atoken_principal
from controlplane.errors import ApiError, location_path
from scheduling.api.route import RouteBatchIn, RouteIn
from scheduling.decisions import route_decide_async

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROUTE_PATHS = {"/api/v1/route": False, "/api/v1/route/batch": True}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


async def _send_json(send: Send, status: int, body: bytes, request_id: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _error(detail: str, code: str) -> bytes:
    return orjson.dumps({"detail": detail, "code": code})


def _validation_detail(exc: pydantic.ValidationError) -> str:
    messages = []
    for err in exc.errors():
        path = location_path(list(err.get("loc", ())))
        msg = err.get("msg", "invalid")
        messages.append(f"{path}: {msg}" if path else msg)
    return "; ".join(messages) or "invalid input"


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The body, or None when it grows past ``limit`` (the rest is drained, not kept)."""
    chunks: list[bytes] = []
    size = 0
    too_big = False
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            too_big = True
        elif chunk:
            chunks.append(chunk)
        more = message.get("more_body", False)
    return None if too_big else b"".join(chunks)


async def _route(scope: Scope, receive: Receive, send: Send, token: str, batch: bool) -> None:
    supplied = _header(scope, b"x-request-id")
    request_id = supplied[:64] if supplied else uuid.uuid4().hex
    limit = int(settings.API_MAX_BODY_BYTES)
    too_large = _error(f"request body over {limit} bytes", "payload_too_large")
    declared = _header(scope, b"content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        await _send_json(send, 413, too_large, request_id)
        return
    body = await _read_body(receive, limit)
    if body is None:
        await _send_json(send, 413, too_large, request_id)
        return
    principal = await atoken_principal(token) if token else None
    if principal is None:
        detail = "missing, invalid, expired or revoked API token"
        await _send_json(send, 401, _error(detail, "unauthorized"), request_id)
        return
    if not principal.has_scope("router"):
        detail = "this operation needs the 'router' scope"
        await _send_json(send, 403, _error(detail, "forbidden"), request_id)
        return
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        await _send_json(send, 400, _error("Cannot parse request body", "http_400"), request_id)
        return
    try:
        if batch:
            payload = RouteBatchIn.model_validate(data)
            decisions = await route_decide_async(
                [r.to_input() for r in payload.requests], batch=True
            )
            out = orjson.dumps({"decisions": decisions})
        else:
            single = RouteIn.model_validate(data)
            out = orjson.dumps((await route_decide_async([single.to_input()], batch=False))[0])
    except pydantic.ValidationError as exc:
        await _send_json(send, 422, _error(_validation_detail(exc), "invalid"), request_id)
        return
    except ApiError as exc:
        await _send_json(send, exc.status, _error(exc.detail, exc.code), request_id)
        return
    await _send_json(send, 200, out, request_id)


def route_fast_path(app: ASGIApp) -> ASGIApp:
    """Wrap the Django ASGI app: bearer-token route calls go the short way."""

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http" and scope.get("method") == "POST":
            batch = ROUTE_PATHS.get(scope.get("path", ""))
            if batch is not None:
                auth = _header(scope, b"authorization")
                if auth is not None and auth.startswith("Bearer "):
                    await _route(scope, receive, send, auth[len("Bearer ") :].strip(), batch)
                    return
        await app(scope, receive, send)

    return dispatch
