"""Slow clients are let go: the attack of issue 13 (300 connections dripping header bytes were
never closed), against the real app under uvicorn with a 1 s header deadline; and the
protocol on its own (uvicorn's parser and request cycle): answers written head and body in one
call, headers late on a kept-alive connection."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest
from django.db import connection
from uvicorn.config import Config
from uvicorn.server import ServerState

from controlplane.http_protocol import HeaderDeadlineProtocol
from tests.support.servers import control_plane_serve

CLIENTS = 50
DRIPS = 40  # bytes each client would send, 0.2 s apart (8 s in all)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.django_db(transaction=True)
def test_clients_dripping_their_headers_are_disconnected(settings: Any) -> None:
    served = control_plane_serve(
        connection.settings_dict, settings.REDIS_URL, extra_env={"HTTP_HEADER_TIMEOUT_S": "1"}
    )
    with served as (base, _):
        port = int(base.rsplit(":", 1)[1])
        socks = []
        for _ in range(CLIENTS):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /api/v1/route HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            sock.setblocking(False)
            socks.append(sock)
        dropped = [False] * CLIENTS
        for _ in range(DRIPS):
            for i, sock in enumerate(socks):
                if dropped[i]:
                    continue
                dropped[i] = closed_by_server(sock)
                if not dropped[i]:
                    try:
                        sock.send(b"a")
                    except OSError:
                        dropped[i] = True
            if all(dropped):
                break
            time.sleep(0.2)
        for sock in socks:
            sock.close()
        assert all(dropped), f"{dropped.count(False)} of {CLIENTS} slow clients still connected"
        # A client that sends its request at a normal pace is served as ever.
        assert httpx.get(f"{base}/api/v1/health/live", timeout=5).status_code == 200


# --- the protocol on its own: uvicorn's parser and request cycle, a transport that records ------


class RecordingTransport(asyncio.Transport):
    """The socket side of a connection: what the protocol wrote, and whether it closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def json_app(scope: Any, receive: Any, send: Any) -> None:
    body = b'{"ok": true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"12")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for chunk in (b"one", b"two"):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def failing_app(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("the app failed before answering")


def connection_open(app: Any) -> tuple[HeaderDeadlineProtocol, RecordingTransport]:
    config = Config(app=app, http=HeaderDeadlineProtocol, lifespan="off", log_level="critical")
    protocol = HeaderDeadlineProtocol(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def answered(transport: RecordingTransport, writes: int = 1) -> None:
    for _ in range(100):
        if len(transport.writes) >= writes or transport.closed:
            return
        await asyncio.sleep(0)


GET = b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def test_a_small_answer_is_written_in_one_call_head_and_body() -> None:
    protocol, transport = connection_open(json_app)
    protocol.data_received(GET)
    await answered(transport)
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 12" in head
    assert body == b'{"ok": true}'
    protocol.connection_lost(None)


async def test_a_streamed_answer_sends_its_head_with_the_first_chunk() -> None:
    protocol, transport = connection_open(streaming_app)
    protocol.data_received(GET)
    await answered(transport, writes=3)
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n3\r\none\r\n")
    assert b"".join(transport.writes[1:]) == b"3\r\ntwo\r\n0\r\n\r\n"
    protocol.connection_lost(None)


async def test_a_head_request_gets_its_head_alone() -> None:
    protocol, transport = connection_open(json_app)
    protocol.data_received(b"HEAD /x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await answered(transport)
    assert len(transport.writes) == 1
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.writes[0].endswith(b"content-length: 12\r\n\r\n")
    protocol.connection_lost(None)


async def test_an_app_that_fails_before_answering_still_gets_its_500_out() -> None:
    protocol, transport = connection_open(failing_app)
    protocol.data_received(GET)
    await answered(transport)
    assert transport.writes[0].startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert transport.writes[0].endswith(b"\r\n\r\nInternal Server Error")
    assert transport.closed


async def test_headers_in_time_on_a_kept_alive_connection_keep_it_open(settings: Any) -> None:
    settings.HTTP_HEADER_TIMEOUT_S = 0.2
    protocol, transport = connection_open(json_app)
    # Each request comes within the deadline of the previous answer, but the first past the
    # deadline the connection opened with: the timer armed then must not close it.
    for _ in range(3):
        await asyncio.sleep(0.12)
        protocol.data_received(GET)
        await answered(transport, writes=len(transport.writes) + 1)
    assert not transport.closed
    assert len(transport.writes) == 3
    # Then nothing: closed once the deadline after the last answer has passed.
    await asyncio.sleep(0.35)
    assert transport.closed
