"""uvicorn's HTTP protocol with a deadline on request headers (slow clients are let go), and
each response's head written with its first body chunk.

uvicorn closes an idle keep-alive connection after ``--timeout-keep-alive`` seconds, but that
timer stops at the first byte received, and nothing bounds a request whose headers never
finish: 300 clients sending a header byte every few seconds held 300 connections for ever.
Here every request's headers must be complete within ``HTTP_HEADER_TIMEOUT_S`` of the
connection opening (or of the previous answer on a kept-alive connection); otherwise the
connection is closed. The body has its own total deadline (controlplane.request_limits).

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and the body with the next message: two ``send`` system calls and
two TCP segments for every small JSON answer (the answer's sends were ~15% of a uvicorn
worker's samples under route calls, py-spy). The ASGI spec lets a server hold the head until
the first body message, so :class:`HeadWithBodyCycle` does, and writes both at once.

Run it with ``uvicorn --http controlplane.http_protocol:HeaderDeadlineProtocol``, as the
Dockerfile, compose and ``manage.py demo`` do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _StandIn:
    """Put in place of the cycle's transport during one uvicorn ``send``: what it does not
    override goes to the real transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _Held(_StandIn):
    """While uvicorn writes a response head: keeps the bytes."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.data: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.data.append(data)


class _Prefixed(_StandIn):
    """While uvicorn writes a response's first body chunk: the held head goes out with it, in
    one write (and before anything else: a close, say)."""

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        super().__init__(transport)
        self.head: bytes | None = head

    def flush(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            if not self.transport.is_closing():
                self.transport.write(head)

    def write(self, data: bytes) -> None:
        head, self.head = self.head, None
        self.transport.write(head + data if head else data)

    def close(self) -> None:
        self.flush()
        self.transport.close()


class HeadWithBodyCycle(RequestResponseCycle):
    """uvicorn's request cycle, holding the response head until the first body message and
    writing both in one call. What uvicorn checks and writes is unchanged: its own ``send``
    runs against a stand-in transport."""

    _head: bytes | None = None

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if self.flow.write_paused and not self.disconnected:
            # uvicorn's own send waits here first; waited before the stand-in is put in place,
            # its send then runs to the end without yielding, so no other coroutine (a receive
            # writing "100 Continue") can write through the stand-in.
            await self.flow.drain()
        if kind == "http.response.start" and not self.response_started:
            real, held = self.transport, _Held(self.transport)
            self.transport = held  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = real
            self._head = b"".join(held.data)
            return
        head = self._head
        if head is None or kind != "http.response.body":
            await super().send(message)
            return
        self._head = None
        real, prefixed = self.transport, _Prefixed(self.transport, head)
        self.transport = prefixed  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = real
            # No body written (a HEAD request, a client already gone): the head alone.
            if not self.disconnected:
                prefixed.flush()


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that closes a connection whose request headers are late, and
    answers through :class:`HeadWithBodyCycle`.

    The deadline is kept as a time, not as a timer per request: one timer per connection
    that, when it fires, closes the connection if headers are still awaited past the
    deadline, or waits again until the current deadline (re-arming ``call_later`` on every
    request cost a timer handle and a heap push and cancel each time)."""

    _header_timer: asyncio.TimerHandle | None = None
    # loop time by which the awaited headers must be complete; None: none awaited
    _header_deadline: float | None = None

    def _header_deadline_arm(self) -> None:
        # Read here, not at import: uvicorn imports this class before the Django app.
        deadline_s = float(settings.HTTP_HEADER_TIMEOUT_S)
        self._header_deadline = self.loop.time() + deadline_s
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(deadline_s, self._header_deadline_check)

    def _header_deadline_cancel(self) -> None:
        self._header_deadline = None

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
        self._header_deadline_cancel()
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # The cycle uvicorn made, as the subclass that writes head and body together.
        if type(cycle) is RequestResponseCycle:
            cycle.__class__ = HeadWithBodyCycle
        super()._start_asgi_task(cycle, app)

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
