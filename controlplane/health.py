"""What the process depends on, checked: the database, Redis and the Celery broker.

Readiness (``GET /api/v1/health``) reports each dependency, so an outage is visible even while
routing keeps answering from its snapshot; liveness (``GET /api/v1/health/live``) only says the
process answers. Each check is bounded in time (the database by its connect timeout, Redis by
its socket timeouts) and never raises.

:func:`db_connection_reset` is the other half of surviving an outage: off Django's request
cycle (the route fast path, workers) nothing closes a connection the database dropped, and a
dead connection would fail every query after the database is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from django.conf import settings
from django.db import Error as DatabaseError
from django.db import connection

from controlplane.redis_connection import redis_sync

BROKER_TIMEOUT_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class DependencyStatus:
    """One dependency as a readiness check saw it: up or not, why not, and how long it took."""

    name: str
    up: bool
    latency_ms: float
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"up": self.up, "latency_ms": round(self.latency_ms, 2)}
        if self.detail:
            out["detail"] = self.detail
        return out


def db_connection_reset() -> None:
    """Close this thread's database connection if the database broke it (not inside a
    transaction: that one is its owner's to end)."""
    broken = connection.connection is not None and connection.errors_occurred
    if broken and not connection.in_atomic_block:
        connection.close_if_unusable_or_obsolete()


def db_call(fn: Callable[[], T]) -> T:
    """``fn()``, tried again once on a fresh connection when the connection it found had been
    dropped by the database (a restart, an idle timeout, an outage just ended); a database
    that is really away fails both, and the error is raised."""
    db_connection_reset()
    reused = connection.connection is not None and not connection.in_atomic_block
    try:
        return fn()
    except DatabaseError:
        db_connection_reset()
        if not reused:
            raise
    return fn()


def _failure(exc: BaseException) -> str:
    # The class only: readiness is public, and messages name hosts and ports (the logs have them).
    return type(exc).__name__


def database_status() -> DependencyStatus:
    started = time.perf_counter()
    try:
        db_connection_reset()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any failure means: not ready
        db_connection_reset()
        return DependencyStatus("database", False, _ms(started), _failure(exc))
    return DependencyStatus("database", True, _ms(started))


def redis_status() -> DependencyStatus:
    started = time.perf_counter()
    try:
        redis_sync().ping()
    except Exception as exc:
        return DependencyStatus("redis", False, _ms(started), _failure(exc))
    return DependencyStatus("redis", True, _ms(started))


def broker_status(redis_seen: DependencyStatus) -> DependencyStatus:
    """The Celery broker: ``redis_seen`` again when the broker is the same server (the
    default), else a PING of ``CELERY_BROKER_URL`` (with live state on a Redis Cluster,
    ``redis_seen`` is the cluster's and the broker is pinged on its own)."""
    url = str(settings.CELERY_BROKER_URL)
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    if url == settings.REDIS_URL and not settings.REDIS_CLUSTER_URL:
        return DependencyStatus("broker", redis_seen.up, redis_seen.latency_ms, redis_seen.detail)
    started = time.perf_counter()
    client = redis.Redis.from_url(
        url, socket_timeout=BROKER_TIMEOUT_S, socket_connect_timeout=BROKER_TIMEOUT_S
    )
    try:
        client.ping()
    except Exception as exc:
        return DependencyStatus("broker", False, _ms(started), _failure(exc))
    finally:
        client.close()
    return DependencyStatus("broker", True, _ms(started))


def dependencies_check() -> list[DependencyStatus]:
    """Every dependency, checked now (sync: the database check needs a thread)."""
    seen = redis_status()
    return [database_status(), seen, broker_status(seen)]


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000
