"""The route endpoints' second door: bearer-token calls of ``POST /api/v1/route`` and
``/api/v1/route/batch`` answered straight from ASGI, without Django's middleware stack.

Why: Django's built-in middlewares are sync; under ASGI each one hops to the single
thread-sensitive executor twice per request, so concurrent route calls queue behind each other
in that one thread. The route path needs none of them (no session, no CSRF, no messages): a
router presents a bearer token. This module is ASGI plumbing only: the body limit, the bearer
auth, the error shape and the decision are the same functions the ninja operations use
(:func:`controlplane.auth.abearer_authorize`, :class:`controlplane.errors.PayloadTooLarge`,
:func:`scheduling.api.route.route_answer`); the body is decoded by the operations' own
decoder (:func:`scheduling.api.route.route_request_decode`: one msgspec schema, one pass).
Everything else, including route calls without a bearer token (browsers with a session), goes
to Django unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from asgiref.typing import (
    ASGI3Application,
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPScope,
    Scope,
)
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.http.request import split_domain_port, validate_host

from controlplane.auth import abearer_authorize
from controlplane.errors import ApiError, PayloadTooLarge, error_json
from controlplane.middleware import request_id_new
from controlplane.parser import json_content_type_check
from scheduling.api.route import route_answer, route_request_decode

log = logging.getLogger(__name__)


# Path -> whether it is the batch operation.
ROUTE_PATHS: dict[str, bool] = {"/api/v1/route": False, "/api/v1/route/batch": True}


def _header(scope: HTTPScope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


# What Django's SecurityMiddleware and XFrameOptionsMiddleware send on every answer, for a
# JSON API that nothing should frame, sniff or render as a page.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
]


@dataclass(frozen=True)
class _Conf:
    """The settings this door reads on every call, read once: each ``settings.X`` is a
    Python-level attribute hook (LazyObject), and with the Host check they were ~8% of a
    single call's CPU. Read again when a setting changes (tests override them)."""

    max_body: int
    hsts: int
    # (header name as in ASGI scope headers, value meaning https), or None
    proxy_ssl: tuple[bytes, str] | None
    allowed_hosts: tuple[str, ...]
    # Host header -> allowed (bounded: a flood of made-up names only empties it)
    hosts_seen: dict[str, bool]


_conf: _Conf | None = None
_HOSTS_SEEN_MAX = 256


def _conf_get() -> _Conf:
    global _conf
    if _conf is None:
        proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
        allowed = list(settings.ALLOWED_HOSTS)
        if settings.DEBUG and not allowed:
            allowed = [".localhost", "127.0.0.1", "[::1]"]  # Django's own DEBUG default
        _conf = _Conf(
            max_body=int(settings.API_MAX_BODY_BYTES),
            hsts=int(getattr(settings, "SECURE_HSTS_SECONDS", 0) or 0),
            proxy_ssl=(
                (proxy[0].removeprefix("HTTP_").lower().replace("_", "-").encode(), proxy[1])
                if proxy
                else None
            ),
            allowed_hosts=tuple(allowed),
            hosts_seen={},
        )
    return _conf


@receiver(setting_changed)
def _conf_forget(**kwargs: Any) -> None:
    global _conf
    _conf = None


def _secure(scope: HTTPScope, conf: _Conf) -> bool:
    if scope["scheme"] == "https":
        return True
    if conf.proxy_ssl is None:
        return False
    return _header(scope, conf.proxy_ssl[0]) == conf.proxy_ssl[1]


async def _send_json(
    scope: HTTPScope, send: ASGISendCallable, status: int, body: bytes, request_id: str
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode()),
        *SECURITY_HEADERS,
    ]
    conf = _conf_get()
    if conf.hsts and _secure(scope, conf):
        headers.append((b"strict-transport-security", f"max-age={conf.hsts}".encode()))
    await send(
        {"type": "http.response.start", "status": status, "headers": headers, "trailers": False}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _host_allowed(scope: HTTPScope, conf: _Conf) -> bool:
    """Django's ``ALLOWED_HOSTS`` rule, which this door would otherwise skip."""
    host = _header(scope, b"host") or ""
    seen = conf.hosts_seen
    got = seen.get(host)
    if got is None:
        domain, _port = split_domain_port(host)
        got = bool(domain) and validate_host(domain, conf.allowed_hosts)
        if len(seen) >= _HOSTS_SEEN_MAX:
            seen.clear()
        seen[host] = got
    return got


async def _read_body(scope: HTTPScope, receive: ASGIReceiveCallable, limit: int) -> bytes:
    """The body; PayloadTooLarge when it is declared or grows past ``limit`` (the rest is
    drained, not kept)."""
    declared = _header(scope, b"content-length") or ""
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return b""  # the client went away
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit and chunk:
            chunks.append(chunk)
        more = message.get("more_body", False)
    if size > limit:
        raise PayloadTooLarge(limit)
    return b"".join(chunks)


async def _route(scope: HTTPScope, receive: ASGIReceiveCallable, token: str, batch: bool) -> bytes:
    conf = _conf_get()
    if not _host_allowed(scope, conf):
        raise ApiError("the Host header names no host this server answers to", code="bad_host")
    # The caller first, then its body: an unauthenticated upload is refused unread.
    await abearer_authorize(token, "router")
    content_type = _header(scope, b"content-type")
    json_content_type_check(content_type)  # before the body is read
    body = await _read_body(scope, receive, conf.max_body)
    return await route_answer(route_request_decode(content_type, body, batch=batch), batch=batch)


def route_fast_path(app: ASGI3Application) -> ASGI3Application:
    """Wrap the Django ASGI app: bearer-token route calls go the short way."""

    async def dispatch(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            batch = ROUTE_PATHS.get(scope["path"])
            auth = _header(scope, b"authorization") if batch is not None else None
            if batch is not None and auth is not None and auth.startswith("Bearer "):
                supplied = _header(scope, b"x-request-id")
                request_id = supplied[:64] if supplied else request_id_new()
                token = auth[len("Bearer ") :].strip()
                try:
                    status, out = 200, await _route(scope, receive, token, batch)
                except ApiError as exc:
                    status, out = exc.status, error_json(exc.detail, exc.code)
                except Exception:
                    # The one error shape for every answer, a fault included.
                    log.exception("unexpected error on the route fast path")
                    status = 500
                    out = error_json("internal error; it was logged", "internal_error")
                await _send_json(scope, send, status, out, request_id)
                return
        await app(scope, receive, send)

    return dispatch
