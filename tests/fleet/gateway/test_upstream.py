"""The gateway's engine client against real sockets: keep-alive reuse, and the race every
keep-alive client meets, an engine closing an idle connection as a request goes out on it
(vLLM's uvicorn closes idle connections after 5 s)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from fleet.gateway.upstream import Upstream, UpstreamProtocolError

ANSWER = b'{"ok": true}'
KEEP_ALIVE_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(ANSWER)).encode()
    + b"\r\n\r\n"
    + ANSWER
)


class Engine:
    """A raw HTTP/1.1 server: answers ``answered`` requests per connection with keep-alive,
    then closes the connection when the next request arrives, without answering it."""

    def __init__(self, answered: int) -> None:
        self.answered = answered
        self.connections = 0
        self.requests_read = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests_read += 1
                if served >= self.answered:
                    return  # closed as the request came: nothing answered
                writer.write(KEEP_ALIVE_ANSWER)
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@asynccontextmanager
async def engine_serve(answered: int) -> AsyncIterator[Engine]:
    engine = Engine(answered)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    engine.port = server.sockets[0].getsockname()[1]
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


async def post(upstream: Upstream, engine: Engine) -> bytes:
    resp = await upstream.request(f"http://127.0.0.1:{engine.port}", "/v1/completions", b"{}", b"")
    try:
        return await resp.read()
    finally:
        resp.close()


async def test_consecutive_requests_share_one_kept_alive_connection() -> None:
    upstream = Upstream(connect_timeout_s=2)
    async with engine_serve(answered=10) as engine:
        for _ in range(3):
            assert await post(upstream, engine) == ANSWER
        assert engine.connections == 1
    upstream.close()


async def test_a_reused_connection_closed_before_any_answer_is_retried_once_on_a_new_one() -> None:
    upstream = Upstream(connect_timeout_s=2)
    async with engine_serve(answered=1) as engine:
        assert await post(upstream, engine) == ANSWER
        # The engine closes that idle connection only when the next request reaches it: the
        # client cannot have seen the close before it wrote.
        assert await post(upstream, engine) == ANSWER
        assert engine.connections == 2
        assert engine.requests_read == 3  # the lost one, read and dropped, then the retry
    upstream.close()


async def test_a_new_connection_closed_before_any_answer_is_not_sent_again() -> None:
    upstream = Upstream(connect_timeout_s=2)
    async with engine_serve(answered=0) as engine:
        with pytest.raises(UpstreamProtocolError):
            await post(upstream, engine)
        # A request on a connection that was not idle may have been acted on: never twice.
        assert engine.requests_read == 1
        assert engine.connections == 1
    upstream.close()


async def test_a_connection_idle_past_the_expiry_is_not_reused() -> None:
    upstream = Upstream(connect_timeout_s=2, idle_expiry_s=0.05)
    async with engine_serve(answered=10) as engine:
        assert await post(upstream, engine) == ANSWER
        await asyncio.sleep(0.1)
        assert await post(upstream, engine) == ANSWER
        # (the engine counts a connection when it accepts it, before it answers)
        assert engine.connections == 2
        assert engine.requests_read == 2  # nothing was lost on the expired connection
    upstream.close()
