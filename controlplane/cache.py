"""The Django cache on Redis, failing soft: while Redis cannot be reached, the process's own
memory answers instead.

The cache holds what a page can lose: the login throttle's failure counts (django-axes). A
Redis outage must not turn ``POST /accounts/login/`` into a 500 (issue 33), and it must not
switch the throttle off either: during the outage each process counts failures in its own
memory (a guesser spread over N processes gets at most N times the limit until Redis is back),
and those counts are lost with the process, as the Redis ones are lost with Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.redis import RedisCache

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between warnings while Redis stays away (one line per outage minute, not per login).
WARN_EVERY_S = 60.0
# Bounds a hung Redis: a login waits this long, not the kernel's TCP timeout.
SOCKET_TIMEOUT_S = 1.0


class FailSoftRedisCache(RedisCache):
    """:class:`RedisCache` that answers from a process-local cache when Redis is unreachable."""

    def __init__(self, server: str, params: dict[str, Any]) -> None:
        options = {
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_connect_timeout": SOCKET_TIMEOUT_S,
            **params.get("OPTIONS", {}),
        }
        super().__init__(server, {**params, "OPTIONS": options})
        self._local = LocMemCache(f"fallback-{server}", {**params, "OPTIONS": {}})
        self._warned_at = 0.0

    def _soft(self, name: str, call: Callable[[], T], fallback: Callable[[], T]) -> T:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = time.monotonic()
            if now - self._warned_at > WARN_EVERY_S:
                self._warned_at = now
                log.warning("cache: Redis unreachable (%s); %s from process memory", exc, name)
            return fallback()

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None
    ) -> bool:
        return self._soft(
            "add",
            lambda: super(FailSoftRedisCache, self).add(key, value, timeout, version),
            lambda: self._local.add(key, value, timeout, version),
        )

    def get(self, key: Any, default: Any = None, version: Any = None) -> Any:
        return self._soft(
            "get",
            lambda: super(FailSoftRedisCache, self).get(key, default, version),
            lambda: self._local.get(key, default, version),
        )

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None
    ) -> None:
        self._soft(
            "set",
            lambda: super(FailSoftRedisCache, self).set(key, value, timeout, version),
            lambda: self._local.set(key, value, timeout, version),
        )

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None) -> bool:
        return self._soft(
            "touch",
            lambda: super(FailSoftRedisCache, self).touch(key, timeout, version),
            lambda: self._local.touch(key, timeout, version),
        )

    def delete(self, key: Any, version: Any = None) -> bool:
        return self._soft(
            "delete",
            lambda: super(FailSoftRedisCache, self).delete(key, version),
            lambda: self._local.delete(key, version),
        )

    def get_many(self, keys: Any, version: Any = None) -> dict[str, Any]:
        return self._soft(
            "get_many",
            lambda: super(FailSoftRedisCache, self).get_many(keys, version),
            lambda: self._local.get_many(keys, version),
        )

    def has_key(self, key: Any, version: Any = None) -> bool:
        return self._soft(
            "has_key",
            lambda: super(FailSoftRedisCache, self).has_key(key, version),
            lambda: self._local.has_key(key, version),
        )

    def incr(self, key: Any, delta: int = 1, version: Any = None) -> int:
        return self._soft(
            "incr",
            lambda: super(FailSoftRedisCache, self).incr(key, delta, version),
            lambda: self._local.incr(key, delta, version),
        )

    def set_many(self, data: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None) -> list[Any]:
        return self._soft(
            "set_many",
            lambda: super(FailSoftRedisCache, self).set_many(data, timeout, version),
            lambda: self._local.set_many(data, timeout, version),
        )

    def delete_many(self, keys: Any, version: Any = None) -> None:
        self._soft(
            "delete_many",
            lambda: super(FailSoftRedisCache, self).delete_many(keys, version),
            lambda: self._local.delete_many(keys, version),
        )

    def clear(self) -> None:
        self._local.clear()
        self._soft("clear", lambda: super(FailSoftRedisCache, self).clear(), lambda: None)
