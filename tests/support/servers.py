"""Real servers that tests start: the control plane under uvicorn on a free local port and a
Celery worker on the test database; each stopped when the test is done with it (a private
redis-server: :class:`tests.support.processes.RedisServer`, the ``own_redis`` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest
from django.conf import settings

from controlplane.celery import worker_argv, worker_stop
from tests.support.processes import free_port as free_port

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def control_plane_serve(
    database: dict[str, object],
    redis_url: str,
    workers: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The real app under uvicorn on `database` (a Django connection's settings_dict), with
    `extra_env` (settings) added to its environment.

    Yields its base URL and the process, which a test may kill itself to see the app go away.
    """
    port = free_port()
    env = {
        "DATABASE_URL": (
            f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}"
            f"/{database['NAME']}"
        ),
        "REDIS_URL": redis_url,
        # Live state where the test's settings have it (a Redis Cluster under
        # ``make test-cluster``, unless the test points it back at a Redis of its own).
        "REDIS_CLUSTER_URL": settings.REDIS_CLUSTER_URL,
        "PATH": "/usr/bin:/bin",
        "LOG_LEVEL": "WARNING",
        **(extra_env or {}),
    }
    if workers > 1:
        # As deployed (docker-compose.yml): workers on listening sockets of their own.
        command = [str(ROOT / ".venv/bin/python"), "-m", "controlplane.serve"]
        command += ["--workers", str(workers)]
    else:
        command = [str(ROOT / ".venv/bin/uvicorn"), "controlplane.asgi:application"]
        command += ["--http", "controlplane.http_protocol:HeaderDeadlineProtocol"]
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
            pytest.fail(f"the control plane did not start: {err}")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=20)


def celery_worker_start(log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """``celery -A controlplane worker`` (solo pool) on the test database and the app's Redis,
    in its own session so that :func:`celery_worker_stop` can signal it whole.

    ``log``: where its output goes (the test's own output when None).
    """
    db = settings.DATABASES["default"]
    env = dict(os.environ)
    env["DATABASE_URL"] = (
        f"postgres://{db['USER']}:{db.get('PASSWORD') or ''}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    )
    env["REDIS_URL"] = settings.REDIS_URL
    env["REDIS_CLUSTER_URL"] = settings.REDIS_CLUSTER_URL
    return subprocess.Popen(
        worker_argv(sys.executable),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        start_new_session=True,
    )


# The tests call it by the name they start workers with (celery_worker_start).
celery_worker_stop = worker_stop
