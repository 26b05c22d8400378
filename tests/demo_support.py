"""Helpers for tests that start the demo stack as a subprocess (tests/test_demo.py,
tests/test_docs_api.py): free ports, and a database and Redis db of its own when the suite runs
against real services, so that a demo never touches the suite's test database."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
import pytest
from django.conf import settings

from tests.support.servers import free_port

ROOT = Path(settings.BASE_DIR)


def _database_url(url: str, suffix: str) -> str:
    """A database of its own beside the configured one (recreated empty)."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    own = f"{name}_{suffix}"
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{own}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{own}"')
    return urlunsplit(parts._replace(path=f"/{own}"))


def _redis_url(url: str, candidates: tuple[int, ...]) -> str:
    """Another database number on the configured Redis server (the highest ones, which the
    per-engineer and CI configurations leave alone), emptied."""
    import redis

    parts = urlsplit(url)
    db = int(parts.path.lstrip("/") or 0)
    other = next(n for n in candidates if n != db)
    own = urlunsplit(parts._replace(path=f"/{other}"))
    redis.Redis.from_url(own).flushdb()
    return own


def services_env(env: dict[str, str], suffix: str, redis_dbs: tuple[int, ...]) -> dict[str, str]:
    """``env`` pointed at the demo's own services: with DATABASE_URL (PostgreSQL) and REDIS_URL
    set, a fresh database and Redis db; unset, the demo's embedded defaults in its VAR_DIR."""
    out = dict(env)
    if os.environ.get("DATABASE_URL", "").startswith("postgres"):
        out["DATABASE_URL"] = _database_url(os.environ["DATABASE_URL"], suffix)
    else:
        out.pop("DATABASE_URL", None)
    if os.environ.get("REDIS_URL"):
        out["REDIS_URL"] = _redis_url(os.environ["REDIS_URL"], redis_dbs)
    else:
        out.pop("REDIS_URL", None)
    return out


@dataclass
class Demo:
    """A running ``manage.py demo``: its process, address, VAR_DIR, environment and log."""

    process: subprocess.Popen[bytes]
    base: str
    var_dir: Path
    env: dict[str, str]
    log: Path

    def credentials(self) -> dict[str, Any]:
        return dict(json.loads((self.var_dir / "demo-credentials.json").read_text()))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def manage(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a ``manage.py`` command against this demo's services."""
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def wait_for(what: str, probe: Callable[[], Any], demo: Demo, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if demo.process.poll() is not None:
            pytest.fail(f"the demo exited while waiting for {what}:\n{demo.output()[-3000:]}")
        try:
            value = probe()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{demo.output()[-3000:]}")


@contextlib.contextmanager
def demo_running(
    tmp_path: Path,
    suffix: str = "demo",
    redis_dbs: tuple[int, ...] = (15, 14),
    extra_args: tuple[str, ...] = (),
) -> Iterator[Demo]:
    """``manage.py demo`` on a free port with its own VAR_DIR (rebalancer every 20 s, fleet
    clock 4x; ``extra_args`` added to its command line), killed with its children at the end."""
    port = free_port()
    var_dir = tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "EMULATOR_"))}
    env.update(
        VAR_DIR=str(var_dir),
        REBALANCE_INTERVAL_S="20",
        EMULATOR_SPEED="4",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PRODUCTION", None)
    env = services_env(env, suffix, redis_dbs)
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "demo", "--port", str(port), *extra_args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    handle = Demo(process, f"http://127.0.0.1:{port}", var_dir, env, log)
    try:
        yield handle
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait(timeout=10)
