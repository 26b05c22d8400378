"""Scripts sent alone (``script_call_async``) against real Redis: the reply a pipeline gives,
the server's errors as they are, and a helper that queues other than one command refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from clusters.live.scripts import (
    COUNTERS_SCRIPT,
    counters_queue,
    script_call_async,
    scripts_ensure_async,
    scripts_forget,
)
from controlplane.redis_connection import redis_async


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


def test_a_server_that_lost_its_scripts_says_noscript(redis_client: redis.Redis) -> None:
    async def run() -> None:
        client = redis_async()
        await scripts_ensure_async(client)
        await client.script_flush()
        try:
            await script_call_async(client, lambda pipe: counters_queue(pipe, [("s:b", "n", 1, 0)]))
        finally:
            scripts_forget(client)
            await client.aclose()

    with pytest.raises(redis.exceptions.NoScriptError):
        asyncio.run(run())


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
