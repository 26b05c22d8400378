"""The one-command counters script against real Redis: hash increments, TTLs, capped list."""

from __future__ import annotations

import asyncio

import redis

from clusters.live.scripts import counters_queue
from controlplane.redis_connection import redis_async
from controlplane.redis_scripts import pipeline_run_async


def _apply(*args: object, **kwargs: object) -> None:
    async def run() -> None:
        client = redis_async()
        await pipeline_run_async(client, lambda pipe: counters_queue(pipe, *args, **kwargs))  # type: ignore[arg-type]
        await client.aclose()

    asyncio.run(run())


def test_integer_and_float_increments_add_up_and_only_rows_with_a_ttl_expire(
    redis_client: redis.Redis,
) -> None:
    _apply([("c:a", "n", 2, 60), ("c:b", "n", 5, 0)], [("c:a", "sum", 0.25, 60)])
    _apply([("c:a", "n", 3, 60)], [("c:a", "sum", 0.5, 60)])
    assert int(redis_client.hget("c:a", "n")) == 5  # type: ignore[arg-type]
    assert float(redis_client.hget("c:a", "sum")) == 0.75  # type: ignore[arg-type]
    assert int(redis_client.hget("c:b", "n")) == 5  # type: ignore[arg-type]
    assert 0 < redis_client.ttl("c:a") <= 60
    assert redis_client.ttl("c:b") == -1


def test_entries_are_pushed_in_order_and_the_list_stays_capped(redis_client: redis.Redis) -> None:
    _apply([], list_key="c:list", list_cap=3, entries=["e1", "e2"])
    _apply([], list_key="c:list", list_cap=3, entries=["e3", "e4"])
    assert redis_client.lrange("c:list", 0, -1) == [b"e4", b"e3", b"e2"]


def test_nothing_to_write_queues_no_command(redis_client: redis.Redis) -> None:
    async def run() -> int:
        client = redis_async()
        pipe = client.pipeline(transaction=False)
        counters_queue(pipe, [])
        n = len(pipe)
        await client.aclose()
        return n

    assert asyncio.run(run()) == 0
