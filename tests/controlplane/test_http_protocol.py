"""Slow clients are let go: the attack of issue 13 (300 connections dripping header bytes were
never closed), against the real app under uvicorn with a 1 s header deadline."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest
from django.db import connection

from tests.support.servers import control_plane_serve

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 50
DRIPS = 40  # bytes each client would send, 0.2 s apart (8 s in all)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


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
