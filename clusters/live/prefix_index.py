"""The global prefix index: which instance holds which prefix blocks, kept from KV events.

Two kinds of entries (``../shared/paper/PRFAAS.md`` section 3.2):

- **full-attention blocks** are block-level and match partially: an instance can reuse the
  longest run of a request's block chain it holds from the start;
- **linear-state checkpoints** (linear attention, sliding window) are request-level and match
  only at an exact length: a checkpoint at block ``h`` means the state after the prefix ending
  with ``h`` is stored.

Key layout (block hashes are folded to 64-bit keys, written as 16 hex digits):

``pfx:b:{hash}``        SET   instances holding full-attention block ``hash``
``pfx:l:{hash}``        SET   instances holding a linear-state checkpoint ending at ``hash``
``pfx:i:{inst}:b``      ZSET  block hash -> store order, per instance (eviction order)
``pfx:i:{inst}:l``      ZSET  checkpoint hash -> store order, per instance
``pfx:i:{inst}:n``      STRING per-instance store counter (the scores above)
``pfx:i:{inst}:m``      HASH  last_seq, state (exact|degraded), gaps, missed, gap_at, events
``pfx:degraded``        SET   instances whose event stream showed a sequence gap
``pfx:instances``       SET   instances with entries
``pfx:linear``          SET   instances that ever reported linear-state checkpoints (an
                              engine that reports none is matched on full blocks only)

Layout for the lookup: per-block sets of holders, so a chain ``h0..hn`` is matched by
intersecting ``pfx:b:h0``, ``pfx:b:h1``, ... until the run of holders is empty. That walk runs
server-side in one Lua script for all chains of an API call (:func:`prefix_matches_queue`,
queued in the caller's one read pipeline): only the answer, a few (instance, blocks) pairs per
chain, crosses the network, and a walk stops at the first block no candidate holds.

Memory is bounded: each instance keeps at most ``cap`` blocks and ``cap`` checkpoints; storing
past the cap evicts that instance's oldest entries (vLLM evicts LRU blocks too, and will send
``BlockRemoved`` for them). Empty sets disappear by themselves in Redis.

Sequence numbers: batches carry the publisher's ``seq`` (+1 per batch, from 0). A batch with
``seq`` at or below the last one is a redelivery and is skipped; a jump marks the instance
``degraded`` (entries kept but trusted less, the gap shown by the API) until
``AllBlocksCleared`` or an engine restart (``seq`` back to 0) empties its entries, after which
the index for it is exact again. Each batch is applied by one Lua script, atomically.
The scripts touch keys they compute, so this store needs a single Redis (not Redis Cluster).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from clusters.live.scripts import lua_script
from controlplane.redis_connection import redis_async, redis_sync

DEFAULT_CAP_PER_INSTANCE = 200_000
_U64 = 1 << 64


class BlockHashError(ValueError):
    """A block hash that is neither a 64-bit integer nor a hex digest."""


def block_hash_key(value: int | str | bytes) -> str:
    """Fold a vLLM block hash to its 64-bit key (16 hex digits).

    vLLM sends either an int (built-in hash, possibly negative, or the digest's low 64 bits)
    or the full 32-byte SHA-256 digest; consumers use the digest's last 8 bytes big-endian,
    so both encodings of one block give the same key. Over JSON, digests travel as hex.
    """
    if isinstance(value, bool):
        raise BlockHashError("a block hash is an integer or a hex string, not a boolean")
    if isinstance(value, int):
        if not -(1 << 63) <= value < _U64:
            raise BlockHashError(f"block hash {value} does not fit in 64 bits")
        return f"{value % _U64:016x}"
    if isinstance(value, bytes):
        if len(value) not in (8, 32):
            raise BlockHashError(f"a binary block hash has 8 or 32 bytes, not {len(value)}")
        return value[-8:].hex()
    if isinstance(value, str):
        text = value.lower().removeprefix("0x")
        if len(text) not in (16, 64) or any(c not in "0123456789abcdef" for c in text):
            raise BlockHashError(
                "a block hash string is 16 or 64 hex digits (64-bit key or SHA-256 digest)"
            )
        return text[-16:]
    raise BlockHashError(f"unsupported block hash type {type(value).__name__}")


@dataclass(frozen=True)
class StoredBlocks:
    """BlockStored: a run of full blocks; ``linear`` when they are linear-state checkpoints."""

    block_hashes: Sequence[str]
    linear: bool = False


@dataclass(frozen=True)
class RemovedBlocks:
    block_hashes: Sequence[str]


@dataclass(frozen=True)
class AllCleared:
    pass


KvEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass(frozen=True)
class BatchResult:
    """What applying one batch did: ``applied``, ``duplicate`` or ``restart``; gap info."""

    status: str
    gap: int
    evicted: int
    state: str


@dataclass(frozen=True)
class InstanceIndexState:
    """An instance's index health, for the API and the UI."""

    instance: str
    state: str
    last_seq: int | None
    gaps: int
    missed_batches: int
    last_gap_at: float | None
    blocks: int
    checkpoints: int


@dataclass(frozen=True)
class IndexMatch:
    """Longest matched prefix (tokens) per instance for one request's block chain."""

    tokens_by_instance: Mapping[str, int]
    degraded: frozenset[str] = field(default_factory=frozenset)

    def by_cluster(self, cluster_of: Mapping[str, str]) -> dict[str, int]:
        """Best match per cluster (an instance's cache is usable only on that instance)."""
        out: dict[str, int] = {}
        for inst, tokens in self.tokens_by_instance.items():
            cluster = cluster_of.get(inst)
            if cluster is not None and tokens > out.get(cluster, 0):
                out[cluster] = tokens
        return out


# ARGV: inst, cap, now, seq (-1 when absent), then ops:
#   'S', kind ('b'|'l'), n, hash * n  |  'R', n, hash * n  |  'C'
# Returns {status, gap, evicted, state}.
_APPLY_LUA = """
local inst = ARGV[1]
local cap = tonumber(ARGV[2])
local now = ARGV[3]
local seq = tonumber(ARGV[4])
local pre = 'pfx:i:' .. inst .. ':'
local meta = pre .. 'm'

local function clear()
  for _, kind in ipairs({'b', 'l'}) do
    local z = pre .. kind
    local members = redis.call('ZRANGE', z, 0, -1)
    for _, h in ipairs(members) do redis.call('SREM', 'pfx:' .. kind .. ':' .. h, inst) end
    redis.call('DEL', z)
  end
  redis.call('SREM', 'pfx:degraded', inst)
  redis.call('HSET', meta, 'state', 'exact')
end

local status = 'applied'
local gap = 0
if seq >= 0 then
  local last = redis.call('HGET', meta, 'last_seq')
  if last then
    last = tonumber(last)
    if seq == 0 and last > 0 then
      status = 'restart'
      clear()
    elseif seq <= last then
      return {'duplicate', 0, 0, redis.call('HGET', meta, 'state') or 'exact'}
    elseif seq > last + 1 then
      gap = seq - last - 1
      redis.call('HSET', meta, 'state', 'degraded', 'gap_at', now)
      redis.call('HINCRBY', meta, 'gaps', 1)
      redis.call('HINCRBY', meta, 'missed', gap)
      redis.call('SADD', 'pfx:degraded', inst)
    end
  end
  redis.call('HSET', meta, 'last_seq', seq)
end
if not redis.call('HGET', meta, 'state') then redis.call('HSET', meta, 'state', 'exact') end

local evicted = 0
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local kind = ARGV[i + 1]
    local n = tonumber(ARGV[i + 2])
    local z = pre .. kind
    if kind == 'l' then redis.call('SADD', 'pfx:linear', inst) end
    local order = redis.call('INCRBY', pre .. 'n', n) - n
    for j = 1, n do
      local h = ARGV[i + 2 + j]
      redis.call('SADD', 'pfx:' .. kind .. ':' .. h, inst)
      redis.call('ZADD', z, order + j, h)
    end
    local size = redis.call('ZCARD', z)
    if size > cap then
      local old = redis.call('ZPOPMIN', z, size - cap)
      for k = 1, #old, 2 do
        redis.call('SREM', 'pfx:' .. kind .. ':' .. old[k], inst)
        evicted = evicted + 1
      end
    end
    i = i + 3 + n
  elseif op == 'R' then
    local n = tonumber(ARGV[i + 1])
    for j = 1, n do
      local h = ARGV[i + 1 + j]
      for _, kind in ipairs({'b', 'l'}) do
        redis.call('SREM', 'pfx:' .. kind .. ':' .. h, inst)
        redis.call('ZREM', pre .. kind, h)
      end
    end
    i = i + 2 + n
  elseif op == 'C' then
    clear()
    i = i + 1
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
redis.call('HINCRBY', meta, 'events', 1)
redis.call('SADD', 'pfx:instances', inst)
return {status, gap, evicted, redis.call('HGET', meta, 'state')}
"""


def _apply_args(
    instance: str, seq: int | None, events: Sequence[KvEvent], cap: int, now: float
) -> list[Any]:
    args: list[Any] = [instance, cap, repr(now), -1 if seq is None else seq]
    for ev in events:
        if isinstance(ev, StoredBlocks):
            if ev.block_hashes:
                args += ["S", "l" if ev.linear else "b", len(ev.block_hashes), *ev.block_hashes]
        elif isinstance(ev, RemovedBlocks):
            if ev.block_hashes:
                args += ["R", len(ev.block_hashes), *ev.block_hashes]
        else:
            args.append("C")
    return args


def _result(raw: Sequence[Any]) -> BatchResult:
    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    return BatchResult(status=s(raw[0]), gap=int(raw[1]), evicted=int(raw[2]), state=s(raw[3]))


def kv_batch_apply(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: redis.Redis | None = None,
) -> BatchResult:
    """Apply one KV-event batch of ``instance`` atomically (hashes already folded)."""
    r = client or redis_sync()
    raw = r.eval(_APPLY_LUA, 0, *_apply_args(instance, seq, events, cap, time.time()))
    return _result(raw)


async def kv_batch_apply_async(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
) -> BatchResult:
    """Async twin of :func:`kv_batch_apply`."""
    r = client or redis_async()
    raw = await r.eval(_APPLY_LUA, 0, *_apply_args(instance, seq, events, cap, time.time()))
    return _result(raw)


async def kv_batches_apply_async(
    instance: str,
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
) -> list[BatchResult]:
    """Apply several batches of one instance in order, in one round trip."""
    pipe = (client or redis_async()).pipeline(transaction=False)
    now = time.time()
    for seq, events in batches:
        pipe.eval(_APPLY_LUA, 0, *_apply_args(instance, seq, events, cap, now))
    return [_result(raw) for raw in await pipe.execute()]


def prefix_index_instance_reset(instance: str, client: redis.Redis | None = None) -> None:
    """Forget everything about an instance (removed from inventory, or operator reset)."""
    r = client or redis_sync()
    r.eval(_APPLY_LUA, 0, *_apply_args(instance, None, [AllCleared()], 1, time.time()))
    r.delete(f"pfx:i:{instance}:m", f"pfx:i:{instance}:n")
    r.srem("pfx:instances", instance)


# --- lookup -------------------------------------------------------------------------------


# Server-side walk of many chains at once: for each chain, intersect the holders block by block
# from the start and stop at the first block nobody still in the run holds. Returns, per chain,
# ``[k, inst1, blocks1, ..., instk, blocksk]`` (usable blocks: for hybrid models, the last
# linear checkpoint inside the run, for instances that report checkpoints at all), then the
# degraded instances. Only the answer crosses the network, not every block's holders.
# ARGV: hybrid (0|1), then one string per chain: its 16-hex-digit block keys, concatenated.
_MATCH_LUA = """
local hybrid = ARGV[1] == '1'
local linear = {}
if hybrid then
  for _, inst in ipairs(redis.call('SMEMBERS', 'pfx:linear')) do linear[inst] = true end
end
local out = {}
for c = 2, #ARGV do
  local packed = ARGV[c]
  local len = #packed / 16
  local alive = nil
  local full = {}
  local usable = {}
  for i = 1, len do
    local h = string.sub(packed, 16 * (i - 1) + 1, 16 * i)
    local members = redis.call('SMEMBERS', 'pfx:b:' .. h)
    local next_alive = {}
    local any = false
    if alive == nil then
      for _, inst in ipairs(members) do next_alive[inst] = true; any = true end
    else
      for _, inst in ipairs(members) do
        if alive[inst] then next_alive[inst] = true; any = true end
      end
    end
    if not any then break end
    alive = next_alive
    for inst, _ in pairs(alive) do
      full[inst] = i
      if hybrid and linear[inst] and redis.call('SISMEMBER', 'pfx:l:' .. h, inst) == 1 then
        usable[inst] = i
      end
    end
  end
  local entries = {}
  for inst, blocks in pairs(full) do
    local b = blocks
    if hybrid and linear[inst] then b = usable[inst] or 0 end
    if b > 0 then
      entries[#entries + 1] = inst
      entries[#entries + 1] = b
    end
  end
  out[#out + 1] = #entries / 2
  for _, v in ipairs(entries) do out[#out + 1] = v end
end
local degraded = redis.call('SMEMBERS', 'pfx:degraded')
out[#out + 1] = #degraded
for _, inst in ipairs(degraded) do out[#out + 1] = inst end
return out
"""
MATCH_SCRIPT = lua_script(_MATCH_LUA)


def prefix_matches_queue(
    pipe: Any, chains: Sequence[Sequence[str]], hybrid: bool, by_sha: bool = False
) -> None:
    """Queue ONE command matching every chain server-side (see :func:`prefix_matches_parse`).

    Chains hold folded keys (16 hex digits, :func:`block_hash_key`); each travels as one
    string. ``by_sha``: the caller loaded the script (:mod:`clusters.live.scripts`).
    """
    args: list[Any] = ["1" if hybrid else "0", *("".join(chain) for chain in chains)]
    if by_sha:
        MATCH_SCRIPT.queue(pipe, [], args)
    else:
        pipe.eval(_MATCH_LUA, 0, *args)


def prefix_matches_parse(raw: Sequence[Any], n_chains: int, block_size: int) -> list[IndexMatch]:
    """One :class:`IndexMatch` per chain, in order, from the result of the queued command."""
    out: list[IndexMatch] = []
    at = 0
    per_chain: list[dict[str, int]] = []
    for _ in range(n_chains):
        k = int(raw[at])
        at += 1
        tokens: dict[str, int] = {}
        for j in range(k):
            inst = raw[at + 2 * j]
            tokens[inst.decode() if isinstance(inst, bytes) else str(inst)] = (
                int(raw[at + 2 * j + 1]) * block_size
            )
        at += 2 * k
        per_chain.append(tokens)
    n_degraded = int(raw[at])
    degraded = frozenset(
        d.decode() if isinstance(d, bytes) else str(d) for d in raw[at + 1 : at + 1 + n_degraded]
    )
    for tokens in per_chain:
        out.append(IndexMatch(tokens_by_instance=tokens, degraded=degraded))
    return out


def prefix_match(
    chain: Sequence[str], block_size: int, hybrid: bool = False, client: redis.Redis | None = None
) -> IndexMatch:
    """One round trip: the longest matched prefix per instance."""
    pipe = (client or redis_sync()).pipeline(transaction=False)
    prefix_matches_queue(pipe, [chain], hybrid)
    return prefix_matches_parse(pipe.execute()[0], 1, block_size)[0]


async def prefix_match_async(
    chain: Sequence[str],
    block_size: int,
    hybrid: bool = False,
    client: aioredis.Redis | None = None,
) -> IndexMatch:
    pipe = (client or redis_async()).pipeline(transaction=False)
    prefix_matches_queue(pipe, [chain], hybrid)
    return prefix_matches_parse((await pipe.execute())[0], 1, block_size)[0]


# --- health and size --------------------------------------------------------------------------


def prefix_index_states(
    instances: Sequence[str] | None = None, client: redis.Redis | None = None
) -> list[InstanceIndexState]:
    """Index health per instance (all instances with entries when ``instances`` is None)."""
    r = client or redis_sync()
    if instances is None:
        instances = sorted(m.decode() for m in r.smembers("pfx:instances"))  # type: ignore[union-attr]
    pipe = r.pipeline(transaction=False)
    for inst in instances:
        pipe.hgetall(f"pfx:i:{inst}:m")
        pipe.zcard(f"pfx:i:{inst}:b")
        pipe.zcard(f"pfx:i:{inst}:l")
    raw = pipe.execute()
    out = []
    for k, inst in enumerate(instances):
        meta = {a.decode(): b.decode() for a, b in raw[3 * k].items()}
        out.append(
            InstanceIndexState(
                instance=inst,
                state=meta.get("state", "exact"),
                last_seq=int(meta["last_seq"]) if "last_seq" in meta else None,
                gaps=int(meta.get("gaps", 0)),
                missed_batches=int(meta.get("missed", 0)),
                last_gap_at=float(meta["gap_at"]) if "gap_at" in meta else None,
                blocks=int(raw[3 * k + 1]),
                checkpoints=int(raw[3 * k + 2]),
            )
        )
    return out


def prefix_index_size(client: redis.Redis | None = None) -> dict[str, int]:
    """Entries (blocks + checkpoints) per instance, for ``/metrics``."""
    return {s.instance: s.blocks + s.checkpoints for s in prefix_index_states(client=client)}
