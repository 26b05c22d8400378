"""Redis clients for live state: one sync client per process, one async client per event loop.

Timeouts are short on purpose: the request path must answer from its snapshot when Redis is
slow or gone (``telemetry_stale``), never hang on it. Bulk ingest (KV events from agents) has
its own client per event loop with a longer timeout (:func:`redis_async_ingest`): a post of
thousands of batches waits behind other agents' posts, and an agent retries anyway.

With ``REDIS_CLUSTER_URL`` set the same three are redis-py's cluster clients (sync and
asyncio) on that cluster: every store keeps its keys in one slot per script
(:mod:`clusters.live.keys`), so the code above them is the same for both.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, cast
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry

# Seconds. A refused connection (Redis down) fails at once; these bound a hung or blackholed
# server, and leave room for a burst opening many connections at once.
SOCKET_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 1.0
ASYNC_POOL_SIZE = 48
# redis-py's asyncio cluster client has no blocking pool: past its bound a command fails at
# once (MaxConnectionsError, which the route path takes as Redis unavailable). Per node, above
# the concurrency one worker reaches; Redis holds thousands of clients.
CLUSTER_POOL_SIZE = 512
INGEST_TIMEOUT_S = 15.0
INGEST_POOL_SIZE = 8

_sync_lock = threading.Lock()
_sync_client: redis.Redis | None = None
_sync_url: str | None = None
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, aioredis.Redis]] = (
    weakref.WeakKeyDictionary()
)
_ingest_clients: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, tuple[str, aioredis.Redis]
] = weakref.WeakKeyDictionary()


def live_store_is_cluster() -> bool:
    """Whether live state is on a Redis Cluster (scripts then go one per hash slot)."""
    return bool(settings.REDIS_CLUSTER_URL)


def _live_url() -> str:
    return str(settings.REDIS_CLUSTER_URL or settings.REDIS_URL)


def redis_cluster_seeds(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a cluster URL: ``redis+cluster://h:p,h:p`` or ``redis://h:p``."""
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1]
    seeds = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        seeds.append((host or part, int(port or 6379)))
    return seeds


def redis_cluster_sync(url: str, **options: Any) -> redis.Redis:
    """A sync cluster client (typed as :class:`redis.Redis`: it speaks the same commands)."""
    nodes = [ClusterNode(host, port) for host, port in redis_cluster_seeds(url)]
    return cast(redis.Redis, redis.RedisCluster(startup_nodes=nodes, **options))


def redis_cluster_async(url: str, **options: Any) -> aioredis.Redis:
    nodes = [AsyncClusterNode(host, port) for host, port in redis_cluster_seeds(url)]
    return cast(aioredis.Redis, aioredis.RedisCluster(startup_nodes=nodes, **options))


def redis_sync() -> redis.Redis:
    """The process's sync client for live state (rebuilt if the settings change)."""
    global _sync_client, _sync_url
    url = _live_url()
    with _sync_lock:
        if _sync_client is None or _sync_url != url:
            options: dict[str, Any] = {
                "socket_timeout": SOCKET_TIMEOUT_S * 2,
                "socket_connect_timeout": CONNECT_TIMEOUT_S * 2,
            }
            if settings.REDIS_CLUSTER_URL:
                _sync_client = redis_cluster_sync(url, **options)
            else:
                # No retries: redis-py's default re-sends a whole pipeline after a timeout,
                # and a pipeline of counters (traffic windows, metrics) the server had already
                # applied would then count twice. Callers handle a failed call.
                _sync_client = redis.Redis.from_url(
                    url, health_check_interval=30, retry=Retry(NoBackoff(), 0), **options
                )
            _sync_url = url
        return _sync_client


def _loop_client(
    clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, aioredis.Redis]],
    pool_size: int,
    timeout_s: float,
) -> aioredis.Redis:
    """The running event loop's client from ``clients`` (async clients cannot cross loops),
    made anew when the live-state URL changed: a bounded pool that waits for a free
    connection (a burst shares a few dozen connections instead of opening hundreds at once),
    no retries (the caller's deadline decides; a stale answer beats a late one). On a cluster,
    a bounded pool per node; a command that meets a failover is sent again once the slots are
    read anew (the caller's deadline still bounds the wait)."""
    loop = asyncio.get_running_loop()
    url = _live_url()
    entry = clients.get(loop)
    if entry is not None and entry[0] == url:
        return entry[1]
    client: aioredis.Redis
    if settings.REDIS_CLUSTER_URL:
        client = redis_cluster_async(
            url,
            max_connections=max(pool_size, CLUSTER_POOL_SIZE),
            socket_timeout=timeout_s,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
        )
    else:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=pool_size,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
        )
        client = aioredis.Redis(connection_pool=pool, retry=AsyncRetry(NoBackoff(), 0))
    clients[loop] = (url, client)
    return client


def redis_async() -> aioredis.Redis:
    """The route path's client of the running event loop: short timeouts."""
    return _loop_client(_async_clients, ASYNC_POOL_SIZE, SOCKET_TIMEOUT_S)


def redis_async_ingest() -> aioredis.Redis:
    """The event loop's client for bulk ingest: a small pool, a long timeout, no retries (a
    batch applied twice is skipped by its sequence number, so the agent's retry is safe)."""
    return _loop_client(_ingest_clients, INGEST_POOL_SIZE, INGEST_TIMEOUT_S)
