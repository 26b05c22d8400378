"""Scripts sent alone (``script_call_async``) against real Redis: the reply a pipeline gives,
the server's errors as they are, a server that lost its scripts recognised and recovered from,
and a helper that queues other than one command refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from clusters.live.scripts import (
    COUNTERS_SCRIPT,
    counters_queue,
    is_noscript,
    script_call_async,
    scripts_ensure_async,
    scripts_forget,
    scripts_pipeline_async,
)
from controlplane.redis_connection import redis_async
from tests.support.servers import free_port, redis_server_start, redis_server_stop


def _both_ways(rows: list[tuple[str, str, Any, int]]) -> tuple[Any, Any]:
    async def run() -> tuple[Any, Any]:
        client = redis_async()
        await scripts_ensure_async(client)
        alone = await script_call_async(client, lambda pipe: counters_queue(pipe, rows))
        pipe = client.pipeline(transaction=False)
        counters_queue(pipe, rows)
        piped = (await pipe.execute())[0]
        await client.aclose()
        return alone, piped

    return asyncio.run(run())


def test_a_script_sent_alone_replies_and_acts_as_in_a_pipeline(redis_client: redis.Redis) -> None:
    alone, piped = _both_ways([("s:a", "n", 2, 0)])
    assert alone == piped == 0
    assert int(redis_client.hget("s:a", "n")) == 4  # type: ignore[arg-type]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of the test's own: its script cache is server-wide, and flushing the
    shared server's would make other workers' calls meet NOSCRIPT."""
    port = free_port()
    proc = redis_server_start(port, tmp_path)
    yield f"redis://127.0.0.1:{port}/0"
    redis_server_stop(proc)


def test_a_server_that_lost_its_scripts_says_noscript(private_redis: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(private_redis)
        await scripts_ensure_async(client)
        await client.script_flush()
        try:
            await script_call_async(client, lambda pipe: counters_queue(pipe, [("s:b", "n", 1, 0)]))
        finally:
            scripts_forget(client)
            await client.aclose()

    with pytest.raises(redis.exceptions.NoScriptError):
        asyncio.run(run())


def test_a_script_the_server_does_not_know_is_told_apart_from_other_errors(
    redis_client: redis.Redis,
) -> None:
    with pytest.raises(redis.exceptions.NoScriptError) as lost:
        redis_client.evalsha("0" * 40, 0)
    with pytest.raises(redis.exceptions.ResponseError) as other:
        redis_client.execute_command("HGET", "s:only-one-argument")
    # redis-py strips the NOSCRIPT code from the message: the type is what tells.
    assert is_noscript(lost.value)
    assert not is_noscript(other.value)


def test_a_pipeline_of_scripts_is_sent_again_once_the_lost_scripts_are_loaded(
    private_redis: str,
) -> None:
    async def run() -> list[Any]:
        client = aioredis.from_url(private_redis)
        await scripts_ensure_async(client)
        await client.script_flush()
        try:
            return await scripts_pipeline_async(
                client, lambda pipe: counters_queue(pipe, [("s:c", "n", 1, 0)])
            )
        finally:
            scripts_forget(client)
            await client.aclose()

    assert asyncio.run(run()) == [0]
    # Refused, loaded again, then run once: not twice.
    assert int(redis.Redis.from_url(private_redis).hget("s:c", "n")) == 1  # type: ignore[arg-type]


def test_a_helper_that_queues_two_commands_or_none_is_refused(redis_client: redis.Redis) -> None:
    def two(pipe: Any) -> None:
        COUNTERS_SCRIPT.queue(pipe, [], ["live:nolist", 1, 0, 0])
        COUNTERS_SCRIPT.queue(pipe, [], ["live:nolist", 1, 0, 0])

    async def run(queue: Any) -> None:
        client = redis_async()
        try:
            await script_call_async(client, queue)
        finally:
            await client.aclose()

    with pytest.raises(RuntimeError, match="queued two"):
        asyncio.run(run(two))
    with pytest.raises(RuntimeError, match="queued no command"):
        asyncio.run(run(lambda pipe: counters_queue(pipe, [])))
