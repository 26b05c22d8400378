"""The global prefix index: which instance holds which prefix blocks, kept from KV events.

Two kinds of entries (``../shared/paper/PRFAAS.md`` section 3.2):

- **full-attention blocks** are block-level and match partially: an instance can reuse the
  longest run of a request's block chain it holds from the start;
- **linear-state checkpoints** (linear attention, sliding window) are request-level and match
  only at an exact length: a checkpoint at block ``h`` means the state after the prefix ending
  with ``h`` is stored.

An entry is (block, instance), with per-entry flags: which kind (full / linear) in which
medium (GPU, CPU, storage, other), so evicting a linear checkpoint (``BlockRemoved`` of the
linear KV group) leaves the full-attention block, and a GPU eviction leaves a CPU-tier copy.
KV groups map to kinds per instance, learned from ``BlockStored``'s ``group_idx`` and
``kv_cache_spec_kind``; a removal that names no group (engines before hybrid groups) removes
both kinds. LoRA adapters and salted requests stay apart because vLLM hashes them into the
block hash (``fleet.blockhash``).

Key layout, compact because a fleet holds tens of millions of entries (target <= 150 bytes per
entry, ``bench/kv_ingest.py``); block hashes are folded to 64-bit keys (16 hex digits at the
API, 8 raw bytes here):

``pfx:h:{b}``           HASH  bucket ``b`` (the key's last 2 bytes, 65,536 buckets): field =
                              the key's first 6 bytes, value = 5-byte records
                              ``instance id (3) | flags (1) | epoch (1)`` of its holders.
                              Small buckets are listpack-encoded by Redis (~15 bytes/entry).
``pfx:i:{inst}:m``      HASH  id, last_seq, state (exact|degraded), gaps, missed, gap_at,
                              events, blocks, ckpts, stores, g{group_idx} (kind of a group)
``pfx:i:{inst}:e:{n}``  STRING the 8-byte keys stored in epoch ``n`` (mod 256), concatenated
``pfx:ids``/``pfx:names`` HASH instance name <-> 3-byte id
``pfx:degraded``        SET   instances whose event stream showed a sequence gap
``pfx:instances``       SET   instances with entries
``pfx:linear``          SET   instances that ever reported linear-state checkpoints (an
                              engine that reports none is matched on full blocks only)

Memory is bounded per instance by ``cap``: stores are counted in epochs of ``cap / K`` (K = 16,
or ``cap`` when smaller); when a new epoch starts, the entries still held from the epoch K back
are evicted (an entry stored again later carries the newer epoch and stays). vLLM sends
``BlockRemoved`` for what it evicts, so the cap only bounds what missed removals (gaps) leave
behind; it evicts oldest-stored first, to within one epoch.

Lookup: a chain ``h0..hn`` is matched by intersecting holders block by block until the run is
empty. That walk runs server-side in one Lua script for all chains of an API call
(:func:`prefix_matches_queue`, queued in the caller's one read pipeline): only the answer, a few
(instance, blocks) pairs per chain, crosses the network.

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

from clusters.live.connection import redis_async, redis_sync
from clusters.live.scripts import lua_script

DEFAULT_CAP_PER_INSTANCE = 200_000
EPOCHS = 16
_U64 = 1 << 64

# Media (vLLM's ``medium``): GPU is the default tier (and what engines without the field mean).
MEDIA = {"gpu": 0, "cpu": 1, "storage": 2, "disk": 2}
OTHER_MEDIUM = 3


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


def medium_code(medium: str | None) -> int:
    """The index's tier code of a vLLM ``medium`` (None: GPU)."""
    if medium is None:
        return 0
    return MEDIA.get(medium.lower(), OTHER_MEDIUM)


@dataclass(frozen=True)
class StoredBlocks:
    """BlockStored: a run of full blocks; ``linear`` when they are linear-state checkpoints.
    ``group``: the engine's KV-cache group (``group_idx``), None when it does not say."""

    block_hashes: Sequence[str]
    linear: bool = False
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True)
class RemovedBlocks:
    """BlockRemoved from ``group`` (None: every group, as engines without groups mean) and
    ``medium`` (None: GPU)."""

    block_hashes: Sequence[str]
    medium: str | None = None
    group: int | None = None


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
class PrefixMatch:
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


# Shared Lua: the 5-byte holder records of one bucket field.
_RECORDS_LUA = """
local function rec_find(val, idb)
  if not val then return nil end
  for p = 1, #val, 5 do
    if string.sub(val, p, p + 2) == idb then return p end
  end
  return nil
end
local function bucket_of(h)
  return 'pfx:h:' .. (string.byte(h, 7) * 256 + string.byte(h, 8)), string.sub(h, 1, 6)
end
"""

# ARGV: inst, cap, now, seq (-1 when absent), epochs, then ops:
#   'S', kind (0 full | 1 linear), medium (0..3), group (-1: none), packed 8-byte keys
#   'R', medium, group (-1: every group), packed keys  |  'C'
# Returns {status, gap, evicted, state}.
_APPLY_LUA = (
    _RECORDS_LUA
    + """
local inst = ARGV[1]
local cap = tonumber(ARGV[2])
local now = ARGV[3]
local seq = tonumber(ARGV[4])
local k_epochs = tonumber(ARGV[5])
local epoch_len = math.ceil(cap / k_epochs)
local pre = 'pfx:i:' .. inst .. ':'
local meta = pre .. 'm'

local idb = redis.call('HGET', meta, 'id')
if not idb then
  idb = redis.call('HGET', 'pfx:ids', inst)
  if not idb then
    local n = redis.call('INCR', 'pfx:nextid')
    idb = string.char(math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
    redis.call('HSET', 'pfx:ids', inst, idb)
    redis.call('HSET', 'pfx:names', idb, inst)
  end
  redis.call('HSET', meta, 'id', idb)
end

local counts = {0, 0}
do
  local c = redis.call('HMGET', meta, 'blocks', 'ckpts', 'stores')
  counts[1] = tonumber(c[1]) or 0
  counts[2] = tonumber(c[2]) or 0
end
local stores = tonumber(redis.call('HGET', meta, 'stores')) or 0
local evicted = 0

-- flags of one record -> {full?, linear?}
local function kinds_of(flags)
  return bit.band(flags, 15) ~= 0, bit.band(flags, 240) ~= 0
end

-- Remove bits `mask` of this instance's record for key h (all bits when mask is 255);
-- `only_epoch`: only if the record was last stored in that epoch. Returns true if changed.
local function rec_clear(h, mask, only_epoch)
  local bkey, f = bucket_of(h)
  local val = redis.call('HGET', bkey, f)
  local p = rec_find(val, idb)
  if not p then return false end
  local flags = string.byte(val, p + 3)
  if only_epoch and string.byte(val, p + 4) ~= only_epoch then return false end
  local left = bit.band(flags, bit.bnot(mask))
  if left == flags then return false end
  local had_full, had_lin = kinds_of(flags)
  local has_full, has_lin = kinds_of(left)
  if had_full and not has_full then counts[1] = counts[1] - 1 end
  if had_lin and not has_lin then counts[2] = counts[2] - 1 end
  local newval
  if left == 0 then
    newval = string.sub(val, 1, p - 1) .. string.sub(val, p + 5)
  else
    newval = string.sub(val, 1, p + 2) .. string.char(left) .. string.sub(val, p + 4)
  end
  if newval == '' then redis.call('HDEL', bkey, f) else redis.call('HSET', bkey, f, newval) end
  return true
end

local function epoch_drop(e)
  local ekey = pre .. 'e:' .. e
  local packed = redis.call('GET', ekey)
  if not packed then return end
  redis.call('DEL', ekey)
  for q = 1, #packed, 8 do
    if rec_clear(string.sub(packed, q, q + 7), 255, e) then evicted = evicted + 1 end
  end
end

local function clear()
  for e = 0, 255 do
    local ekey = pre .. 'e:' .. e
    local packed = redis.call('GET', ekey)
    if packed then
      redis.call('DEL', ekey)
      for q = 1, #packed, 8 do rec_clear(string.sub(packed, q, q + 7), 255, nil) end
    end
  end
  counts[1] = 0
  counts[2] = 0
  stores = 0
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

local i = 6
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local kind = tonumber(ARGV[i + 1])
    local medium = tonumber(ARGV[i + 2])
    local group = tonumber(ARGV[i + 3])
    local packed = ARGV[i + 4]
    if group >= 0 then redis.call('HSET', meta, 'g' .. group, kind) end
    if kind == 1 then redis.call('SADD', 'pfx:linear', inst) end
    local bitv = bit.lshift(1, kind * 4 + medium)
    local epoch = math.floor(stores / epoch_len) % 256
    local ekey = pre .. 'e:' .. epoch
    local run_start = 1
    for q = 1, #packed, 8 do
      if stores > 0 and stores % epoch_len == 0 then
        -- a new epoch starts: flush this run to the old one, drop the one K back
        if q > run_start then redis.call('APPEND', ekey, string.sub(packed, run_start, q - 1)) end
        run_start = q
        epoch = math.floor(stores / epoch_len) % 256
        ekey = pre .. 'e:' .. epoch
        epoch_drop((epoch - k_epochs) % 256)
      end
      stores = stores + 1
      local h = string.sub(packed, q, q + 7)
      local bkey, f = bucket_of(h)
      local val = redis.call('HGET', bkey, f)
      local p = rec_find(val, idb)
      local newval
      if p then
        local flags = string.byte(val, p + 3)
        local had_full, had_lin = kinds_of(flags)
        if kind == 0 and not had_full then counts[1] = counts[1] + 1 end
        if kind == 1 and not had_lin then counts[2] = counts[2] + 1 end
        newval = string.sub(val, 1, p + 2) .. string.char(bit.bor(flags, bitv), epoch)
          .. string.sub(val, p + 5)
      else
        counts[kind + 1] = counts[kind + 1] + 1
        newval = (val or '') .. idb .. string.char(bitv, epoch)
      end
      redis.call('HSET', bkey, f, newval)
    end
    if #packed >= run_start then redis.call('APPEND', ekey, string.sub(packed, run_start)) end
    i = i + 5
  elseif op == 'R' then
    local medium = tonumber(ARGV[i + 1])
    local group = tonumber(ARGV[i + 2])
    local packed = ARGV[i + 3]
    local mask = bit.bor(bit.lshift(1, medium), bit.lshift(1, 4 + medium))
    if group >= 0 then
      local kind = redis.call('HGET', meta, 'g' .. group)
      if kind then mask = bit.lshift(1, tonumber(kind) * 4 + medium) end
    end
    for q = 1, #packed, 8 do rec_clear(string.sub(packed, q, q + 7), mask, nil) end
    i = i + 4
  elseif op == 'C' then
    clear()
    i = i + 1
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
redis.call('HSET', meta, 'blocks', counts[1], 'ckpts', counts[2], 'stores', stores)
redis.call('HINCRBY', meta, 'events', 1)
redis.call('SADD', 'pfx:instances', inst)
return {status, gap, evicted, redis.call('HGET', meta, 'state')}
"""
)


def _packed(hashes: Sequence[str]) -> bytes:
    return bytes.fromhex("".join(hashes))


def _apply_args(
    instance: str, seq: int | None, events: Sequence[KvEvent], cap: int, now: float
) -> list[Any]:
    if cap < 1:
        raise ValueError(f"cap must be at least 1, not {cap}")
    args: list[Any] = [instance, cap, repr(now), -1 if seq is None else seq, min(EPOCHS, cap)]
    for ev in events:
        if isinstance(ev, StoredBlocks):
            if ev.block_hashes:
                group = -1 if ev.group is None else ev.group
                kind = 1 if ev.linear else 0
                args += ["S", kind, medium_code(ev.medium), group, _packed(ev.block_hashes)]
        elif isinstance(ev, RemovedBlocks):
            if ev.block_hashes:
                group = -1 if ev.group is None else ev.group
                args += ["R", medium_code(ev.medium), group, _packed(ev.block_hashes)]
        else:
            args.append("C")
    return args


def _result(raw: Sequence[Any]) -> BatchResult:
    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    return BatchResult(status=s(raw[0]), gap=int(raw[1]), evicted=int(raw[2]), state=s(raw[3]))


APPLY_SCRIPT = lua_script(_APPLY_LUA)


def kv_batch_apply(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: redis.Redis | None = None,
) -> BatchResult:
    """Apply one KV-event batch of ``instance`` atomically (hashes already folded)."""
    r = client or redis_sync()
    args = _apply_args(instance, seq, events, cap, time.time())
    try:
        raw = r.evalsha(APPLY_SCRIPT.sha, 0, *args)
    except redis.exceptions.NoScriptError:
        raw = r.eval(_APPLY_LUA, 0, *args)
    return _result(raw)


async def kv_batch_apply_async(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
) -> BatchResult:
    """Async twin of :func:`kv_batch_apply`."""
    return (await kv_batches_apply_async(instance, [(seq, events)], cap, client))[0]


async def kv_batches_apply_async(
    instance: str,
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
) -> list[BatchResult]:
    """Apply several batches of one instance in order, in one round trip."""
    r = client or redis_async()
    now = time.time()
    argsets = [_apply_args(instance, seq, events, cap, now) for seq, events in batches]
    for attempt in (0, 1):
        pipe = r.pipeline(transaction=False)
        for args in argsets:
            if attempt == 0:
                pipe.evalsha(APPLY_SCRIPT.sha, 0, *args)
            else:
                pipe.eval(_APPLY_LUA, 0, *args)
        try:
            return [_result(raw) for raw in await pipe.execute()]
        except redis.exceptions.NoScriptError:
            # the first batch failed on NOSCRIPT, so none was applied: send the source once
            await r.script_load(_APPLY_LUA)
    raise RuntimeError("unreachable")


def prefix_index_instance_reset(instance: str, client: redis.Redis | None = None) -> None:
    """Forget everything about an instance (removed from inventory, or operator reset)."""
    r = client or redis_sync()
    kv_batch_apply(instance, None, [AllCleared()], client=r)
    r.delete(f"pfx:i:{instance}:m")
    r.srem("pfx:instances", instance)
    r.srem("pfx:linear", instance)


# --- lookup -------------------------------------------------------------------------------


# Server-side walk of many chains at once: for each chain, intersect the holders block by block
# from the start and stop at the first block nobody still in the run holds. Returns, per chain,
# ``[k, inst1, blocks1, ..., instk, blocksk]`` (usable blocks: for hybrid models, the last
# linear checkpoint inside the run, for instances that report checkpoints at all), then the
# degraded instances. A block counts in any medium (a CPU-tier copy is reused too).
# ARGV: hybrid (0|1), then one string per chain: its 8-byte block keys, concatenated.
_MATCH_LUA = (
    _RECORDS_LUA
    + """
local hybrid = ARGV[1] == '1'
local linear = {}
if hybrid then
  local names = redis.call('SMEMBERS', 'pfx:linear')
  if #names > 0 then
    local ids = redis.call('HMGET', 'pfx:ids', unpack(names))
    for _, idb in ipairs(ids) do if idb then linear[idb] = true end end
  end
end
local out = {}
local wanted = {}
local wanted_list = {}
for c = 2, #ARGV do
  local packed = ARGV[c]
  local alive = nil
  local full = {}
  local usable = {}
  for q = 1, #packed, 8 do
    local i = (q + 7) / 8
    local bkey, f = bucket_of(string.sub(packed, q, q + 7))
    local val = redis.call('HGET', bkey, f)
    if not val then break end
    local next_alive = {}
    local any = false
    for p = 1, #val, 5 do
      local idb = string.sub(val, p, p + 2)
      local flags = string.byte(val, p + 3)
      if (alive == nil or alive[idb]) and bit.band(flags, 15) ~= 0 then
        next_alive[idb] = flags
        any = true
      end
    end
    if not any then break end
    alive = next_alive
    for idb, flags in pairs(alive) do
      full[idb] = i
      if hybrid and linear[idb] and bit.band(flags, 240) ~= 0 then usable[idb] = i end
    end
  end
  local entries = {}
  for idb, blocks in pairs(full) do
    local b = blocks
    if hybrid and linear[idb] then b = usable[idb] or 0 end
    if b > 0 then
      if not wanted[idb] then
        wanted[idb] = true
        wanted_list[#wanted_list + 1] = idb
      end
      entries[#entries + 1] = idb
      entries[#entries + 1] = b
    end
  end
  out[#out + 1] = #entries / 2
  for _, v in ipairs(entries) do out[#out + 1] = v end
end
if #wanted_list > 0 then
  local names = redis.call('HMGET', 'pfx:names', unpack(wanted_list))
  local name_of = {}
  for j, idb in ipairs(wanted_list) do name_of[idb] = names[j] or '' end
  local at = 1
  for _ = 2, #ARGV do
    local k = out[at]
    for j = 1, k do
      local pos = at + 2 * j - 1
      out[pos] = name_of[out[pos]]
    end
    at = at + 1 + 2 * k
  end
end
local degraded = redis.call('SMEMBERS', 'pfx:degraded')
out[#out + 1] = #degraded
for _, inst in ipairs(degraded) do out[#out + 1] = inst end
return out
"""
)
MATCH_SCRIPT = lua_script(_MATCH_LUA)


def prefix_matches_queue(
    pipe: Any, chains: Sequence[Sequence[str]], hybrid: bool, by_sha: bool = False
) -> None:
    """Queue ONE command matching every chain server-side (see :func:`prefix_matches_parse`).

    Chains hold folded keys (16 hex digits, :func:`block_hash_key`); each travels as one
    binary string. ``by_sha``: the caller loaded the script (:mod:`clusters.live.scripts`).
    """
    args: list[Any] = ["1" if hybrid else "0", *(_packed(chain) for chain in chains)]
    if by_sha:
        MATCH_SCRIPT.queue(pipe, [], args)
    else:
        pipe.eval(_MATCH_LUA, 0, *args)


def prefix_matches_parse(raw: Sequence[Any], n_chains: int, block_size: int) -> list[PrefixMatch]:
    """One :class:`PrefixMatch` per chain, in order, from the result of the queued command."""
    out: list[PrefixMatch] = []
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
        out.append(PrefixMatch(tokens_by_instance=tokens, degraded=degraded))
    return out


def prefix_match(
    chain: Sequence[str], block_size: int, hybrid: bool = False, client: redis.Redis | None = None
) -> PrefixMatch:
    """One round trip: the longest matched prefix per instance."""
    pipe = (client or redis_sync()).pipeline(transaction=False)
    prefix_matches_queue(pipe, [chain], hybrid)
    return prefix_matches_parse(pipe.execute()[0], 1, block_size)[0]


async def prefix_match_async(
    chain: Sequence[str],
    block_size: int,
    hybrid: bool = False,
    client: aioredis.Redis | None = None,
) -> PrefixMatch:
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
        pipe.hmget(
            f"pfx:i:{inst}:m", "state", "last_seq", "gaps", "missed", "gap_at", "blocks", "ckpts"
        )
    out = []
    for inst, row in zip(instances, pipe.execute(), strict=True):
        state, last_seq, gaps, missed, gap_at, blocks, ckpts = (
            v.decode() if v is not None else None for v in row
        )
        out.append(
            InstanceIndexState(
                instance=inst,
                state=state or "exact",
                last_seq=int(last_seq) if last_seq is not None else None,
                gaps=int(gaps or 0),
                missed_batches=int(missed or 0),
                last_gap_at=float(gap_at) if gap_at is not None else None,
                blocks=int(blocks or 0),
                checkpoints=int(ckpts or 0),
            )
        )
    return out


def prefix_index_size(client: redis.Redis | None = None) -> dict[str, int]:
    """Entries (blocks + checkpoints) per instance, for ``/metrics``."""
    return {s.instance: s.blocks + s.checkpoints for s in prefix_index_states(client=client)}
