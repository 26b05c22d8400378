"""Lua scripts of the request path, sent by SHA (EVALSHA) so only their arguments travel.

Each async Redis client loads the scripts once (one ``SCRIPT LOAD`` round trip per process
and event loop). A Redis that restarted has forgotten them: the call that meets ``NOSCRIPT``
fails like any Redis error (decided from the snapshot), :func:`scripts_forget` drops the
client's mark, and the next call loads them again.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis


class LuaScript:
    """A script, its name (for people: benches and logs) and its SHA1, as Redis names it."""

    def __init__(self, source: str, name: str) -> None:
        self.source = source
        self.name = name
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)


_REGISTRY: list[LuaScript] = []
_loaded: weakref.WeakKeyDictionary[aioredis.Redis, bool] = weakref.WeakKeyDictionary()


def lua_script(source: str, name: str) -> LuaScript:
    """Declare a request-path script (loaded with all the others)."""
    script = LuaScript(source, name)
    _REGISTRY.append(script)
    return script


def lua_scripts() -> tuple[LuaScript, ...]:
    """Every declared request-path script (benches name what Redis reports by SHA)."""
    return tuple(_REGISTRY)


async def scripts_ensure_async(client: aioredis.Redis) -> None:
    """Load every declared script into the server behind ``client``, once."""
    if _loaded.get(client):
        return
    pipe = client.pipeline(transaction=False)
    for script in _REGISTRY:
        pipe.script_load(script.source)
    await pipe.execute()
    _loaded[client] = True


class _OneCommand:
    """What a ``*_queue(pipe, ...)`` helper queues, taken as one command to send alone."""

    def __init__(self) -> None:
        self.args: tuple[Any, ...] = ()

    def evalsha(self, *args: Any) -> None:
        if self.args:
            raise RuntimeError("script_call_async sends one command; this helper queued two")
        self.args = ("EVALSHA", *args)


async def script_call_async(client: aioredis.Redis, queue: Callable[[Any], None]) -> Any:
    """Send the one scripted command ``queue(pipe)`` queues (by SHA: the caller loaded the
    scripts), without a pipeline, and return its reply. A one-command redis-py pipeline cost
    18 to 30 us more client CPU per round trip than the command alone (``bench/redis_client.py``:
    ~120 against ~95-100 us); the replies and errors are the same."""
    one = _OneCommand()
    queue(one)
    if not one.args:
        raise RuntimeError("the helper queued no command")
    return await client.execute_command(*one.args)


def scripts_forget(client: aioredis.Redis) -> None:
    """The server may have lost the scripts (restart, SCRIPT FLUSH): load them next time."""
    _loaded.pop(client, None)


def is_noscript(exc: BaseException) -> bool:
    return "NOSCRIPT" in str(exc)


# Hash counters and a capped list in ONE command: a call's traffic and metrics counters and
# its recent-decisions entries, instead of one HINCRBY/EXPIRE/LPUSH each (redis-py's
# per-command cost dominated the route call). ARGV: list key, list cap, the number of integer
# rows, the number of float rows, then the rows (key, field, incr, ttl_s or 0), then the
# entries to push in order.
_COUNTERS_LUA = """
local list_key, list_cap = ARGV[1], tonumber(ARGV[2])
local n_int, n_float = tonumber(ARGV[3]), tonumber(ARGV[4])
local pos = 5
for i = 1, n_int + n_float do
  local key, field, incr, ttl = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  if i <= n_int then
    redis.call('HINCRBY', key, field, incr)
  else
    redis.call('HINCRBYFLOAT', key, field, incr)
  end
  if ttl > 0 then redis.call('EXPIRE', key, ttl) end
  pos = pos + 4
end
if pos <= #ARGV then
  for i = pos, #ARGV do redis.call('LPUSH', list_key, ARGV[i]) end
  redis.call('LTRIM', list_key, 0, list_cap - 1)
end
return 0
"""
COUNTERS_SCRIPT = lua_script(_COUNTERS_LUA, "counters")

Increment = tuple[str, str, Any, int]


def counters_queue(
    pipe: Any,
    ints: Sequence[Increment],
    floats: Sequence[Increment] = (),
    list_key: str = "",
    list_cap: int = 1,
    entries: Sequence[str] = (),
) -> None:
    """Queue one EVALSHA applying ``(key, field, incr, ttl_s or 0)`` hash increments (integer
    ones, then float ones) and pushing ``entries`` (in order) onto the capped ``list_key``."""
    if not ints and not floats and not entries:
        return
    args: list[Any] = [list_key or "live:nolist", list_cap, len(ints), len(floats)]
    for key, name, incr, ttl in ints:
        args += [key, name, int(incr), ttl]
    for key, name, incr, ttl in floats:
        args += [key, name, repr(float(incr)), ttl]
    args += entries
    COUNTERS_SCRIPT.queue(pipe, [], args)
