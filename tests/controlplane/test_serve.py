"""The launcher gives each worker a listening socket of its own, so a burst of connections is
shared by the workers; it replaces a worker that dies, stops them all on SIGTERM, and says
plainly why it cannot start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest
from django.conf import settings
from django.db import connection

from controlplane.serve import BALANCED
from tests.support.servers import ROOT, control_plane_serve, free_port
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(not BALANCED, reason="SO_REUSEPORT balances connections on Linux only"),
]

LIVE = b"GET /api/v1/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture
def two_workers() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL, workers=2) as (
        base,
        proc,
    ):
        yield int(base.rsplit(":", 1)[1]), proc


def workers_of(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The launcher's live worker processes (multiprocessing's resource tracker is not one;
    a worker that died and is not yet reaped is not either)."""
    found = []
    for p in psutil.Process(proc.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                found.append(p)
        except psutil.Error:
            continue  # gone meanwhile
    return found


def answered(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the connection closed before an answer"
        data += chunk
    return data.split(b"\r\n", 1)[0]


def burst(port: int, n: int) -> list[socket.socket]:
    """``n`` connections opened at once, each answered once (so each is accepted)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    for s in socks:
        s.sendall(LIVE)
    for s in socks:
        assert answered(s) == b"HTTP/1.1 200 OK"
    return socks


def holders(workers: list[psutil.Process], socks: list[socket.socket]) -> dict[int, int]:
    """Worker pid -> how many of ``socks`` it holds the server side of."""
    ours = {s.getsockname()[1] for s in socks}
    held: dict[int, int] = {}
    for worker in workers:
        for conn in worker.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port in ours:
                held[worker.pid] = held.get(worker.pid, 0) + 1
    return held


def test_a_burst_of_connections_is_shared_by_both_workers(
    two_workers: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = two_workers
    workers = wait_for("two workers", lambda: len(workers_of(proc)) == 2 and workers_of(proc))
    socks = burst(port, 16)
    try:
        held = holders(workers, socks)
    finally:
        for s in socks:
            s.close()
    # All on one worker (as behind one shared socket) would be 2 chances in 65,536 here.
    assert sum(held.values()) == 16
    assert len(held) == 2, held


def test_a_worker_that_dies_is_replaced_and_the_address_keeps_answering(
    two_workers: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = two_workers
    before = wait_for("two workers", lambda: len(workers_of(proc)) == 2 and workers_of(proc))
    before[0].kill()
    after = wait_for(
        "a replacement worker",
        lambda: (
            len(ws := workers_of(proc)) == 2 and before[0].pid not in {w.pid for w in ws} and ws
        ),
    )
    assert before[1].pid in {w.pid for w in after}
    # The replacement listens too: a burst reaches both workers again.
    socks = wait_for("a burst on both workers", lambda: _burst_on_both(port, after))
    for s in socks:
        s.close()


def _burst_on_both(port: int, workers: list[psutil.Process]) -> list[socket.socket] | None:
    socks = burst(port, 16)
    if len(holders(workers, socks)) == 2:
        return socks
    for s in socks:
        s.close()
    return None


def test_sigterm_stops_every_worker_and_the_launcher_exits_cleanly(
    two_workers: tuple[int, subprocess.Popen[bytes]],
) -> None:
    _, proc = two_workers
    workers = wait_for("two workers", lambda: len(workers_of(proc)) == 2 and workers_of(proc))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive
    assert len(gone) == 2


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": "sqlite:///:memory:",
        "REDIS_URL": settings.REDIS_URL,
        "LOG_LEVEL": "WARNING",
    }
    return subprocess.run(
        [sys.executable, "-m", "controlplane.serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_taken_address_is_named_and_nothing_is_started() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = launch("--workers", "2", "--port", str(port))
    assert result.returncode == 1
    assert f"cannot bind 127.0.0.1:{port}" in result.stderr


def test_an_app_that_cannot_start_stops_the_launcher_with_uvicorns_startup_status() -> None:
    result = launch("no_such_module:app", "--workers", "2", "--port", str(free_port()))
    assert result.returncode == 3
    assert "no_such_module" in result.stderr
    assert "failed to start; stopping" in result.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [(("--workers", "0"), "--workers"), (("--port", "70000"), "--port")],
)
def test_bad_options_are_named(args: tuple[str, ...], named: str) -> None:
    result = launch(*args)
    assert result.returncode == 2
    assert named in result.stderr
