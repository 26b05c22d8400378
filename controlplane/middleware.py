"""Request ids: every request carries one, so audit records and logs can be joined."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse


def _request_id(request: HttpRequest) -> str:
    supplied = request.headers.get("X-Request-ID", "")
    return supplied[:64] if supplied else uuid.uuid4().hex


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
