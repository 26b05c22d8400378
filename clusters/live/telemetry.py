"""Telemetry store: the latest state of instances and links, link bandwidth, KV reservations.

Key layout (all under ``live:``; ids are the inventory's instance and link ids as strings):

``live:insts``                      HASH  instance -> latest sample, packed as
                                          ``ts,queue_depth,running,waiting,kv_usage,
                                          queued_prefill_tokens`` (one HMGET reads the whole
                                          fleet on the request path). Fields of instances gone
                                          from the inventory are pruned by
                                          :func:`telemetry_prune`.
``live:links``                      HASH  link -> ``ts,gbps,bytes,interval_s,retransmits``.
``live:linkbw:{link}``               ZSET  one member per link sample,
                                          ``end|seconds|bytes_per_second|nonce``, scored by its
                                          end (unix s). A sample costs one ZADD whatever its
                                          interval (spreading it over 1 s buckets at write time
                                          cost one command per second: 0.2 s of worker time for
                                          an hour-long interval); readers spread it over the
                                          seconds they ask for. Members older than
                                          ``BANDWIDTH_RETENTION_S`` are trimmed on each write and
                                          at most ``BANDWIDTH_MAX_SAMPLES`` are kept a link, so
                                          memory is bounded.
``live:idem:{key}``                 STRING set NX with ``IDEMPOTENCY_TTL_S``: a telemetry
                                          batch whose key is present was already stored.
``live:service``                    HASH  pd cluster -> its latest service counters (JSON
                                          ``[ts, arrivals, first_tokens, [ttft buckets], ttft sum]``,
                                          cumulative, see scheduling.core.service_levels).
``live:resv:{link}``                ZSET  reservation id -> predicted transfer end (unix s).
``live:resv:{link}:b``              HASH  reservation id -> bytes.
``live:resv:{link}:sum``            STRING total bytes of live reservations.
``live:resv:{link}:own``            HASH  on a Redis Cluster: ``id`` (the node that took the link's
                                          reservations), ``hold`` (longest hold admitted, s),
                                          ``horizon`` (latest end), ``fence`` (held full until;
                                          after a failover, see ``_RESERVE_LUA``).

The braces of ``live:resv:{link}`` are literal: the link is the keys' hash tag, so a link's
reservations are in one slot of a Redis Cluster (:mod:`clusters.live.keys`).

Reservations are the in-flight KV bytes on a link. ``link_reserve`` is one Lua script: it first
drops reservations whose transfer has ended, then admits the new one only if the sum stays
within the budget, or, for one bigger than the whole budget, if nothing else is reserved (the
router's rule, :func:`scheduling.core.link.link_admits`: it then holds the link alone). Redis
runs scripts one at a time, so concurrent routers (any number of workers) can never reserve
more than the budget together, except one such request alone.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from clusters.live.keys import reservation_key, reservation_keys, slot_groups
from controlplane.redis_connection import live_store_is_cluster, redis_async, redis_sync
from controlplane.redis_scripts import lua_script, pipeline_run

BANDWIDTH_RETENTION_S = 3900
# Samples kept a link: an hour of 1 s samples, twice over (two agents reporting one link).
BANDWIDTH_MAX_SAMPLES = 8192
IDEMPOTENCY_TTL_S = 24 * 3600
RESERVATION_KEY_TTL_S = 3600
# Expired reservations swept per call, so a script never runs long.
RESERVATION_SWEEP_LIMIT = 2000


@dataclass(frozen=True)
class InstanceSample:
    """One engine's load at a moment, as an agent or a scrape saw it."""

    instance: str
    ts: float
    queue_depth: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int = 0


@dataclass(frozen=True)
class LinkSample:
    """Bytes a link carried over ``interval_s`` seconds ending at ``ts``."""

    link: str
    ts: float
    bytes_sent: int
    interval_s: float
    retransmits: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_sent * 8 / 1e9 / self.interval_s if self.interval_s > 0 else 0.0


@dataclass(frozen=True)
class LinkState:
    """The latest link sample plus the KV bytes reserved on it right now."""

    link: str
    ts: float
    gbps: float
    retransmits: int
    reserved_bytes: int


INSTANCES_KEY = "live:insts"
LINKS_KEY = "live:links"
SERVICE_KEY = "live:service"


async def service_counters_store_async(packed: Mapping[str, str]) -> None:
    """Keep each cluster's latest counters (a report older than the stored one still wins:
    counters are cumulative, so the reader sees them go back and skips that window)."""
    await redis_async().hset(SERVICE_KEY, mapping=dict(packed.items()))


def service_counters_read() -> dict[str, list[Any]]:
    """Every cluster's latest counters, ``[ts, arrivals, first_tokens, [buckets]]``."""
    raw: Mapping[bytes, bytes] = redis_sync().hgetall(SERVICE_KEY)  # type: ignore[assignment]
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _bw_key(link: str) -> str:
    return f"live:linkbw:{link}"


def _idem_key(key: str) -> str:
    return f"live:idem:{key}"


# --- writes -------------------------------------------------------------------------------


def _instance_packed(s: InstanceSample) -> str:
    return (
        f"{float(s.ts)!r},{int(s.queue_depth)},{int(s.running)},{int(s.waiting)},"
        f"{float(s.kv_usage)!r},{int(s.queued_prefill_tokens)}"
    )


def _link_packed(s: LinkSample) -> str:
    return (
        f"{float(s.ts)!r},{s.gbps!r},{int(s.bytes_sent)},{float(s.interval_s)!r},"
        f"{int(s.retransmits)}"
    )


def _bandwidth_member(s: LinkSample) -> tuple[str, int]:
    """The sample as one bandwidth member and its score (end); the reader spreads its bytes
    evenly over the 1 s buckets it covers."""
    seconds = max(1, round(s.interval_s))
    end = int(s.ts)
    return f"{end}|{seconds}|{s.bytes_sent / seconds!r}|{secrets.token_hex(4)}", end


def _queue_batch(
    pipe: Any, instances: Iterable[InstanceSample], links: Iterable[LinkSample]
) -> None:
    """A batch as a few commands whatever its size: one HSET for every instance, one for
    every link (the latest sample of each wins, as one HSET after another would), and per
    link one ZADD of its samples and its trims. Command count is what costs the web worker
    (and Redis) most: a command per sample made a 1,000-sample post 7,000 commands."""
    latest = {s.instance: s for s in instances}  # packed once per instance, not per sample
    latest_instances = {name: _instance_packed(s) for name, s in latest.items()}
    if latest_instances:
        pipe.hset(INSTANCES_KEY, mapping=latest_instances)
    by_link: dict[str, list[LinkSample]] = {}
    for ls in links:
        by_link.setdefault(ls.link, []).append(ls)
    if not by_link:
        return
    pipe.hset(LINKS_KEY, mapping={link: _link_packed(ss[-1]) for link, ss in by_link.items()})
    for link, samples in by_link.items():
        key = _bw_key(link)
        members = dict(_bandwidth_member(ls) for ls in samples)
        newest = max(members.values())
        pipe.zadd(key, members)
        pipe.zremrangebyscore(key, "-inf", f"({newest - BANDWIDTH_RETENTION_S}")
        pipe.zremrangebyrank(key, 0, -BANDWIDTH_MAX_SAMPLES - 1)
        pipe.expire(key, BANDWIDTH_RETENTION_S)


def telemetry_batch_store(
    instances: Sequence[InstanceSample],
    links: Sequence[LinkSample],
    idempotency_key: str | None = None,
    client: redis.Redis | None = None,
) -> bool:
    """Store a batch of samples; False (and nothing written) if its key was seen before."""
    r = client or redis_sync()
    if idempotency_key is not None and not r.set(
        _idem_key(idempotency_key), "1", nx=True, ex=IDEMPOTENCY_TTL_S
    ):
        return False
    # A transaction on a single Redis (readers never see half a batch); a cluster cannot make
    # one across slots, and a reader there may see a batch's links before its instances.
    pipe = r.pipeline(transaction=not live_store_is_cluster())
    _queue_batch(pipe, instances, links)
    try:
        pipe.execute()
    except Exception:
        if idempotency_key is not None:
            r.delete(_idem_key(idempotency_key))
        raise
    return True


async def telemetry_batch_store_async(
    instances: Sequence[InstanceSample],
    links: Sequence[LinkSample],
    idempotency_key: str | None = None,
    client: aioredis.Redis | None = None,
) -> bool:
    """Async twin of :func:`telemetry_batch_store`."""
    r = client or redis_async()
    if idempotency_key is not None and not await r.set(
        _idem_key(idempotency_key), "1", nx=True, ex=IDEMPOTENCY_TTL_S
    ):
        return False
    # A transaction on a single Redis (readers never see half a batch); a cluster cannot make
    # one across slots, and a reader there may see a batch's links before its instances.
    pipe = r.pipeline(transaction=not live_store_is_cluster())
    _queue_batch(pipe, instances, links)
    try:
        await pipe.execute()
    except Exception:
        if idempotency_key is not None:
            await r.delete(_idem_key(idempotency_key))
        raise
    return True


# --- reads (pipeline pieces for the request path) --------------------------------------------


def instance_states_queue(pipe: Any, instances: Sequence[str]) -> None:
    """One command (none for no instances): the latest sample of each of ``instances``."""
    if instances:
        pipe.hmget(INSTANCES_KEY, list(instances))


def instance_states_parse(
    instances: Sequence[str], raw: Sequence[Any]
) -> dict[str, InstanceSample]:
    """Samples by instance; instances that never reported are left out."""
    out: dict[str, InstanceSample] = {}
    for inst, packed in zip(instances, raw or (), strict=False):
        if not packed:
            continue
        ts, q, r, w, kv, qpt = packed.split(b",")
        out[inst] = InstanceSample(
            instance=inst,
            ts=float(ts),
            queue_depth=int(q),
            running=int(r),
            waiting=int(w),
            kv_usage=float(kv),
            queued_prefill_tokens=int(qpt),
        )
    return out


# Drops reservations past their transfer end, then returns the bytes still reserved: the
# request path reads exact in-flight bytes even when no reservation swept for a while.
_INFLIGHT_LUA = """
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, SWEEP_LIMIT)
if #expired > 0 then
  local vals = redis.call('HMGET', KEYS[2], unpack(expired))
  local freed = 0
  for _, v in ipairs(vals) do if v then freed = freed + tonumber(v) end end
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('HDEL', KEYS[2], unpack(expired))
  local left = redis.call('DECRBY', KEYS[3], freed)
  if left < 0 then redis.call('SET', KEYS[3], 0) end
end
return tonumber(redis.call('GET', KEYS[3]) or '0')
""".replace("SWEEP_LIMIT", str(RESERVATION_SWEEP_LIMIT))
INFLIGHT_SCRIPT = lua_script(_INFLIGHT_LUA, "link in-flight")


def link_states_queue(pipe: Any, links: Sequence[str], now: float | None = None) -> None:
    """``1 + len(links)`` commands (none for no links): latest samples, in-flight bytes (a
    script: run the pipeline with :func:`controlplane.redis_scripts.pipeline_run`)."""
    if not links:
        return
    pipe.hmget(LINKS_KEY, list(links))
    t = repr(time.time() if now is None else now)
    for link in links:
        INFLIGHT_SCRIPT.queue(pipe, reservation_keys(link), [t])


def link_states_parse(links: Sequence[str], raw: Sequence[Any]) -> dict[str, LinkState]:
    """Link states by link; a link with neither a sample nor reservations is left out."""
    out: dict[str, LinkState] = {}
    if not links:
        return out
    samples = raw[0] or [None] * len(links)
    for i, link in enumerate(links):
        packed, reserved = samples[i], int(raw[1 + i] or 0)
        if not packed and not reserved:
            continue
        ts, gbps, retx = 0.0, 0.0, 0
        if packed:
            f = packed.split(b",")
            ts, gbps, retx = float(f[0]), float(f[1]), int(f[4])
        out[link] = LinkState(
            link=link, ts=ts, gbps=gbps, retransmits=retx, reserved_bytes=max(0, reserved)
        )
    return out


def telemetry_prune(keep_instances: Sequence[str], keep_links: Sequence[str]) -> int:
    """Drop samples of instances and links no longer in the inventory; returns fields dropped."""
    r = redis_sync()
    dropped = 0
    for key, keep in ((INSTANCES_KEY, set(keep_instances)), (LINKS_KEY, set(keep_links))):
        gone = [f for f in r.hkeys(key) if f.decode() not in keep]  # type: ignore[union-attr]
        if gone:
            dropped += int(r.hdel(key, *gone))
    return dropped


def instance_states_read(instances: Sequence[str]) -> dict[str, InstanceSample]:
    if not instances:
        return {}
    pipe = redis_sync().pipeline(transaction=False)
    instance_states_queue(pipe, instances)
    return instance_states_parse(instances, pipe.execute()[0])


def link_states_read(links: Sequence[str]) -> dict[str, LinkState]:
    raw = pipeline_run(redis_sync(), lambda pipe: link_states_queue(pipe, links))
    return link_states_parse(links, raw)


def link_bandwidth_series(
    link: str, start: float, end: float, client: redis.Redis | None = None
) -> list[tuple[int, float]]:
    """``(second, Gbps)`` for every 1 s bucket in ``[start, end]`` that saw traffic."""
    r = client or redis_sync()
    first, last = math.ceil(start), math.floor(end)
    if last < first:
        return []
    # Samples ending in the window or after it (a later sample may reach back into it).
    members = r.zrangebyscore(_bw_key(link), first, "+inf")
    # Difference arrays over the window: O(window + samples), whatever the intervals.
    width = last - first + 1
    rate = [0.0] * (width + 1)
    covered = [0] * (width + 1)
    for raw in members:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        end_s, seconds, per_second, _ = text.split("|")
        hi = min(int(end_s), last) - first
        lo = max(int(end_s) - int(seconds) + 1, first) - first
        if hi < lo:
            continue
        rate[lo] += float(per_second)
        rate[hi + 1] -= float(per_second)
        covered[lo] += 1
        covered[hi + 1] -= 1
    series: list[tuple[int, float]] = []
    level, count = 0.0, 0
    for i in range(width):
        level += rate[i]
        count += covered[i]
        if count > 0:
            series.append((first + i, max(0.0, level) * 8 / 1e9))
    return series


# --- reservations ---------------------------------------------------------------------------

# ARGV: now, key ttl, then ONE JSON array of the reservations, each [link, id, bytes, end,
# budget] (one argument, not five per reservation: packing a batch's arguments cost the caller
# more than the script), then 1 on a Redis Cluster (0: a single Redis). Returns
# ``[admitted 0|1, reserved bytes after]`` per reservation, in order. Reservations are taken in
# order, each seeing the ones before it on its link. KEYS[1]: the reservation key of the first
# link: every link of a call is in its slot (a cluster: one call per slot,
# :func:`link_reserve_many_queue`; a single Redis: one call).
#
# A failover: a replica promoted in place of a lost master has what was replicated to it, not
# the reservations the master took after that. On a cluster each link remembers which node
# took its reservations (``:own``, with the longest hold admitted and the latest end); a call
# that finds itself on another node (the slot moved: a failover, or a resharding) holds the
# link full until every reservation the old node may have taken would have ended (the latest
# end it knew, and at least the longest hold seen from now), then admits again. Nothing is
# ever admitted over the budget on the strength of a reservation the failover lost.
_RESERVE_LUA = """
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local call = redis.call
local me = nil
if ARGV[4] == '1' then me = call('CLUSTER', 'MYID') end
local own_of, fenced, hold_of, horizon_of = {}, {}, {}, {}
local out = {}
-- Per link, once per call: expired reservations swept and the sum read (now is one instant
-- for the whole call, so a second sweep would find nothing new); the sums written back and
-- the keys' lifetimes renewed once at the end.
local used_of, links = {}, {}
for _, it in ipairs(cjson.decode(ARGV[3])) do
  local z = 'live:resv:{' .. it[1] .. '}'
  local hb = z .. ':b'
  local id = it[2]
  local want = it[3]
  local used = used_of[z]
  if used == nil then
    local sum = z .. ':sum'
    local expired = call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, SWEEP_LIMIT)
    if #expired > 0 then
      local vals = call('HMGET', hb, unpack(expired))
      local freed = 0
      for _, v in ipairs(vals) do if v then freed = freed + tonumber(v) end end
      call('ZREM', z, unpack(expired))
      call('HDEL', hb, unpack(expired))
      call('DECRBY', sum, freed)
    end
    used = tonumber(call('GET', sum) or '0')
    if used < 0 then used = 0 end
    links[#links + 1] = z
    if me then
      local st = call('HMGET', z .. ':own', 'id', 'fence', 'hold', 'horizon')
      local fence = tonumber(st[2]) or 0
      hold_of[z] = tonumber(st[3]) or 0
      horizon_of[z] = tonumber(st[4]) or 0
      if st[1] and st[1] ~= me then
        fence = math.max(fence, horizon_of[z], now + hold_of[z])
        call('HSET', z .. ':own', 'fence', fence)
      end
      own_of[z] = st[1]
      fenced[z] = now < fence
    end
  end
  local admitted = 0
  -- Within the budget, or bigger than it alone on an idle link (scheduling.core.link.link_admits).
  local fits = used + want <= it[5] or (used <= 0 and it[5] > 0)
  if not fenced[z] and fits and call('HEXISTS', hb, id) == 0 then
    admitted = 1
    call('ZADD', z, it[4], id)
    call('HSET', hb, id, want)
    used = used + want
    if me then
      hold_of[z] = math.max(hold_of[z], it[4] - now)
      horizon_of[z] = math.max(horizon_of[z], it[4])
    end
  end
  used_of[z] = used
  out[#out + 1] = admitted
  out[#out + 1] = used
end
for _, z in ipairs(links) do
  call('SET', z .. ':sum', used_of[z])
  call('EXPIRE', z, ttl)
  call('EXPIRE', z .. ':b', ttl)
  call('EXPIRE', z .. ':sum', ttl)
  if me then
    call('HSET', z .. ':own', 'id', me, 'hold', hold_of[z], 'horizon', horizon_of[z])
    call('EXPIRE', z .. ':own', ttl)
  end
end
return out
""".replace("SWEEP_LIMIT", str(RESERVATION_SWEEP_LIMIT))
RESERVE_SCRIPT = lua_script(_RESERVE_LUA, "link reserve")


@dataclass(frozen=True)
class Reservation:
    """In-flight KV bytes to hold on a link until ``end_ts`` (the predicted transfer end)."""

    link: str
    reservation_id: str
    nbytes: int
    end_ts: float
    budget_bytes: int


def _reserve_args(items: Sequence[Reservation], now: float) -> list[Any]:
    rows = [
        (
            item.link,
            item.reservation_id,
            int(item.nbytes),
            float(item.end_ts),
            int(item.budget_bytes),
        )
        for item in items
    ]
    return [
        repr(now),
        RESERVATION_KEY_TTL_S,
        orjson.dumps(rows),
        "1" if live_store_is_cluster() else "0",
    ]


def _reserve_groups(items: Sequence[Reservation]) -> list[list[int]]:
    """Indexes of ``items`` per script call: by the slot of their link's keys (one call on a
    single Redis); a link's reservations stay in call order."""
    return slot_groups(
        range(len(items)), lambda i: reservation_key(items[i].link), live_store_is_cluster()
    )


def link_reserve_many_queue(
    pipe: Any, items: Sequence[Reservation], now: float | None = None
) -> None:
    """Queue the atomic commands taking every reservation, in order per link: one, or on a
    cluster one per hash slot of the links (:func:`link_reserve_many_parse` reads them)."""
    t = time.time() if now is None else now
    for group in _reserve_groups(items):
        first = reservation_key(items[group[0]].link)
        RESERVE_SCRIPT.queue(pipe, [first], _reserve_args([items[i] for i in group], t))


def link_reserve_many_parse(items: Sequence[Reservation], raws: Sequence[Any]) -> list[int]:
    """``[admitted 0|1, reserved bytes after] * len(items)`` flattened, in the items' order,
    from the replies of :func:`link_reserve_many_queue`'s commands."""
    flat = [0] * (2 * len(items))
    for group, raw in zip(_reserve_groups(items), raws, strict=True):
        for k, i in enumerate(group):
            flat[2 * i], flat[2 * i + 1] = int(raw[2 * k]), int(raw[2 * k + 1])
    return flat


def _reserve_one_args(
    link: str, reservation_id: str, nbytes: int, end_ts: float, budget_bytes: int, now: float | None
) -> list[Any]:
    item = Reservation(link, reservation_id, nbytes, end_ts, budget_bytes)
    return _reserve_args([item], time.time() if now is None else now)


def link_reserve(
    link: str,
    reservation_id: str,
    nbytes: int,
    end_ts: float,
    budget_bytes: int,
    now: float | None = None,
    client: redis.Redis | None = None,
) -> bool:
    """Reserve ``nbytes`` on ``link`` until ``end_ts`` if the budget allows; True if admitted."""
    r = client or redis_sync()
    args = _reserve_one_args(link, reservation_id, nbytes, end_ts, budget_bytes, now)
    admitted, _ = RESERVE_SCRIPT.run(r, [reservation_key(link)], args)
    return bool(admitted)


async def link_reserve_async(
    link: str,
    reservation_id: str,
    nbytes: int,
    end_ts: float,
    budget_bytes: int,
    now: float | None = None,
    client: aioredis.Redis | None = None,
) -> bool:
    """Async twin of :func:`link_reserve`."""
    r = client or redis_async()
    args = _reserve_one_args(link, reservation_id, nbytes, end_ts, budget_bytes, now)
    admitted, _ = await RESERVE_SCRIPT.run_async(r, [reservation_key(link)], args)
    return bool(admitted)


_RELEASE_LUA = """
local b = redis.call('HGET', KEYS[2], ARGV[1])
if not b then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
local left = redis.call('DECRBY', KEYS[3], tonumber(b))
if left < 0 then redis.call('SET', KEYS[3], 0) end
return tonumber(b)
"""
RELEASE_SCRIPT = lua_script(_RELEASE_LUA, "link release")


def link_release_queue(pipe: Any, link: str, reservation_id: str) -> None:
    """Queue one release on ``pipe``; its reply is the bytes freed (0 if unknown)."""
    RELEASE_SCRIPT.queue(pipe, reservation_keys(link), [reservation_id])


def link_release(link: str, reservation_id: str, client: redis.Redis | None = None) -> int:
    """End a reservation early (transfer done); returns the bytes freed (0 if unknown)."""
    return int(RELEASE_SCRIPT.run(client or redis_sync(), reservation_keys(link), [reservation_id]))


async def link_release_async(
    link: str, reservation_id: str, client: aioredis.Redis | None = None
) -> int:
    keys = reservation_keys(link)
    return int(await RELEASE_SCRIPT.run_async(client or redis_async(), keys, [reservation_id]))


def link_reserved_bytes(link: str, client: redis.Redis | None = None) -> int:
    """Bytes reserved on ``link`` now (reservations past their end are not counted)."""
    r = client or redis_sync()
    keys = reservation_keys(link)
    live = r.zrangebyscore(keys[0], time.time(), "+inf")
    if not live:
        return 0
    values = r.hmget(keys[1], list(live))  # type: ignore[arg-type]
    return sum(int(v) for v in values if v is not None)


# --- short-term control state -----------------------------------------------------------------

CONTROL_KEY = "live:control"


def control_states_queue(pipe: Any) -> None:
    """One command: the stored control state of every PD cluster (``live:control`` HASH,
    cluster -> JSON object of the router's ControlState fields)."""
    pipe.hgetall(CONTROL_KEY)


def control_states_parse(raw: Mapping[Any, Any] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for k, v in (raw or {}).items():
        try:
            value = json.loads(v)
        except ValueError:
            continue
        if isinstance(value, dict):
            out[k.decode() if isinstance(k, bytes) else str(k)] = value
    return out


async def control_states_write_async(
    states: Mapping[str, Mapping[str, Any]], client: aioredis.Redis | None = None
) -> None:
    if not states:
        return
    r = client or redis_async()
    await r.hset(CONTROL_KEY, mapping={k: json.dumps(dict(v)) for k, v in states.items()})


def control_states_write(
    states: Mapping[str, Mapping[str, Any]], client: redis.Redis | None = None
) -> None:
    if not states:
        return
    r = client or redis_sync()
    r.hset(CONTROL_KEY, mapping={k: json.dumps(dict(v)) for k, v in states.items()})
