"""Lua scripts, one way to run them: by SHA (EVALSHA), so only the arguments travel.

A Redis that does not know a script (first use, a restart, a failover to a replica that never
saw it, ``SCRIPT FLUSH``) refuses it with ``NOSCRIPT`` before running anything, and redis-py
raises :class:`redis.exceptions.NoScriptError` (whose message has the code stripped). Every way
of sending a script here answers that the same way: load the declared scripts, send once more.
No per-client "loaded" mark is kept, so nothing can go stale: a server that lost its scripts
costs the one call that meets it a second round trip.

Three ways in, one rule:

* :meth:`LuaScript.run` / :meth:`LuaScript.run_async`: one script, one command;
* :func:`script_call_async`: the one scripted command a ``*_queue(pipe, ...)`` helper queues,
  sent alone (a one-command redis-py pipeline costs more client CPU than the command);
  :func:`scripts_call_async`: the same for a helper that queues one command per hash slot on
  a cluster (alone when it queued one, a pipeline otherwise);
* :func:`pipeline_run` / :func:`pipeline_run_async`: several commands in one pipeline. A
  refused script ran nothing, but the pipeline's plain commands did; the whole pipeline is sent
  again, so pipelines given here hold scripts and reads only, never a plain write.

Scripts declare the keys they touch in ``KEYS`` where they can; the ones that compute keys
inside say so in their own module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.commands.core import CoreCommands
from redis.exceptions import NoScriptError

Queue = Callable[[Any], None]


class LuaScript:
    """A script, its name (for people: benches, logs) and its SHA1, as Redis names it."""

    def __init__(self, source: str, name: str) -> None:
        self.source = source
        self.name = name
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> None:
        """Queue the script on ``pipe`` (a pipeline run by :func:`pipeline_run` or
        :func:`pipeline_run_async`, or the one command of :func:`script_call_async`).
        Spelled as a raw command: redis-py's cluster pipelines refuse ``pipe.evalsha``, and
        route the command by its keys like any other."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def run(self, client: redis.Redis, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            scripts_load(client)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    async def run_async(
        self, client: aioredis.Redis, keys: Sequence[Any] = (), args: Sequence[Any] = ()
    ) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await scripts_load_async(client)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


_REGISTRY: dict[str, LuaScript] = {}


def lua_script(source: str, name: str) -> LuaScript:
    """Declare a script; every declared script is loaded when any one is refused."""
    script = LuaScript(source, name)
    _REGISTRY.setdefault(script.sha, script)
    return script


def lua_scripts() -> tuple[LuaScript, ...]:
    """Every declared script (benches name what Redis reports by SHA)."""
    return tuple(_REGISTRY.values())


def scripts_load(client: redis.Redis) -> None:
    if isinstance(client, redis.RedisCluster):
        # SCRIPT LOAD goes to every master (a cluster pipeline would send it to one node).
        for script in _REGISTRY.values():
            client.script_load(script.source)
        return
    pipe = client.pipeline(transaction=False)
    for script in _REGISTRY.values():
        pipe.script_load(script.source)
    pipe.execute()


async def scripts_load_async(client: aioredis.Redis) -> None:
    if isinstance(client, aioredis.RedisCluster):
        for script in _REGISTRY.values():
            await client.script_load(script.source)
        return
    pipe = client.pipeline(transaction=False)
    for script in _REGISTRY.values():
        pipe.script_load(script.source)
    await pipe.execute()


class _OneCommand:
    """What a ``*_queue(pipe, ...)`` helper queues, taken as one command to send alone."""

    def __init__(self) -> None:
        self.args: tuple[Any, ...] = ()

    def execute_command(self, *args: Any) -> None:
        if self.args:
            raise RuntimeError("script_call_async sends one command; this helper queued two")
        self.args = args


class _Commands(CoreCommands):
    """What a ``*_queue(pipe, ...)`` helper queues (scripts and plain reads), kept to send
    alone or pipelined."""

    def __init__(self) -> None:
        self.commands: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.commands.append((args, options))


async def scripts_call_async(client: aioredis.Redis, queue: Queue) -> list[Any]:
    """The replies of the scripted commands ``queue(pipe)`` queues: one command is sent alone
    (as :func:`script_call_async`), several in one pipeline (:func:`pipeline_run_async`)."""
    got = _Commands()  # type: ignore[abstract]
    queue(got)
    if len(got.commands) == 1:
        return [await script_call_async(client, queue)]

    def again(pipe: Any) -> None:
        for args, options in got.commands:
            pipe.execute_command(*args, **options)

    return await pipeline_run_async(client, again)


async def script_call_async(client: aioredis.Redis, queue: Queue) -> Any:
    """Send the one scripted command ``queue(pipe)`` queues, without a pipeline, and return
    its reply (the same replies and errors as a one-command pipeline, for less client CPU)."""
    one = _OneCommand()
    queue(one)
    if not one.args:
        raise RuntimeError("the helper queued no command")
    try:
        return await client.execute_command(*one.args)
    except NoScriptError:
        await scripts_load_async(client)
        return await client.execute_command(*one.args)


def pipeline_run(client: redis.Redis, queue: Queue) -> list[Any]:
    """Send what ``queue(pipe)`` queues (scripts and reads only) in one pipeline.

    On redis-py's sync cluster client the commands go one by one instead: its pipeline asks
    a node ``COMMAND GETKEYS`` for every command it queues (a round trip each, more than the
    command). Off the route path only (the async client's pipeline does not)."""
    if isinstance(client, redis.RedisCluster):
        got = _Commands()
        queue(got)
        out = []
        for args, options in got.commands:
            try:
                out.append(client.execute_command(*args, **options))
            except NoScriptError:
                scripts_load(client)
                out.append(client.execute_command(*args, **options))
        return out
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        queue(pipe)
        try:
            return list(pipe.execute())
        except NoScriptError:
            if attempt == 2:
                raise
            scripts_load(client)
    raise AssertionError("unreachable")


async def pipeline_run_async(client: aioredis.Redis, queue: Queue) -> list[Any]:
    """Send what ``queue(pipe)`` queues (scripts and reads only) in one pipeline."""
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        queue(pipe)
        try:
            return list(await pipe.execute())
        except NoScriptError:
            if attempt == 2:
                raise
            await scripts_load_async(client)
    raise AssertionError("unreachable")
