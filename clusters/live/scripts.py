"""Lua scripts of the request path, sent by SHA (EVALSHA) so only their arguments travel.

Each async Redis client loads the scripts once (one ``SCRIPT LOAD`` round trip per process
and event loop). A Redis that restarted has forgotten them: the call that meets ``NOSCRIPT``
fails like any Redis error (decided from the snapshot), :func:`scripts_forget` drops the
client's mark, and the next call loads them again.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis


class LuaScript:
    """A script and its SHA1, as Redis names it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)


_REGISTRY: list[LuaScript] = []
_loaded: weakref.WeakKeyDictionary[aioredis.Redis, bool] = weakref.WeakKeyDictionary()


def lua_script(source: str) -> LuaScript:
    """Declare a request-path script (loaded with all the others)."""
    script = LuaScript(source)
    _REGISTRY.append(script)
    return script


async def scripts_ensure_async(client: aioredis.Redis) -> None:
    """Load every declared script into the server behind ``client``, once."""
    if _loaded.get(client):
        return
    pipe = client.pipeline(transaction=False)
    for script in _REGISTRY:
        pipe.script_load(script.source)
    await pipe.execute()
    _loaded[client] = True


def scripts_forget(client: aioredis.Redis) -> None:
    """The server may have lost the scripts (restart, SCRIPT FLUSH): load them next time."""
    _loaded.pop(client, None)


def is_noscript(exc: BaseException) -> bool:
    return "NOSCRIPT" in str(exc)
