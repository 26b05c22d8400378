"""KV-cache events, engine-neutral: what an engine says about its prefix cache, in the terms
the prefix index needs.

An engine publishes, per batch, blocks it stored (hashes of consecutive full blocks, and
whether they are full-attention blocks or linear-state checkpoints), blocks it removed, and
that it cleared everything. Each engine's wire format has a decoder into these types (vLLM:
:mod:`scheduling.core.kv_vllm`); the agent checks and counts them, the control plane indexes
them (``clusters.live.kv_events``). A new engine is one decoder more (docs/architecture.md).

Hashes are what the engine hashes blocks with: 64-bit ints (signed or not) or digests (8 or
32 bytes); the index keys them by their low 64 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The largest publisher sequence number the index keeps exactly: the index's scripts count in
#: doubles (Lua), exact to 2^53. Engines count batches from 0 per publisher; at a million
#: batches a second it would take 285 years to get here. A larger seq is refused (422).
MAX_SEQ = (1 << 53) - 1

BlockHash = int | bytes


class KvEventFormatError(ValueError):
    """A batch or event that is not the engine's shape; the message starts with its path."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks cached. ``block_size``: tokens per block (0: not said);
    ``linear``: linear-state checkpoints (sliding window, Mamba), not full-attention blocks;
    ``medium``: the cache tier (GPU when not said); ``group``: the KV-cache group of a hybrid
    model (None when the engine has one)."""

    hashes: Sequence[BlockHash]
    block_size: int = 0
    linear: bool = False
    medium: str | None = None
    group: int | None = None
    parent: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks evicted from the cache (of one tier and group)."""

    hashes: Sequence[BlockHash]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every block of the engine's cache dropped (e.g. a prefix-cache reset)."""


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: its time (unix seconds), events in order, data-parallel rank."""

    ts: float
    events: Sequence[KvEvent]
    rank: int | None = None


def blocks_in(batch: EventBatch) -> int:
    """Block hashes a batch carries (the agent's and the benchmark's unit of work)."""
    return sum(len(ev.hashes) for ev in batch.events if not isinstance(ev, CacheCleared))
