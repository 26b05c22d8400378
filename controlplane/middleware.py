"""Request ids: every request carries one, so audit records and logs can be joined."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse

from controlplane.errors import ApiError, PayloadTooLarge
from controlplane.parser import json_body_check

# Request ids must be unique, not secret: a random prefix per process (made anew in a forked
# child) and a counter, instead of a uuid4 per request (a system call and a UUID object each,
# ~4% of a route call's CPU on the fast path).
_ids = itertools.count()
_prefix = ""


def _request_ids_reset() -> None:
    global _ids, _prefix
    _prefix = os.urandom(8).hex()
    _ids = itertools.count()


_request_ids_reset()
os.register_at_fork(after_in_child=_request_ids_reset)


def request_id_new() -> str:
    """A new request id: 32 hex digits (uuid4().hex's shape), unique across processes."""
    return f"{_prefix}{next(_ids):016x}"


def _request_id(request: HttpRequest) -> str:
    supplied = request.headers.get("X-Request-ID", "")
    return supplied[:64] if supplied else request_id_new()


class RequestIdMiddleware:
    """Take ``X-Request-ID`` from the caller when given, else make one; echo it back.

    Sync and async capable, so the async route path never hops to a thread for it.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if self.is_async:
            return self.__acall__(request)
        request.request_id = _request_id(request)  # type: ignore[attr-defined]
        response: HttpResponse = self.get_response(request)
        response["X-Request-ID"] = request.request_id  # type: ignore[attr-defined]
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        request.request_id = _request_id(request)  # type: ignore[attr-defined]
        response: HttpResponse = await self.get_response(request)
        response["X-Request-ID"] = request.request_id  # type: ignore[attr-defined]
        return response


class RefusalMiddleware:
    """A check that may answer instead of the view: :meth:`refused` returns the refusal, or
    None to pass the request on. Sync and async capable (the route path stays async)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    @staticmethod
    def refused(request: HttpRequest) -> HttpResponse | None:
        raise NotImplementedError

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if iscoroutinefunction(self):
            return self.__acall__(request)  # type: ignore[attr-defined]
        refused = self.refused(request)
        if refused is not None:
            return refused
        response: HttpResponse = self.get_response(request)
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        refused = self.refused(request)
        if refused is not None:
            return refused
        response: HttpResponse = await self.get_response(request)
        return response


class BodySizeLimitMiddleware(RefusalMiddleware):
    """Refuse API request bodies over ``settings.API_MAX_BODY_BYTES`` with 413 and the API's
    error shape, before any view parses them: first by ``Content-Length``, then by the body's
    actual length (chunked uploads carry no length header)."""

    @staticmethod
    def refused(request: HttpRequest) -> HttpResponse | None:
        if not request.path.startswith("/api/"):
            return None
        limit = int(settings.API_MAX_BODY_BYTES)
        declared = request.META.get("CONTENT_LENGTH") or ""
        too_big = declared.isdigit() and int(declared) > limit
        if not too_big and request.method in {"POST", "PUT", "PATCH"}:
            try:
                too_big = len(request.body) > limit
            except RequestDataTooBig:
                too_big = True
        if not too_big:
            return None
        refused = PayloadTooLarge(limit)
        return JsonResponse(refused.payload(), status=refused.status)


class NulRefusalMiddleware(RefusalMiddleware):
    """Refuse a NUL character in the path or the query string before any view: the database
    cannot store one, and a query reaching it failed with an HTML 500. API paths get a 422 in
    the API's error shape, pages a plain 400."""

    @staticmethod
    def refused(request: HttpRequest) -> HttpResponse | None:
        query = request.META.get("QUERY_STRING", "")
        if "\x00" not in request.path and "%00" not in query and "\x00" not in query:
            return None
        if request.path.startswith("/api/"):
            # 422 as for any value that breaks a rule (every operation documents it).
            refused = ApiError("a NUL character in the path or query", code="invalid", status=422)
            return JsonResponse(refused.payload(), status=422)
        return HttpResponseBadRequest("a NUL character in the path or query")


class StrictJsonMiddleware(RefusalMiddleware):
    """API bodies are strict JSON (controlplane.parser), checked before ninja so that each
    refusal keeps its status and the error shape."""

    @staticmethod
    def refused(request: HttpRequest) -> HttpResponse | None:
        if not request.path.startswith("/api/"):
            return None
        try:
            json_body_check(request)
        except ApiError as exc:
            return JsonResponse(exc.payload(), status=exc.status)
        return None


class ContentSecurityPolicyMiddleware:
    """A Content-Security-Policy on every page: scripts only from here or carrying this
    response's nonce (``request.csp_nonce``; the pages' few inline scripts carry it), no
    inline event handlers, no plugins, no framing, forms and sockets to this host only.

    Styles may be inline (htmx and the charts set them). The admin and the API (JSON, and the
    API docs page, which loads Swagger UI from its CDN) are left to their own defaults.
    """

    sync_capable = True
    async_capable = True
    EXEMPT_PREFIXES = ("/admin/", "/api/")

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    @staticmethod
    def policy(nonce: str, host: str) -> str:
        return "; ".join(
            [
                "default-src 'self'",
                f"script-src 'self' 'nonce-{nonce}'",
                "style-src 'self' 'unsafe-inline'",
                "img-src 'self' data:",
                f"connect-src 'self' ws://{host} wss://{host}",
                "object-src 'none'",
                "base-uri 'self'",
                "form-action 'self'",
                "frame-ancestors 'none'",
            ]
        )

    def _before(self, request: HttpRequest) -> None:
        request.csp_nonce = secrets.token_urlsafe(16)  # type: ignore[attr-defined]

    def _after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        html = response.get("Content-Type", "").startswith("text/html")
        if html and not request.path.startswith(self.EXEMPT_PREFIXES):
            host = request.get_host()
            response.setdefault(
                "Content-Security-Policy",
                self.policy(request.csp_nonce, host),  # type: ignore[attr-defined]
            )
        return response

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if self.is_async:
            return self.__acall__(request)
        self._before(request)
        return self._after(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        self._before(request)
        return self._after(request, await self.get_response(request))
