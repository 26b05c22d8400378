"""uvicorn's HTTP protocol with a deadline on request headers, for the gateway.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but that timer stops
at the first byte received, and nothing bounds a request whose headers never finish: 500
clients sending a header byte every few seconds held 500 of the gateway's connections for as
long as they liked. Here a request's headers must be complete within ``header_timeout_s`` of the
connection opening (or of the previous answer on a kept-alive connection); otherwise the
connection is closed. (The body has its own total deadline, ``body_timeout_s``, kept by the
app.) The control plane's server does the same (``controlplane/http_protocol.py``); the gateway
runs without Django, hence its own.

The deadline is a class attribute, set from the configuration before serving
(:func:`header_timeout_set`; each worker process sets it when it builds its gateway), so that
uvicorn can name the class by its import path. One timer per connection, re-armed only when it
fires (re-arming ``call_later`` on every request costs a timer handle each time).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    # loop time by which the awaited headers must be complete; None: none awaited
    _header_deadline: float | None = None

    def _header_deadline_arm(self) -> None:
        deadline_s = self.header_timeout_s
        self._header_deadline = self.loop.time() + deadline_s
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(deadline_s, self._header_deadline_check)

    def _header_deadline_check(self) -> None:
        self._header_timer = None
        deadline = self._header_deadline
        if deadline is None or self.transport.is_closing():
            return  # nothing awaited now; the next answer arms the timer again
        left = deadline - self.loop.time()
        if left > 0:
            self._header_timer = self.loop.call_later(left, self._header_deadline_check)
        else:
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline_arm()

    def on_headers_complete(self) -> None:
        self._header_deadline = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._header_deadline_arm()  # the next request on this connection

    def connection_lost(self, exc: Any) -> None:
        self._header_deadline = None
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def header_timeout_set(seconds: float) -> None:
    """The header deadline of every connection this process accepts from now on."""
    HeaderDeadlineProtocol.header_timeout_s = seconds
