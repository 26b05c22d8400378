"""The global prefix index: which instance holds which prefix blocks, kept from KV events.

Two kinds of entries (``docs/paper.md`` section 3.2):

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
API, 8 raw bytes here). Instances are split into ``PREFIX_INDEX_GROUPS`` groups, every key of a
group under its prefix ``P`` = ``pfx:{tag}:`` (one hash slot: :mod:`clusters.live.keys`); the
scripts take ``P`` as ``KEYS[1]``, and below ``P`` is left out:

``h:{b}``               HASH  bucket ``b`` (the key's last 2 bytes, raw: 65,536 buckets): field =
                              the key's first 6 bytes, value = 5-byte records
                              ``instance id (3) | flags (1) | epoch (1)`` of its holders.
                              Small buckets are listpack-encoded by Redis (~15 bytes/entry).
``i:{inst}:m``          HASH  id, last_seq, state (exact|degraded), gaps, missed, gap_at,
                              events, blocks, ckpts, stores, drop, g{group_idx} (kind of a group),
                              at (unix time a batch was last applied)
``i:{inst}:e:{n}``      STRING the 8-byte keys stored in epoch ``n`` (mod 256), concatenated
``ids``/``names``       HASH  instance name <-> 3-byte id (per group)
``degraded``            SET   instances whose event stream showed a sequence gap
``instances``           SET   instances with entries
``linear``              SET   instances that ever reported linear-state checkpoints (an
                              engine that reports none is matched on full blocks only)
``graveyard``           LIST  cleared instances' epoch keys still to sweep (old id + key
                              ``gy:{n}``): ``AllBlocksCleared`` gives the instance a fresh
                              id at once and leaves the records to :func:`prefix_index_sweep`

Memory is bounded per instance by ``cap``: stores are counted in epochs of ``cap / K`` (K = 16,
or ``cap`` when smaller); when a new epoch starts, the entries still held from the epoch K back
are evicted (an entry stored again later carries the newer epoch and stays), at the pace of
the stores that follow, so no script holds Redis for a whole epoch's eviction (the index may
hold up to one epoch over ``cap`` meanwhile; the drop's progress is ``drop`` in the meta
hash). vLLM sends ``BlockRemoved`` for what it evicts, so the cap only bounds what missed removals (gaps) leave
behind; it evicts oldest-stored first, to within one epoch.

Lookup: a chain ``h0..hn`` is matched by intersecting holders block by block until the run is
empty. That walk runs server-side in one Lua script per group for all chains of an API call
(:func:`prefix_matches_queue`; one group: one command, several: one pipeline, which a cluster
client sends to the nodes in parallel): only the answer, a few (instance, blocks) pairs per
chain, crosses the network.

Sequence numbers: batches carry the publisher's ``seq`` (+1 per batch, from 0). A batch with
``seq`` at or below the last one is a redelivery and is skipped; a jump marks the instance
``degraded`` (entries kept but trusted less, the gap shown by the API) until
``AllBlocksCleared`` or an engine restart (``seq`` back to 0) empties its entries, after which
the index for it is exact again. Each batch is applied by one Lua script, atomically.
Every key a script touches is under its group's prefix, so the store runs on a single Redis
or a Redis Cluster alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

from clusters.live.keys import prefix_group_prefixes, prefix_instance_prefix
from controlplane.redis_connection import redis_async, redis_sync
from controlplane.redis_scripts import (
    lua_script,
    pipeline_run,
    pipeline_run_async,
    script_call_async,
)

DEFAULT_CAP_PER_INSTANCE = 200_000
EPOCHS = 16
_U64 = 1 << 64

# Media (vLLM's ``medium``): GPU is the default tier (and what engines without the field mean).
MEDIA = {"gpu": 0, "cpu": 1, "storage": 2, "disk": 2}
OTHER_MEDIUM = 3


def prefix_index_groups() -> int:
    """The index's instance groups (``PREFIX_INDEX_GROUPS``; :mod:`clusters.live.keys`)."""
    return int(settings.PREFIX_INDEX_GROUPS)


def _instance_prefix(instance: str) -> list[str]:
    """``KEYS`` of a script on ``instance``'s group: its key prefix."""
    return [prefix_instance_prefix(instance, prefix_index_groups())]


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


# Block keys of an operation: 16-hex-digit keys (:func:`block_hash_key`), or the same keys
# already packed as 8 bytes each, big-endian (the ingest path's fast form).
BlockKeys = Sequence[str] | bytes


@dataclass(frozen=True)
class StoredBlocks:
    """BlockStored: a run of full blocks; ``linear`` when they are linear-state checkpoints.
    ``group``: the engine's KV-cache group (``group_idx``), None when it does not say."""

    block_hashes: BlockKeys
    linear: bool = False
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True)
class RemovedBlocks:
    """BlockRemoved from ``group`` (None: every group, as engines without groups mean) and
    ``medium`` (None: GPU)."""

    block_hashes: BlockKeys
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
    updated_at: float | None = None


@dataclass(frozen=True)
class IndexMatch:
    """Longest matched prefix (tokens) per instance for one request's block chain."""

    tokens_by_instance: Mapping[str, int]
    degraded: frozenset[str] = field(default_factory=frozenset)
    # Some index groups did not answer in time (a slow or lost shard): the matches of their
    # instances are missing, not zero.
    unavailable: bool = False

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
local sub, byte, char = string.sub, string.byte, string.char
local call = redis.call
local function rec_find(val, idb)
  if not val then return nil end
  for p = 1, #val, 5 do
    if sub(val, p, p + 2) == idb then return p end
  end
  return nil
end
-- every key is the group's (KEYS[1], ``pfx:{tag}:``): one slot, so one node of a cluster
local P = KEYS[1]
local function bucket_of(h)
  -- the bucket is named by the key's last 2 bytes, raw (no number formatting on this path)
  return P .. 'h:' .. sub(h, 7, 8), sub(h, 1, 6)
end
"""

# ARGV: inst, cap, now, epochs, then batches, each 'B', seq (-1 when absent), then its ops:
#   'S', kind (0 full | 1 linear), medium (0..3), group (-1: none), packed 8-byte keys
#   'R', medium, group (-1: every group), packed keys  |  'C'
# All batches of one call run in one script (the per-instance state is read and written once):
# returns {status, gap, evicted, state} per batch, flattened.
_APPLY_LUA = (
    _RECORDS_LUA
    + """
local inst = ARGV[1]
local cap = tonumber(ARGV[2])
local now = ARGV[3]
local k_epochs = tonumber(ARGV[4])
local epoch_len = math.ceil(cap / k_epochs)
local pre = P .. 'i:' .. inst .. ':'
local meta = pre .. 'm'

local m = call('HMGET', meta, 'id', 'blocks', 'ckpts', 'stores', 'last_seq', 'state', 'drop')
local idb = m[1]
if not idb then
  idb = call('HGET', P .. 'ids', inst)
  if not idb then
    local n = call('INCR', P .. 'nextid')
    idb = char(math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
    call('HSET', P .. 'ids', inst, idb)
    call('HSET', P .. 'names', idb, inst)
  end
  call('HSET', meta, 'id', idb)
end
local counts = {tonumber(m[2]) or 0, tonumber(m[3]) or 0}
local stores = tonumber(m[4]) or 0
local last = tonumber(m[5])
local state = m[6] or 'exact'
-- the epoch being evicted and how far (bytes into its key), or nil: see epoch_drop_step
local drop_e, drop_at = nil, 0
if m[7] then
  local sep = string.find(m[7], ':', 1, true)
  drop_e, drop_at = tonumber(sub(m[7], 1, sep - 1)), tonumber(sub(m[7], sep + 1))
end
local evicted = 0
local groups = {}  -- group_idx -> kind, cached for this call

local function group_kind(group)
  local kind = groups[group]
  if kind == nil then
    kind = tonumber(call('HGET', meta, 'g' .. group)) or false
    groups[group] = kind
  end
  return kind
end

-- flags of one record -> full?, linear?
local function kinds_of(flags)
  return bit.band(flags, 15) ~= 0, bit.band(flags, 240) ~= 0
end

-- Remove bits `mask` of this instance's record for key h (all bits when mask is 255);
-- `only_epoch`: only if the record was last stored in that epoch. Returns true if changed.
local function rec_clear(h, mask, only_epoch)
  local bkey, f = bucket_of(h)
  local val = call('HGET', bkey, f)
  local p = rec_find(val, idb)
  if not p then return false end
  local flags = byte(val, p + 3)
  if only_epoch and byte(val, p + 4) ~= only_epoch then return false end
  local left = bit.band(flags, bit.bnot(mask))
  if left == flags then return false end
  local had_full, had_lin = kinds_of(flags)
  local has_full, has_lin = kinds_of(left)
  if had_full and not has_full then counts[1] = counts[1] - 1 end
  if had_lin and not has_lin then counts[2] = counts[2] - 1 end
  local newval
  if left == 0 then
    newval = sub(val, 1, p - 1) .. sub(val, p + 5)
  else
    newval = sub(val, 1, p + 2) .. char(left) .. sub(val, p + 4)
  end
  if newval == '' then call('HDEL', bkey, f) else call('HSET', bkey, f, newval) end
  return true
end

-- Evicting a whole epoch at once (cap / K = 12,500 entries at the default cap) held Redis for
-- ~80 ms inside one script, and every route lookup waited behind it. Instead the epoch K back
-- is evicted at the pace of the stores that follow (EVICT_STEP entries every EVICT_STEP
-- stores, one GETRANGE each): its cap / K entries are gone by the time the next epoch is due,
-- so memory stays within the cap plus one epoch, and every script's cost stays proportional
-- to what it stores (~5 us a block here, eviction included).
local EVICT_STEP = 64
local function epoch_drop_step(n)
  if drop_e == nil then return end
  local ekey = pre .. 'e:' .. drop_e
  local packed = call('GETRANGE', ekey, drop_at, drop_at + n * 8 - 1)
  for q = 1, #packed, 8 do
    if rec_clear(sub(packed, q, q + 7), 255, drop_e) then evicted = evicted + 1 end
  end
  drop_at = drop_at + #packed
  if #packed < n * 8 then
    call('DEL', ekey)
    drop_e, drop_at = nil, 0
  end
end

local function epoch_drop(e)
  -- (a drop still under way is finished first: at the stores' pace there is at most one
  -- step of it left)
  while drop_e ~= nil do epoch_drop_step(epoch_len) end
  drop_e, drop_at = e, 0
end

local function new_id()
  local n = call('INCR', P .. 'nextid')
  return char(math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end

-- Deleting every record here held Redis for 1.5 s on 400,000 entries. Instead the instance
-- takes a fresh id (its old records then match nothing: their id names no instance) and its
-- epoch keys move to the graveyard, which prefix_index_sweep empties in bounded steps.
local function clear()
  local old = idb
  local moved = false
  for e = 0, 255 do
    local ekey = pre .. 'e:' .. e
    if call('EXISTS', ekey) == 1 then
      local gkey = P .. 'gy:' .. call('INCR', P .. 'gy:next')
      call('RENAME', ekey, gkey)
      call('RPUSH', P .. 'graveyard', old .. gkey)
      moved = true
    end
  end
  if moved then
    idb = new_id()
    call('HDEL', P .. 'names', old)
    call('HSET', P .. 'ids', inst, idb)
    call('HSET', P .. 'names', idb, inst)
    call('HSET', meta, 'id', idb)
  end
  counts[1] = 0
  counts[2] = 0
  stores = 0
  drop_e, drop_at = nil, 0  -- its key went to the graveyard with the rest
  call('SREM', P .. 'degraded', inst)
  state = 'exact'
end

local function store(kind, medium, group, packed)
  if group >= 0 and groups[group] ~= kind then
    call('HSET', meta, 'g' .. group, kind)
    groups[group] = kind
  end
  if kind == 1 then call('SADD', P .. 'linear', inst) end
  local bitv = bit.lshift(1, kind * 4 + medium)
  local epoch = math.floor(stores / epoch_len) % 256
  local ekey = pre .. 'e:' .. epoch
  local run_start = 1
  for q = 1, #packed, 8 do
    if stores > 0 and stores % epoch_len == 0 then
      -- a new epoch starts: flush this run to the old one, drop the one K back
      if q > run_start then call('APPEND', ekey, sub(packed, run_start, q - 1)) end
      run_start = q
      epoch = math.floor(stores / epoch_len) % 256
      ekey = pre .. 'e:' .. epoch
      epoch_drop((epoch - k_epochs) % 256)
      epoch_drop_step(math.min(EVICT_STEP, epoch_len))
    elseif stores % EVICT_STEP == 0 then
      epoch_drop_step(EVICT_STEP)
    end
    stores = stores + 1
    local h = sub(packed, q, q + 7)
    local bkey, f = bucket_of(h)
    local rec = idb .. char(bitv, epoch)
    -- most stored blocks are new to the whole fleet: one call for those
    if call('HSETNX', bkey, f, rec) == 1 then
      counts[kind + 1] = counts[kind + 1] + 1
    else
      local val = call('HGET', bkey, f)
      local p = rec_find(val, idb)
      local newval
      if p then
        local flags = byte(val, p + 3)
        local had_full, had_lin = kinds_of(flags)
        if kind == 0 and not had_full then counts[1] = counts[1] + 1 end
        if kind == 1 and not had_lin then counts[2] = counts[2] + 1 end
        newval = sub(val, 1, p + 2) .. char(bit.bor(flags, bitv), epoch)
          .. sub(val, p + 5)
      else
        counts[kind + 1] = counts[kind + 1] + 1
        newval = val .. rec
      end
      call('HSET', bkey, f, newval)
    end
  end
  if #packed >= run_start then call('APPEND', ekey, sub(packed, run_start)) end
end

local function remove(medium, group, packed)
  local mask = bit.bor(bit.lshift(1, medium), bit.lshift(1, 4 + medium))
  if group >= 0 then
    local kind = group_kind(group)
    if kind then mask = bit.lshift(1, kind * 4 + medium) end
  end
  for q = 1, #packed, 8 do rec_clear(sub(packed, q, q + 7), mask, nil) end
end

local out = {}
local applied = 0
local i = 5
while i <= #ARGV do
  if ARGV[i] ~= 'B' then return redis.error_reply('expected a batch marker at ' .. i) end
  local seq = tonumber(ARGV[i + 1])
  i = i + 2
  local status = 'applied'
  local gap = 0
  local skip = false
  local evicted_before = evicted
  if seq >= 0 then
    if last ~= nil then
      if seq == 0 and last > 0 then
        status = 'restart'
        clear()
      elseif seq <= last then
        status = 'duplicate'
        skip = true
      elseif seq > last + 1 then
        gap = seq - last - 1
        state = 'degraded'
        call('HSET', meta, 'gap_at', now)
        call('HINCRBY', meta, 'gaps', 1)
        call('HINCRBY', meta, 'missed', gap)
        call('SADD', P .. 'degraded', inst)
      end
    end
    if not skip then last = seq end
  end
  while i <= #ARGV and ARGV[i] ~= 'B' do
    local op = ARGV[i]
    if op == 'S' then
      if not skip then
        store(tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), ARGV[i + 4])
      end
      i = i + 5
    elseif op == 'R' then
      if not skip then remove(tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]) end
      i = i + 4
    elseif op == 'C' then
      if not skip then clear() end
      i = i + 1
    else
      return redis.error_reply('unknown op ' .. tostring(op))
    end
  end
  if not skip then applied = applied + 1 end
  out[#out + 1] = status
  out[#out + 1] = gap
  out[#out + 1] = evicted - evicted_before
  out[#out + 1] = state
end
local fields = {'blocks', counts[1], 'ckpts', counts[2], 'stores', stores, 'state', state}
if drop_e ~= nil then
  fields[#fields + 1] = 'drop'
  fields[#fields + 1] = drop_e .. ':' .. drop_at
else
  call('HDEL', meta, 'drop')
end
if last ~= nil then
  fields[#fields + 1] = 'last_seq'
  fields[#fields + 1] = last
end
if applied > 0 then
  -- when the index last heard of this instance: an agent that restarts tells from it whether
  -- the engine process it finds is the one that fed the index
  fields[#fields + 1] = 'at'
  fields[#fields + 1] = now
end
call('HSET', meta, unpack(fields))
if applied > 0 then call('HINCRBY', meta, 'events', applied) end
call('SADD', P .. 'instances', inst)
return out
"""
)


def _packed(hashes: BlockKeys) -> bytes:
    if isinstance(hashes, bytes):
        return hashes
    return bytes.fromhex("".join(hashes))


def _batch_args(seq: int | None, events: Sequence[KvEvent]) -> list[Any]:
    args: list[Any] = ["B", -1 if seq is None else seq]
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


def _apply_args(
    instance: str,
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]],
    cap: int,
    now: float,
) -> list[Any]:
    if cap < 1:
        raise ValueError(f"cap must be at least 1, not {cap}")
    args: list[Any] = [instance, cap, repr(now), min(EPOCHS, cap)]
    for seq, events in batches:
        args += _batch_args(seq, events)
    return args


def _results(raw: Sequence[Any]) -> list[BatchResult]:
    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    return [
        BatchResult(
            status=s(raw[k]), gap=int(raw[k + 1]), evicted=int(raw[k + 2]), state=s(raw[k + 3])
        )
        for k in range(0, len(raw), 4)
    ]


# Block hashes per script call: a script holds Redis for its duration (~3 us a block here, ~5
# with the cap's eviction), and route lookups wait behind it, so a big post is applied in
# slices of ~200 blocks (~1 ms each; each slice atomic, in order), one call at a time: Redis
# reads a pipeline greedily and ran five queued slices back to back (48 ms without a reply to
# anyone else, measured with a PING loop beside the largest post).
MAX_BLOCKS_PER_CALL = 200


def _blocks_of(events: Sequence[KvEvent]) -> int:
    n = 0
    for ev in events:
        if isinstance(ev, StoredBlocks | RemovedBlocks):
            keys = ev.block_hashes
            n += len(keys) // 8 if isinstance(keys, bytes) else len(keys)
    return n


def _slices(
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]],
) -> list[Sequence[tuple[int | None, Sequence[KvEvent]]]]:
    out: list[Sequence[tuple[int | None, Sequence[KvEvent]]]] = []
    start = blocks = 0
    for k, (_, events) in enumerate(batches):
        n = _blocks_of(events)
        if k > start and blocks + n > MAX_BLOCKS_PER_CALL:
            out.append(batches[start:k])
            start, blocks = k, 0
        blocks += n
    if start < len(batches):
        out.append(batches[start:])
    return out


APPLY_SCRIPT = lua_script(_APPLY_LUA, "prefix apply")

# ARGV: budget (records). Removes up to ``budget`` records of cleared instances (the
# graveyard's head: a 3-byte old id, then the key of its 8-byte block keys), resuming where the
# last call stopped (``{key}:o``). Returns the records the graveyard still holds keys for
# (0: empty).
_SWEEP_LUA = (
    _RECORDS_LUA
    + """
local budget = tonumber(ARGV[1])
while budget > 0 do
  local head = call('LINDEX', P .. 'graveyard', 0)
  if not head then return 0 end
  local old, gkey = sub(head, 1, 3), sub(head, 4)
  local at = tonumber(call('GET', gkey .. ':o')) or 0
  local packed = call('GETRANGE', gkey, at, at + budget * 8 - 1)
  for q = 1, #packed, 8 do
    local bkey, f = bucket_of(sub(packed, q, q + 7))
    local val = call('HGET', bkey, f)
    local p = rec_find(val, old)
    if p then
      local newval = sub(val, 1, p - 1) .. sub(val, p + 5)
      if newval == '' then call('HDEL', bkey, f) else call('HSET', bkey, f, newval) end
    end
  end
  budget = budget - #packed / 8
  if #packed == 0 or at + #packed >= call('STRLEN', gkey) then
    call('DEL', gkey, gkey .. ':o')
    call('LPOP', P .. 'graveyard')
  else
    call('SET', gkey .. ':o', at + #packed)
  end
end
return call('LLEN', P .. 'graveyard')
"""
)
SWEEP_SCRIPT = lua_script(_SWEEP_LUA, "prefix sweep")
#: Records a sweep removes after a post, in calls of SWEEP_STEP (~1 ms of Redis each, like an
#: apply slice; other clients are served between them).
SWEEP_BUDGET = 2_000
SWEEP_STEP = 250


def _sweep_prefixes(instance: str | None) -> list[str]:
    """The groups a sweep visits: ``instance``'s (after its post: a clear leaves its records
    in its own group), or every group."""
    if instance is not None:
        return _instance_prefix(instance)
    return prefix_group_prefixes(prefix_index_groups())


def prefix_index_sweep(
    budget: int = SWEEP_BUDGET, client: redis.Redis | None = None, instance: str | None = None
) -> int:
    """Remove up to ``budget`` records of cleared instances (per group visited); the graveyard
    keys left (0: done). Run after every KV-event post (bounded, on the poster's group), so a
    clear costs a few ms per post, not a stall."""
    r = client or redis_sync()
    keys_left = 0
    for prefix in _sweep_prefixes(instance):
        left = budget
        while True:
            keys = int(SWEEP_SCRIPT.run(r, [prefix], [min(SWEEP_STEP, left)]))
            left -= SWEEP_STEP
            if not keys or left <= 0:
                keys_left += keys
                break
    return keys_left


async def prefix_index_sweep_async(
    budget: int = SWEEP_BUDGET,
    client: aioredis.Redis | None = None,
    redis_share: float = 1.0,
    instance: str | None = None,
) -> int:
    """Async twin of :func:`prefix_index_sweep`; its calls spaced like
    :func:`kv_batches_apply_async`'s (``redis_share``, :data:`INGEST_PACER`)."""
    r = client or redis_async()
    keys_left = 0
    for prefix in _sweep_prefixes(instance):
        left = budget
        while True:
            async with INGEST_PACER.turn(redis_share):
                keys = int(await SWEEP_SCRIPT.run_async(r, [prefix], [min(SWEEP_STEP, left)]))
            left -= SWEEP_STEP
            if not keys or left <= 0:
                keys_left += keys
                break
    return keys_left


def kv_batch_apply(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: redis.Redis | None = None,
) -> BatchResult:
    """Apply one KV-event batch of ``instance`` atomically (hashes already folded)."""
    r = client or redis_sync()
    args = _apply_args(instance, [(seq, events)], cap, time.time())
    raw = APPLY_SCRIPT.run(r, _instance_prefix(instance), args)
    return _results(raw)[0]


async def kv_batch_apply_async(
    instance: str,
    seq: int | None,
    events: Sequence[KvEvent],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
) -> BatchResult:
    """Async twin of :func:`kv_batch_apply`."""
    return (await kv_batches_apply_async(instance, [(seq, events)], cap, client))[0]


class RedisPacer:
    """Spaces a process's KV-index script calls so that, together, they hold Redis at most a
    share of the time: one call at a time (per event loop), each followed by a pause in
    proportion to how long it took (its wall time: the Redis time it took, at most).

    Route lookups queue behind every script Redis runs: two agents' largest posts, applied flat
    out, kept Redis ~75% busy and tripled the route p99 (``bench/ingest_isolation.py``). At a
    share of 0.5 a post takes about twice its Redis time and routing keeps at least half of
    Redis, however many posts this process is applying at once.
    """

    def __init__(self) -> None:
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._free_at = 0.0

    @contextlib.asynccontextmanager
    async def turn(self, share: float) -> AsyncIterator[None]:
        """Hold Redis for one call (at share 1: at once, nothing spaced)."""
        if not 0 < share <= 1:
            raise ValueError(f"redis_share must be in (0, 1], not {share}")
        if share == 1:
            yield
            return
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            wait = self._free_at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            began = time.perf_counter()
            try:
                yield
            finally:
                ended = time.perf_counter()
                self._free_at = ended + (ended - began) * (1 / share - 1)


#: The pacer of this process's KV-event posts and sweeps.
INGEST_PACER = RedisPacer()


async def kv_batches_apply_async(
    instance: str,
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]],
    cap: int = DEFAULT_CAP_PER_INSTANCE,
    client: aioredis.Redis | None = None,
    redis_share: float = 1.0,
) -> list[BatchResult]:
    """Apply several batches of one instance in order: a script call per
    ~``MAX_BLOCKS_PER_CALL`` blocks, one after the other (not pipelined, so other clients'
    commands are served between them), spaced by :data:`INGEST_PACER` to hold Redis at most
    ``redis_share`` of the time (0 < share <= 1)."""
    r = client or redis_async()
    now = time.time()
    results: list[BatchResult] = []
    keys = _instance_prefix(instance)
    for part in _slices(batches):
        args = _apply_args(instance, part, cap, now)
        async with INGEST_PACER.turn(redis_share):
            raw = await APPLY_SCRIPT.run_async(r, keys, args)
        results.extend(_results(raw))
    return results


def prefix_index_instance_reset(instance: str, client: redis.Redis | None = None) -> None:
    """Forget everything about an instance (removed from inventory, or operator reset)."""
    r = client or redis_sync()
    kv_batch_apply(instance, None, [AllCleared()], client=r)
    prefix = _instance_prefix(instance)[0]
    # One pipeline on the group's slot (a cluster sends it to one node).
    pipe = r.pipeline(transaction=False)
    pipe.delete(f"{prefix}i:{instance}:m")
    pipe.srem(f"{prefix}instances", instance)
    pipe.srem(f"{prefix}linear", instance)
    pipe.execute()


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
  local names = call('SMEMBERS', P .. 'linear')
  if #names > 0 then
    local ids = call('HMGET', P .. 'ids', unpack(names))
    for _, idb in ipairs(ids) do if idb then linear[idb] = true end end
  end
end
local out = {}
local wanted = {}
local wanted_list = {}
-- A stretch of blocks with one holder string ends at ``depth``: each holder's match reaches
-- it (and, hybrid, its last checkpoint too when the string says it holds one there).
local function close_run(alive, depth, full, usable)
  for idb, flags in pairs(alive) do
    full[idb] = depth
    if hybrid and linear[idb] and bit.band(flags, 240) ~= 0 then usable[idb] = depth end
  end
end
for c = 2, #ARGV do
  local packed = ARGV[c]
  -- The run goes on with the holders (in a full-attention medium) of every block so far.
  -- Consecutive blocks stored together have the very same holder string (Lua strings are
  -- interned: comparing them is one pointer test), so the holders are intersected only when
  -- it changes, and each one's match (the last block it was in the run; hybrid: its last
  -- checkpoint there) is written when a stretch of equal strings ends.
  local alive, run_val, depth = nil, nil, 0
  local full, usable = nil, nil
  for q = 1, #packed, 8 do
    -- bucket_of, inlined: this line runs for every block of every chain. (Remembering the
    -- holders of blocks seen earlier in the call cost more than the reads it saved.)
    local val = call('HGET', P .. 'h:' .. sub(packed, q + 6, q + 7), sub(packed, q, q + 5))
    if not val then break end
    if val ~= run_val then
      if alive then close_run(alive, depth, full, usable) end
      local next_alive = {}
      local any = false
      for p = 1, #val, 5 do
        local idb = sub(val, p, p + 2)
        if alive == nil or alive[idb] then
          local flags = byte(val, p + 3)
          if bit.band(flags, 15) ~= 0 then
            next_alive[idb] = flags
            any = true
          end
        end
      end
      if not any then
        alive = nil
        break
      end
      if full == nil then full, usable = {}, {} end
      alive, run_val = next_alive, val
    end
    depth = depth + 1
  end
  if alive then close_run(alive, depth, full, usable) end
  -- [k, inst1, blocks1, ..., instk, blocksk], written in place.
  local at = #out + 1
  local k = 0
  out[at] = 0
  if full then
    for idb, blocks in pairs(full) do
      local b = blocks
      if hybrid and linear[idb] then b = usable[idb] or 0 end
      if b > 0 then
        if not wanted[idb] then
          wanted[idb] = true
          wanted_list[#wanted_list + 1] = idb
        end
        out[at + 2 * k + 1] = idb
        out[at + 2 * k + 2] = b
        k = k + 1
      end
    end
  end
  out[at] = k
end
if #wanted_list > 0 then
  local names = call('HMGET', P .. 'names', unpack(wanted_list))
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
local degraded = call('SMEMBERS', P .. 'degraded')
out[#out + 1] = #degraded
for _, inst in ipairs(degraded) do out[#out + 1] = inst end
return out
"""
)
MATCH_SCRIPT = lua_script(_MATCH_LUA, "prefix match")


def prefix_matches_queue(pipe: Any, chains: Sequence[BlockKeys], hybrid: bool) -> None:
    """Queue ONE command per index group matching every chain server-side (see
    :func:`prefix_matches_parse`): on a cluster the pipeline sends each node its groups' calls,
    the nodes in parallel; nothing scans the keyspace.

    Chains hold folded keys (:data:`BlockKeys`: 16 hex digits each, :func:`block_hash_key`, or
    already packed); each travels as one binary string.
    """
    args = ["1" if hybrid else "0", *(_packed(chain) for chain in chains)]
    for prefix in prefix_group_prefixes(prefix_index_groups()):
        MATCH_SCRIPT.queue(pipe, [prefix], args)


def _group_parse(
    raw: Sequence[Any], n_chains: int, block_size: int, per_chain: list[dict[str, int]]
) -> set[str]:
    """Add one group's matches to ``per_chain``; its degraded instances."""
    at = 0
    # A call names a few instances thousands of times: each name is decoded once.
    names: dict[Any, str] = {}
    for c in range(n_chains):
        k = int(raw[at])
        at += 1
        tokens = per_chain[c]
        for j in range(at, at + 2 * k, 2):
            inst = raw[j]
            name = names.get(inst)
            if name is None:
                name = names[inst] = inst.decode() if isinstance(inst, bytes) else str(inst)
            if name:  # '' is a cleared instance's old id, its records not yet swept
                tokens[name] = int(raw[j + 1]) * block_size
        at += 2 * k
    n_degraded = int(raw[at])
    return {
        d.decode() if isinstance(d, bytes) else str(d) for d in raw[at + 1 : at + 1 + n_degraded]
    }


def prefix_matches_parse(
    raws: Sequence[Sequence[Any]], n_chains: int, block_size: int, unavailable: bool = False
) -> list[IndexMatch]:
    """One :class:`IndexMatch` per chain, in order, from the replies of the queued commands
    (one per group; an instance is in one group, so the groups' matches never overlap);
    ``unavailable``: some groups' replies are missing."""
    per_chain: list[dict[str, int]] = [{} for _ in range(n_chains)]
    degraded: set[str] = set()
    for raw in raws:
        degraded |= _group_parse(raw, n_chains, block_size, per_chain)
    frozen = frozenset(degraded)
    return [
        IndexMatch(tokens_by_instance=tokens, degraded=frozen, unavailable=unavailable)
        for tokens in per_chain
    ]


def _prefixes_by_node(client: Any, prefixes: list[str]) -> list[list[str]]:
    """The groups' prefixes per node that serves them now (a single Redis: one node)."""
    if not isinstance(client, aioredis.RedisCluster | redis.RedisCluster):
        return [prefixes]
    by_node: dict[str, list[str]] = {}
    try:
        for prefix in prefixes:
            node = client.get_node_from_key(prefix)
            by_node.setdefault(node.name if node is not None else "", []).append(prefix)
    except (redis.RedisError, redis.exceptions.RedisClusterException):
        # The client has not read the slots yet, or a slot is between masters (a failover):
        # one call per group, each routed (and the slots read) by the client itself.
        return [[prefix] for prefix in prefixes]
    return list(by_node.values())


async def prefix_matches_bounded_async(
    client: aioredis.Redis,
    chains: Sequence[BlockKeys],
    hybrid: bool,
    block_size: int,
    deadline_s: float,
) -> list[IndexMatch]:
    """The matches of ``chains`` within ``deadline_s``: one pipelined call per node (its
    groups), the nodes in parallel. A node that has not answered by then, or fails (a lost
    master before its replica is promoted), leaves its groups' matches out and the matches say
    ``unavailable``: a slow shard costs the decision its hits, never its deadline."""
    args = ["1" if hybrid else "0", *(_packed(chain) for chain in chains)]
    prefixes = prefix_group_prefixes(prefix_index_groups())

    async def node_call(group: list[str]) -> list[Any]:
        if len(group) == 1:
            return [
                await script_call_async(client, lambda p: MATCH_SCRIPT.queue(p, [group[0]], args))
            ]

        def queue(pipe: Any) -> None:
            for prefix in group:
                MATCH_SCRIPT.queue(pipe, [prefix], args)

        return await pipeline_run_async(client, queue)

    by_node = _prefixes_by_node(client, prefixes)
    if len(by_node) == 1:
        # One node (a single Redis): no task to spawn, the call itself is bounded. Its errors
        # are the caller's (a Redis that refuses connections is down, not slow).
        try:
            async with asyncio.timeout(deadline_s):
                raws = await node_call(by_node[0])
        except TimeoutError:
            return prefix_matches_parse([], len(chains), block_size, unavailable=True)
        return prefix_matches_parse(raws, len(chains), block_size)
    tasks = [asyncio.ensure_future(node_call(g)) for g in by_node]
    done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    raws = []
    missing = bool(pending)
    for task in done:
        if task.exception() is not None:
            missing = True
        else:
            raws.extend(task.result())
    return prefix_matches_parse(raws, len(chains), block_size, unavailable=missing)


async def prefix_matches_async(
    client: aioredis.Redis, chains: Sequence[BlockKeys], hybrid: bool, block_size: int
) -> list[IndexMatch]:
    """The matches of ``chains``: one scripted command per group (one group: sent alone,
    without a pipeline's cost)."""
    if prefix_index_groups() == 1:
        raw = await script_call_async(client, lambda p: prefix_matches_queue(p, chains, hybrid))
        return prefix_matches_parse([raw], len(chains), block_size)
    raws = await pipeline_run_async(client, lambda p: prefix_matches_queue(p, chains, hybrid))
    return prefix_matches_parse(raws, len(chains), block_size)


def prefix_match(
    chain: Sequence[str], block_size: int, hybrid: bool = False, client: redis.Redis | None = None
) -> IndexMatch:
    """One round trip: the longest matched prefix per instance."""
    raws = pipeline_run(client or redis_sync(), lambda p: prefix_matches_queue(p, [chain], hybrid))
    return prefix_matches_parse(raws, 1, block_size)[0]


async def prefix_match_async(
    chain: Sequence[str],
    block_size: int,
    hybrid: bool = False,
    client: aioredis.Redis | None = None,
) -> IndexMatch:
    return (await prefix_matches_async(client or redis_async(), [chain], hybrid, block_size))[0]


# --- health and size --------------------------------------------------------------------------


def prefix_index_states(
    instances: Sequence[str] | None = None, client: redis.Redis | None = None
) -> list[InstanceIndexState]:
    """Index health per instance (all instances with entries when ``instances`` is None)."""
    r = client or redis_sync()
    groups = prefix_index_groups()
    if instances is None:
        pipe = r.pipeline(transaction=False)
        for prefix in prefix_group_prefixes(groups):
            pipe.smembers(f"{prefix}instances")
        instances = sorted(m.decode() for members in pipe.execute() for m in members)
    pipe = r.pipeline(transaction=False)
    for inst in instances:
        pipe.hmget(
            f"{prefix_instance_prefix(inst, groups)}i:{inst}:m",
            "state",
            "last_seq",
            "gaps",
            "missed",
            "gap_at",
            "blocks",
            "ckpts",
            "at",
        )
    out = []
    for inst, row in zip(instances, pipe.execute(), strict=True):
        state, last_seq, gaps, missed, gap_at, blocks, ckpts, at = (
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
                updated_at=float(at) if at is not None else None,
            )
        )
    return out


def prefix_index_size(client: redis.Redis | None = None) -> dict[str, int]:
    """Entries (blocks + checkpoints) per instance, for ``/metrics``."""
    return {s.instance: s.blocks + s.checkpoints for s in prefix_index_states(client=client)}
