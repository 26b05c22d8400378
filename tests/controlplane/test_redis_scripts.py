"""The one way to run a Lua script, against real Redis: replies as a pipeline gives them, and a
server that lost its scripts (failover, restart, SCRIPT FLUSH) recovered from in the same call,
every way a script is sent, without running anything twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from clusters.live.scripts import COUNTERS_SCRIPT, counters_queue
from controlplane.redis_scripts import (
    lua_script,
    lua_scripts,
    pipeline_run,
    pipeline_run_async,
    script_call_async,
)
from tests.support.processes import RedisServer

INCR = lua_script("return redis.call('INCRBY', KEYS[1], ARGV[1])", "test incr")


@pytest.fixture
def private_redis(own_redis: RedisServer) -> str:
    """A redis-server of the test's own: its script cache is flushed here, server-wide."""
    return own_redis.url


def test_a_declared_script_is_listed_once_by_name() -> None:
    again = lua_script("return redis.call('INCRBY', KEYS[1], ARGV[1])", "test incr")
    assert again.sha == INCR.sha
    assert [s.name for s in lua_scripts()].count("test incr") == 1
    assert {"counters", "link reserve", "prefix match", "prefix apply"} <= {
        s.name for s in lua_scripts()
    }


def test_a_script_run_on_a_server_that_never_saw_it_runs_once(private_redis: str) -> None:
    client = redis.Redis.from_url(private_redis)
    client.script_flush()
    assert INCR.run(client, ["n"], [2]) == 2
    client.script_flush()
    assert INCR.run(client, ["n"], [3]) == 5
    assert client.script_exists(COUNTERS_SCRIPT.sha) == [True]  # all of them came back


def test_an_async_run_after_a_flush_runs_once(private_redis: str) -> None:
    async def run() -> list[int]:
        client = aioredis.from_url(private_redis)
        try:
            first = await INCR.run_async(client, ["a"], [1])
            await client.script_flush()
            return [first, await INCR.run_async(client, ["a"], [1])]
        finally:
            await client.aclose()

    assert asyncio.run(run()) == [1, 2]


def test_a_script_sent_alone_replies_and_acts_as_in_a_pipeline(private_redis: str) -> None:
    rows = [("s:a", "n", 2, 0)]

    async def run() -> tuple[Any, Any]:
        client = aioredis.from_url(private_redis)
        try:
            alone = await script_call_async(client, lambda pipe: counters_queue(pipe, rows))
            piped = await pipeline_run_async(client, lambda pipe: counters_queue(pipe, rows))
            return alone, piped
        finally:
            await client.aclose()

    alone, piped = asyncio.run(run())
    assert alone == 0 and piped == [0]
    assert int(redis.Redis.from_url(private_redis).hget("s:a", "n")) == 4  # type: ignore[arg-type]


def test_every_way_of_sending_recovers_from_a_flush_without_running_twice(
    private_redis: str,
) -> None:
    sync = redis.Redis.from_url(private_redis)

    def twice(pipe: Any) -> None:
        INCR.queue(pipe, ["piped"], [1])
        INCR.queue(pipe, ["piped"], [1])

    def read_and_script(pipe: Any) -> None:
        pipe.get("alone")
        INCR.queue(pipe, ["sync"], [5])

    async def run() -> None:
        client = aioredis.from_url(private_redis)
        try:
            await client.script_flush()
            await script_call_async(client, lambda pipe: INCR.queue(pipe, ["alone"], [1]))
            await client.script_flush()
            assert await pipeline_run_async(client, twice) == [1, 2]
        finally:
            await client.aclose()

    asyncio.run(run())
    sync.script_flush()
    assert pipeline_run(sync, read_and_script) == [b"1", 5]
    assert [int(sync.get(k) or 0) for k in ("alone", "piped", "sync")] == [1, 2, 5]


def test_other_errors_are_raised_as_they_are(private_redis: str) -> None:
    client = redis.Redis.from_url(private_redis)
    client.set("text", "not a number")
    with pytest.raises(redis.exceptions.ResponseError, match="not an integer"):
        INCR.run(client, ["text"], [1])


def test_a_helper_that_queues_two_commands_or_none_is_refused(private_redis: str) -> None:
    def two(pipe: Any) -> None:
        COUNTERS_SCRIPT.queue(pipe, [], ["live:nolist", 1, 0, 0])
        COUNTERS_SCRIPT.queue(pipe, [], ["live:nolist", 1, 0, 0])

    async def run(queue: Any) -> None:
        client = aioredis.from_url(private_redis)
        try:
            await script_call_async(client, queue)
        finally:
            await client.aclose()

    with pytest.raises(RuntimeError, match="queued two"):
        asyncio.run(run(two))
    with pytest.raises(RuntimeError, match="queued no command"):
        asyncio.run(run(lambda pipe: counters_queue(pipe, [])))
