"""The hybrid prefix cache of one instance (the simulator's and the emulator's engines), and
a trace replayed through one (the uncached lengths the planner plans a trace from).

A hybrid model keeps two kinds of reusable state for a prompt prefix:

* full-attention KV, block by block (``block_tokens`` each): any leading run of blocks that is
  present can be reused (partial prefix match);
* the linear-attention/SWA state, which summarises the whole prefix and exists only as a
  checkpoint at the exact length where a prefill stopped (request-level, exact-length match).

A prefix is usable only when both are present: the matched full-attention blocks *and* a
linear-state checkpoint at exactly that length. Prefills checkpoint at their last whole block,
the position the next turn of a conversation can extend. Blocks are identified by Mooncake's
chained hash ids, so the id of a prefix's last block names the whole prefix and keys its
checkpoint. Both kinds share one byte budget with least-recently-used eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class HybridPrefixCache:
    """Block-level full-attention KV plus exact-length linear-state checkpoints, LRU-evicted."""

    __slots__ = (
        "_entries",
        "block_bytes",
        "capacity_bytes",
        "evictions",
        "state_bytes",
        "used_bytes",
    )

    def __init__(
        self, capacity_bytes: float, block_bytes: Sequence[float], state_bytes: float
    ) -> None:
        # Keys: a block's hash id h for its KV, ~h (= -h-1) for the checkpoint ending at it.
        self._entries: OrderedDict[int, float] = OrderedDict()
        self.capacity_bytes = float(capacity_bytes)
        self.block_bytes = block_bytes
        self.state_bytes = float(state_bytes)
        self.used_bytes = 0.0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match_blocks(self, hash_ids: Sequence[int], full_blocks: int) -> int:
        """Number of leading whole blocks usable as a prefix (blocks and checkpoint present)."""
        entries = self._entries
        usable = 0
        for index in range(full_blocks):
            block = hash_ids[index]
            if block not in entries:
                break
            if ~block in entries:
                usable = index + 1
        return usable

    def touch(self, hash_ids: Sequence[int], blocks: int) -> None:
        """Mark a used prefix (its blocks and its checkpoint) as recently used."""
        if blocks <= 0:
            return
        entries = self._entries
        for index in range(blocks):
            if hash_ids[index] in entries:
                entries.move_to_end(hash_ids[index])
        if ~hash_ids[blocks - 1] in entries:
            entries.move_to_end(~hash_ids[blocks - 1])

    def store(self, hash_ids: Sequence[int], full_blocks: int) -> None:
        """Keep a prefill's whole blocks and a checkpoint at its last whole block."""
        if full_blocks <= 0 or self.capacity_bytes <= 0:
            return
        entries = self._entries
        block_bytes = self.block_bytes
        last = len(block_bytes) - 1
        for index in range(full_blocks):
            block = hash_ids[index]
            if block in entries:
                entries.move_to_end(block)
            else:
                size = block_bytes[min(index, last)]
                entries[block] = size
                self.used_bytes += size
        key = ~hash_ids[full_blocks - 1]
        if key in entries:
            entries.move_to_end(key)
        else:
            entries[key] = self.state_bytes
            self.used_bytes += self.state_bytes
        while self.used_bytes > self.capacity_bytes and entries:
            _, size = entries.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1

    def prefix_bytes(self, blocks: int) -> float:
        """Bytes that moving a usable prefix of ``blocks`` whole blocks to another cluster costs."""
        if blocks <= 0:
            return 0.0
        block_bytes = self.block_bytes
        last = len(block_bytes) - 1
        return sum(block_bytes[min(i, last)] for i in range(blocks)) + self.state_bytes


def prefix_block_bytes(
    prefix_bytes: Callable[[int], float], block_tokens: int, blocks: int
) -> list[float]:
    """What each of a prompt's first ``blocks`` whole blocks adds to a cached prefix, from a
    prefix's bytes by its length in tokens (a cache's ``block_bytes``)."""
    return [
        float(prefix_bytes((i + 1) * block_tokens) - prefix_bytes(i * block_tokens))
        for i in range(blocks)
    ]


def prefix_replay(
    prompts: Iterable[tuple[int, Sequence[int] | None]],
    cache: HybridPrefixCache,
    block_tokens: int,
) -> list[int]:
    """The uncached tokens of each prompt (``input_tokens``, ``hash_ids``), in arrival order,
    with one cache holding every prefix earlier prompts left: what a prefix-aware router
    finds when it sends each prompt where its prefix is (the simulator's router does).
    Prefills keep their whole blocks and a checkpoint at the last one, as an engine does; at
    least one token is always prefilled. A prompt without hash ids hits nothing."""
    out: list[int] = []
    for tokens, hash_ids in prompts:
        if not hash_ids:
            out.append(tokens)
            continue
        full = min(tokens // block_tokens, len(hash_ids))
        blocks = cache.match_blocks(hash_ids, full)
        cache.touch(hash_ids, blocks)
        out.append(tokens - min(blocks * block_tokens, tokens - 1))
        cache.store(hash_ids, full)
    return out
