"""The ASGI guard in front of everything: request bodies bounded before anyone stores them.

Django's ASGI handler reads a whole request body into a temporary file before any middleware
runs, so a 315 MB chunked upload was written to disk before the API answered 403. This guard
runs first and reads at most the limit into memory:

* a declared ``Content-Length`` over the limit is refused at once (413), unread;
* a write to the API that carries no credentials at all (no ``Authorization`` header, no
  session cookie) is refused at once (401): no operation of the API would accept it;
* otherwise the app reads the body as it arrives (the route fast path checks the token
  first), and the request is refused (413) the moment it passes the limit: the app is told
  the client left, so it neither reads nor answers any further.

A body still arriving ``HTTP_BODY_TIMEOUT_S`` after the headers is refused too (408): a client
dripping a byte every few seconds cannot hold a connection and a worker's request for ever.

Limits: ``API_MAX_BODY_BYTES`` under ``/api/``, Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE`` for
pages (forms only; no page takes files). Refusals close the connection, so the rest of an
oversized body is never read.
"""

from __future__ import annotations

import asyncio

from asgiref.typing import (
    ASGI3Application,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    HTTPScope,
    Scope,
)
from django.conf import settings

from controlplane.errors import UNAUTHORIZED_DETAIL, PayloadTooLarge, error_json
from controlplane.middleware import request_id_new

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SLOW_BODY_DETAIL = "the request body did not arrive within HTTP_BODY_TIMEOUT_S"


def _headers(scope: HTTPScope) -> dict[bytes, bytes]:
    return {key.lower(): value for key, value in scope["headers"]}


def _limit(path: str) -> int:
    if path.startswith("/api/"):
        return int(settings.API_MAX_BODY_BYTES)
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or settings.API_MAX_BODY_BYTES)


def _credentialless(scope: HTTPScope, headers: dict[bytes, bytes]) -> bool:
    if not scope["path"].startswith("/api/") or scope["method"] not in WRITES:
        return False
    if b"authorization" in headers:
        return False
    cookie = headers.get(b"cookie", b"").decode("latin-1")
    return f"{settings.SESSION_COOKIE_NAME}=" not in cookie


async def _refuse(
    send: ASGISendCallable, headers: dict[bytes, bytes], status: int, body: bytes
) -> None:
    # The caller's request id echoed (or one made), as RequestIdMiddleware does for the rest.
    request_id = headers.get(b"x-request-id", b"")[:64] or request_id_new().encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id),
                (b"connection", b"close"),
            ],
            "trailers": False,
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def request_body_bounded(app: ASGI3Application) -> ASGI3Application:
    """Wrap ``app`` (Django, the route fast path) so no body past its limit is ever read."""

    async def guard(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        limit = _limit(scope["path"])
        too_large = PayloadTooLarge(limit)
        headers = _headers(scope)
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(
                send, headers, too_large.status, error_json(too_large.detail, too_large.code)
            )
            return
        if _credentialless(scope, headers):
            await _refuse(send, headers, 401, error_json(UNAUTHORIZED_DETAIL, "unauthorized"))
            return
        size = 0
        started = refused = body_done = False
        deadline = asyncio.get_running_loop().time() + float(settings.HTTP_BODY_TIMEOUT_S)

        async def bounded_receive() -> ASGIReceiveEvent:
            nonlocal size, refused, body_done
            if refused:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()  # only the disconnect is left: no deadline on that
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # A body dripped slower than HTTP_BODY_TIMEOUT_S in all: let the client go.
                if not started:
                    refused = True
                    payload = error_json(SLOW_BODY_DETAIL, "request_timeout")
                    await _refuse(send, headers, 408, payload)
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit and not started:
                    # Refuse here and tell the app the client is gone: Django then drops the
                    # request (RequestAborted) and nothing more of the body is read.
                    refused = True
                    payload = error_json(too_large.detail, too_large.code)
                    await _refuse(send, headers, too_large.status, payload)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: ASGISendEvent) -> None:
            nonlocal started
            if refused:
                return  # the refusal was the answer
            started = True
            await send(message)

        await app(scope, bounded_receive, guarded_send)

    return guard
