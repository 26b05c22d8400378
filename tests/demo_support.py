"""Helpers for tests that start the demo stack as a subprocess (tests/test_demo.py,
tests/test_docs_api.py): free ports, and a database and Redis db of its own when the suite runs
against real services, so that a demo never touches the suite's test database."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


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
