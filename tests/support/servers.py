"""Real servers that tests start on a free local port: the control plane under uvicorn and a
private redis-server, each stopped when the test is done with it."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def control_plane_serve(
    database: dict[str, object], redis_url: str, workers: int = 1
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The real app under uvicorn on `database` (a Django connection's settings_dict).

    Yields its base URL and the process, which a test may kill itself to see the app go away.
    """
    port = free_port()
    env = {
        "DATABASE_URL": (
            f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}"
            f"/{database['NAME']}"
        ),
        "REDIS_URL": redis_url,
        "PATH": "/usr/bin:/bin",
        "LOG_LEVEL": "WARNING",
    }
    command = [str(ROOT / ".venv/bin/uvicorn"), "controlplane.asgi:application"]
    if workers > 1:
        command += ["--workers", str(workers)]
    command += ["--port", str(port), "--host", "127.0.0.1", "--log-level", "warning"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            pytest.fail(f"uvicorn did not start: {err}")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=20)


def redis_server_start(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A private redis-server (never the shared one) with no persistence, answering PING."""
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                if client.ping():
                    return proc
            except redis.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    proc.kill()
    proc.wait(timeout=10)
    raise RuntimeError(f"redis-server on port {port} did not start")


def redis_server_stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)
