"""Engines that routers ejected after they failed or hung (outlier detection in the gateway),
so that every decision avoids them for a while, not only the ejecting router's.

``live:ejected``  HASH  instance -> unix time its ejection ends. One field per instance of the
                        inventory at most (names are checked before they are stored); ended
                        ejections are ignored when read and removed by the next report.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from controlplane.redis_connection import redis_async

EJECTED_KEY = "live:ejected"


async def ejections_store_async(
    until: Mapping[str, float], client: aioredis.Redis | None = None
) -> None:
    """Record ejections (instance -> end, unix time); a later end wins over an earlier one's,
    and ejections already over are removed."""
    r = client or redis_async()
    now = time.time()
    current = await r.hgetall(EJECTED_KEY)
    ends = {_text(k): float(v) for k, v in current.items()}
    gone = [name for name, end in ends.items() if end <= now and name not in until]
    merged = {name: max(end, ends.get(name, 0.0)) for name, end in until.items()}
    pipe = r.pipeline(transaction=False)
    if gone:
        pipe.hdel(EJECTED_KEY, *gone)
    if merged:
        pipe.hset(EJECTED_KEY, mapping={k: repr(v) for k, v in merged.items()})
    await pipe.execute()


def ejections_queue(pipe: Any) -> None:
    """One command: every recorded ejection (parse the reply with :func:`ejections_parse`)."""
    pipe.hgetall(EJECTED_KEY)


def ejections_parse(raw: Mapping[Any, Any] | None, now: float) -> frozenset[str]:
    """The instances ejected at ``now``."""
    out = []
    for k, v in (raw or {}).items():
        try:
            if float(v) > now:
                out.append(_text(k))
        except ValueError:
            continue
    return frozenset(out)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
