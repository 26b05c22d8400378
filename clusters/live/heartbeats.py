"""When each instance last gave a sign of life, and how fast a token registers.

An instance's heartbeat is the newer of its latest telemetry sample (``live:insts``, written
by every ``POST /telemetry`` that names it) and its latest registration (``PUT
/registrations/{name}``, which an agent repeats while its engine answers). The reachability
sweep (:mod:`clusters.reachability`) reads both.

Key layout:

``live:registered``              HASH  instance -> unix time of its last registration.
``live:regrate:{token}:{minute}`` STRING registrations by one token in one wall-clock minute
                                       (expires after two minutes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from clusters.live.telemetry import INSTANCES_KEY
from controlplane.redis_connection import redis_sync

REGISTERED_KEY = "live:registered"
_RATE_KEY = "live:regrate:{token}:{minute}"


def registration_seen(name: str, ts: float | None = None) -> None:
    """Record that ``name`` was registered (a heartbeat) at ``ts`` (now by default)."""
    redis_sync().hset(REGISTERED_KEY, name, repr(time.time() if ts is None else ts))


def heartbeats_read(names: Sequence[str]) -> dict[str, float]:
    """The latest heartbeat of each of ``names``; instances never heard of are left out."""
    if not names:
        return {}
    pipe = redis_sync().pipeline(transaction=False)
    pipe.hmget(INSTANCES_KEY, list(names))
    pipe.hmget(REGISTERED_KEY, list(names))
    samples, registered = pipe.execute()
    out: dict[str, float] = {}
    for name, sample, reg in zip(names, samples, registered, strict=True):
        seen = [float(sample.split(b",", 1)[0])] if sample else []
        if reg:
            seen.append(float(reg))
        if seen:
            out[name] = max(seen)
    return out


def heartbeats_forget(name: str) -> None:
    """Forget an instance's last sample and registration (it was retired)."""
    pipe = redis_sync().pipeline(transaction=False)
    pipe.hdel(INSTANCES_KEY, name)
    pipe.hdel(REGISTERED_KEY, name)
    pipe.execute()


def registrations_count(token: str, now: float | None = None) -> int:
    """Count one registration by ``token`` in the current minute; returns the minute's count."""
    minute = int((time.time() if now is None else now) // 60)
    key = _RATE_KEY.format(token=token, minute=minute)
    pipe = redis_sync().pipeline(transaction=True)
    pipe.incr(key)
    pipe.expire(key, 120)
    count, _ = pipe.execute()
    return int(count)
