"""What an emulated engine publishes: its prefix cache's stores and evictions, journaled as
they happen, turned into vLLM 0.32's KV events (msgpack batches numbered from 0 per engine
process, ``BlockStored`` runs per KV group, one ``BlockRemoved`` per evicted block) and handed to
the agent's own stream (:class:`fleet.agent.kv.KvStream`) with a replay buffer like vLLM's.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

from fleet.agent.kv import KvStream
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksRemoved, BlocksStored, KvEvent
from scheduling.core.prefix_cache import HybridPrefixCache

# Block hashes per published batch (a vLLM step publishes a few hundred at most).
MAX_HASHES_PER_BATCH = 2000
# Batches an emulated engine keeps for replay (vLLM's default buffer_steps).
REPLAY_BUFFER = 10_000
# KV groups as a hybrid vLLM model numbers them: full attention first, the linear state next.
FULL_GROUP, LINEAR_GROUP = 0, 1


class _Journal(OrderedDict[int, float]):
    """The entries of one cache, with a journal of keys stored and evicted since last read."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[bool, int]] = []  # (stored?, key)

    def __setitem__(self, key: int, value: float) -> None:
        if key not in self:
            self.events.append((True, key))
        super().__setitem__(key, value)

    def popitem(self, last: bool = True) -> tuple[int, float]:
        key, value = super().popitem(last=last)
        self.events.append((False, key))
        return key, value


class ReportingPrefixCache(HybridPrefixCache):
    """The simulator's hybrid prefix cache, journaling stores and evictions."""

    def __init__(
        self, capacity_bytes: float, block_bytes: Sequence[float], state_bytes: float
    ) -> None:
        super().__init__(capacity_bytes, block_bytes, state_bytes)
        self.journal = _Journal()
        self._entries = self.journal

    def take_events(self) -> list[tuple[bool, int]]:
        events = self.journal.events
        self.journal.events = []
        return events


def kv_batch_events(events: Sequence[tuple[bool, int]], block_tokens: int) -> list[KvEvent]:
    """A journal as vLLM 0.32 reports it: a stored run per run of stored blocks of one KV group
    (full attention, group 0; linear-state checkpoints, key ``~h`` for the state ending at
    block ``h``, group 1), and one removal per evicted block naming its group, in order. The
    emulator has no token ids, and the first block's parent is not given."""
    out: list[KvEvent] = []
    for (stored, linear), run in itertools.groupby(events, key=lambda e: (e[0], e[1] < 0)):
        hashes: list[int | bytes] = [(~key if linear else key) % (1 << 64) for _, key in run]
        group = LINEAR_GROUP if linear else FULL_GROUP
        if stored:
            out.append(BlocksStored(hashes, block_tokens, linear, medium="GPU", group=group))
        else:
            out.extend(BlocksRemoved([h], medium="GPU", group=group) for h in hashes)
    return out


class EmulatedEngineEvents:
    """One emulated engine's KV-event publisher: sequence numbers from 0 (a new process), the
    msgpack payloads vLLM sends, and its replay buffer; each frame goes to the agent stream."""

    def __init__(self, stream: KvStream) -> None:
        self.stream = stream
        self.seq = -1
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        stream.replay = self.replay

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        self.seq += 1
        payload = kv_vllm.batch_encode(events, ts)
        self.buffer.append((self.seq, payload))
        self.stream.frame_receive(b"kv-events", self.seq.to_bytes(8, "big"), payload)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.buffer if seq >= start]
