"""A TCP proxy a test controls, in front of a real server: it forwards, refuses connections
(the server is down) or stalls them (the server's port accepts but nothing answers: a hung
process), switched at any time without restarting the server behind it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.servers import free_port

FORWARD, REFUSE, STALL = "forward", "refuse", "stall"


class TcpProxy:
    """``127.0.0.1:port`` -> ``upstream``; ``mode`` is forward, refuse or stall. Switching to
    refuse closes the listening socket and every open connection; to stall, connections are
    accepted and held, and nothing more is forwarded either way on any connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.mode = FORWARD
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(512)
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def set(self, mode: str) -> None:
        with self._lock:
            before, self.mode = self.mode, mode
            if mode == REFUSE and self._listener is not None:
                # (shut down first: a close alone leaves a blocked accept() accepting)
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
                self._listener = None
                for conn in list(self._open):
                    with contextlib.suppress(OSError):
                        conn.close()
                self._open.clear()
            elif before == REFUSE and mode != REFUSE:
                self._listen()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: refusing, or stopped
            with self._lock:
                self._open.add(client)
                mode = self.mode
            if mode == STALL:
                continue  # held open, never answered
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open.add(server)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                # Stalled: what arrives is held (connections open before the stall hang too).
                while self.mode == STALL and not self._stopped.is_set():
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)

    def close(self) -> None:
        self._stopped.set()
        self.set(REFUSE)


@contextmanager
def tcp_proxy(base_url: str) -> Iterator[TcpProxy]:
    """A proxy in front of ``http://host:port``; closed (every connection too) at the end."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    proxy = TcpProxy((host, int(port)))
    try:
        yield proxy
    finally:
        proxy.close()
