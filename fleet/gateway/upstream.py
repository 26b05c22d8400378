"""A lean keep-alive HTTP/1.1 client for the engines: asyncio protocols, httptools' parser.

Why not a general client: every request costs the gateway two upstream calls, and measured on
this machine a general client's per-call Python work (aiohttp: request and response objects,
timers, header multidicts, tracing hooks) was the larger part of the gateway's CPU per
request. The engines' side of the protocol is narrow: ``POST`` a JSON body to an
OpenAI-compatible server and read a JSON answer or an SSE stream. So this client writes the
request bytes itself and parses answers with ``httptools`` (the C parser uvicorn uses), over
pooled keep-alive connections (TLS when the URL says ``https``).

Contract: :meth:`Upstream.request` returns once the status line and headers are in; the
body is then read whole (:meth:`Response.read`) or as it comes (:meth:`Response.chunks`). A
connection goes back to the pool only after a complete answer that allows keep-alive; any
error, time-out or :meth:`Response.close` before the end closes it (which is how an engine
learns that the request is abandoned). Errors are ``OSError`` (connection), ``TimeoutError``,
or :class:`UpstreamProtocolError` (not HTTP).

Idle connections: an engine closes a kept-alive connection after its own idle time (vLLM and
SGLang serve with uvicorn: 5 s), and a request written on it just then is lost with it, before
any byte of an answer. So a pooled connection idle longer than ``idle_expiry_s`` (4 s) is
closed rather than reused, and a request whose *reused* connection closes before any byte of
its answer is sent once more on a new connection, as HTTP clients do for a connection the
server closed while idle (RFC 9112, 9.3.1). On a new connection nothing is sent twice: the
engine may have acted on it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools


class UpstreamProtocolError(OSError):
    """The peer did not answer in HTTP/1.1 (or closed in the middle of an answer)."""


class TooLarge(Exception):
    """An answer longer than the reader takes (the connection is closed, not read further)."""


# Below the 5 s after which uvicorn (vLLM's and SGLang's server) closes an idle connection.
IDLE_EXPIRY_S = 4.0


@dataclass(frozen=True)
class Origin:
    host: str
    port: int
    tls: bool
    prefix: str  # a path the base URL carries (e.g. /engines/p0), prepended to each path

    @property
    def host_header(self) -> bytes:
        return f"{self.host}:{self.port}".encode()


class _Connection(asyncio.Protocol):
    """One TCP connection; parses the answer to the request written last."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.slots: asyncio.Semaphore | None = None
        # Loop time it went back to the pool (idle since then).
        self.idle_since = 0.0
        self._reset()

    def release_slot(self) -> None:
        """The request on this connection is over: its slot goes back to its engine's pool."""
        if self.slots is not None:
            self.slots.release()
            self.slots = None

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.more = asyncio.Event()
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.received = False  # any byte of this answer

    def prepare(self) -> None:
        self._reset()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"bad HTTP answer: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(exc or UpstreamProtocolError("connection closed before the answer ended"))

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self.more.set()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.more.set()

    def on_message_complete(self) -> None:
        # Asked now: once the message is complete the parser starts over and forgets.
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self.more.set()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed


class Response:
    """An answer whose headers are in; read its body once, whole or in chunks."""

    def __init__(self, upstream: Upstream, origin: Origin, conn: _Connection) -> None:
        self._upstream = upstream
        self._origin = origin
        self._conn = conn
        self.status = conn.status
        self.content_type = conn.headers.get(b"content-type", b"application/json").decode()
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while conn.chunks:
                yield conn.chunks.popleft()
            if conn.complete:
                self._finish()
                return
            if conn.error is not None:
                self.close()
                raise conn.error
            conn.more.clear()
            await conn.more.wait()

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; past ``max_bytes`` (declared or received), TooLarge."""
        if max_bytes is None:
            parts = [chunk async for chunk in self.chunks()]
            return b"".join(parts)
        declared = self._conn.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            self.close()
            raise TooLarge(int(declared))
        parts = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > max_bytes:
                self.close()
                raise TooLarge(size)
            parts.append(chunk)
        return b"".join(parts)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._upstream._release(self._origin, self._conn)

    def close(self) -> None:
        """Abandon the answer (the connection is closed unless the answer was complete)."""
        if not self._done:
            self._done = True
            if self._conn.reusable():
                self._upstream._release(self._origin, self._conn)
            else:
                self._conn.release_slot()
                if self._conn.transport is not None:
                    self._conn.transport.close()


class Upstream:
    """Pools of keep-alive connections by origin (one per gateway process)."""

    def __init__(
        self,
        connect_timeout_s: float,
        max_per_origin: int = 128,
        max_idle_per_origin: int = 128,
        idle_expiry_s: float = IDLE_EXPIRY_S,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_origin
        self.idle_expiry_s = idle_expiry_s
        # At most this many requests in flight to one engine: beyond, callers wait for one of
        # them to end (an overloaded gateway must not open thousands of connections to an
        # engine and thrash both; the gateway's own queue bounds the waiting).
        self.max_per_origin = max_per_origin
        self._slots: dict[Origin, asyncio.Semaphore] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl: ssl.SSLContext | None = None

    def origin(self, url: str) -> Origin:
        got = self._origins.get(url)
        if got is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            tls = parts.scheme == "https"
            got = Origin(parts.hostname, parts.port or (443 if tls else 80), tls, parts.path)
            self._origins[url] = got
        return got

    def _pooled(self, origin: Origin) -> _Connection | None:
        """The most recently used idle connection to ``origin`` that is still open and not
        idle past the expiry (older ones are closed: the engine is about to)."""
        pool = self._idle.get(origin)
        if not pool:
            return None
        fresh_since = asyncio.get_running_loop().time() - self.idle_expiry_s
        while pool:
            conn = pool.pop()
            if conn.closed:
                continue
            if conn.idle_since < fresh_since:
                # Last in, first out: every one below this one is older still.
                for old in (conn, *pool):
                    if old.transport is not None:
                        old.transport.close()
                pool.clear()
                return None
            conn.prepare()
            return conn
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Connection,
                origin.host,
                origin.port,
                ssl=context,
                server_hostname=origin.host if context else None,
            )
        return conn

    def _release(self, origin: Origin, conn: _Connection) -> None:
        conn.release_slot()
        pool = self._idle.setdefault(origin, [])
        if conn.reusable() and len(pool) < self.max_idle:
            conn.idle_since = asyncio.get_running_loop().time()
            pool.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    async def request(self, base_url: str, path: str, body: bytes, headers: bytes) -> Response:
        """``POST base_url + path`` with a JSON ``body`` (``headers``: extra raw header lines,
        each ending in CRLF); the answer once its headers are in. The caller bounds the time
        (one ``asyncio.timeout`` per step: a timer per call costs)."""
        origin = self.origin(base_url)
        slots = self._slots.get(origin)
        if slots is None:
            slots = self._slots[origin] = asyncio.Semaphore(self.max_per_origin)
        await slots.acquire()
        try:
            conn = self._pooled(origin)
            if conn is not None:
                try:
                    await self._send(conn, origin, path, body, headers)
                except OSError:
                    # Lost with an idle connection the engine closed as it went out: once
                    # more on a new one. An answer begun, or a parser error, is no such race.
                    if conn.received or not conn.closed:
                        raise
                    conn = None
            if conn is None:
                conn = await self._connect(origin)
                await self._send(conn, origin, path, body, headers)
        except BaseException:
            slots.release()
            raise
        conn.slots = slots
        return Response(self, origin, conn)

    async def _send(
        self, conn: _Connection, origin: Origin, path: str, body: bytes, headers: bytes
    ) -> None:
        """Write the request on ``conn`` and wait for its answer's headers (the connection is
        closed on any failure)."""
        head = b"".join(
            (
                b"POST ",
                origin.prefix.encode(),
                path.encode(),
                b" HTTP/1.1\r\nHost: ",
                origin.host_header,
                b"\r\nContent-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                headers,
                b"\r\n",
            )
        )
        assert conn.transport is not None
        conn.transport.write(head + body)
        try:
            await conn.headers_done
        except BaseException:
            conn.transport.close()
            raise

    def close(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
