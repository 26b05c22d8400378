"""uvicorn's HTTP protocol with a deadline on request headers (slow clients are let go).

uvicorn closes an idle keep-alive connection after ``--timeout-keep-alive`` seconds, but that
timer stops at the first byte received, and nothing bounds a request whose headers never
finish: 300 clients sending a header byte every few seconds held 300 connections for ever.
Here every request's headers must be complete within ``HTTP_HEADER_TIMEOUT_S`` of the
connection opening (or of the previous answer on a kept-alive connection); otherwise the
connection is closed. The body has its own total deadline (controlplane.request_limits).

Run it with ``uvicorn --http controlplane.http_protocol:HeaderDeadlineProtocol``, as the
Dockerfile, compose and ``manage.py demo`` do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that closes a connection whose request headers are late."""

    _header_timer: asyncio.TimerHandle | None = None

    def _header_deadline_arm(self) -> None:
        self._header_deadline_cancel()
        # Read here, not at import: uvicorn imports this class before the Django app.
        deadline_s = float(settings.HTTP_HEADER_TIMEOUT_S)
        self._header_timer = self.loop.call_later(deadline_s, self._header_deadline_passed)

    def _header_deadline_cancel(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline_arm()

    def on_headers_complete(self) -> None:
        self._header_deadline_cancel()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._header_deadline_arm()  # the next request on this connection

    def connection_lost(self, exc: Any) -> None:
        self._header_deadline_cancel()
        super().connection_lost(exc)
