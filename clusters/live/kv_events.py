"""KV-event batches into prefix-index operations, checked against the served model.

Decoding is the engine's decoder into the neutral events of :mod:`scheduling.core.kv_events`
(vLLM's, :mod:`scheduling.core.kv_vllm`: msgpack payloads as engines publish them, or the
JSON-shaped objects of ``POST /kv-events``); this module maps the neutral events to
:mod:`clusters.live.prefix_index` operations:

- ``BlocksStored`` -> :class:`StoredBlocks` of the event's KV group, kind (full blocks or
  linear-state checkpoints) and medium;
- ``BlocksRemoved`` -> :class:`RemovedBlocks` of that group and medium;
- ``CacheCleared`` -> :class:`AllCleared`.

An event whose ``block_size`` differs from the model profile's ``block_tokens`` is refused
(:class:`KvBlockSizeError`): its hashes cover other token spans than ``/route`` callers hash,
and counting its blocks at the profile's size would mis-state every cached length.
"""

from __future__ import annotations

import array
import sys

from clusters.live.prefix_index import AllCleared, KvEvent, RemovedBlocks, StoredBlocks
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksRemoved, BlocksStored, EventBatch, KvEventFormatError

_U64 = (1 << 64) - 1

__all__ = ["KvBlockSizeError", "KvEventFormatError", "index_events", "payload_events"]


class KvBlockSizeError(ValueError):
    """A batch whose blocks are not the served model's block size (message names both)."""


def _key(h: int | bytes) -> bytes:
    """The index's packed 8-byte key of a hash (an int's low 64 bits, a digest's last 8)."""
    if isinstance(h, int):
        return (h & _U64).to_bytes(8, "big")
    return h[-8:]


def _keys(hashes: list[int | bytes]) -> bytes:
    """The packed keys of an event's hashes; uint64 ints (vLLM's default) in one C call."""
    try:
        packed = array.array("Q", hashes)  # type: ignore[type-var]
    except (TypeError, OverflowError):  # digests, or negative ints (older builtin hashes)
        return b"".join(map(_key, hashes))
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def index_events(
    batch: EventBatch, block_tokens: int, model: str, path: str = "batch"
) -> list[KvEvent]:
    """The index operations of one decoded batch, in order. Consecutive events of one kind,
    group and medium become one operation (vLLM sends a ``BlockRemoved`` per evicted block):
    the same effect, a fraction of the work."""
    out: list[KvEvent] = []
    run: list[int | bytes] = []
    run_op = ""  # "S" (stored), "R" (removed) or "" (none open)
    run_linear = False
    run_medium: str | None = None
    run_group: int | None = None

    def flush() -> None:
        if run_op == "S":
            out.append(StoredBlocks(_keys(run), run_linear, run_medium, run_group))
        elif run_op == "R":
            out.append(RemovedBlocks(_keys(run), run_medium, run_group))
        run.clear()

    for i, ev in enumerate(batch.events):
        if isinstance(ev, BlocksRemoved):
            if not (run_op == "R" and ev.medium == run_medium and ev.group == run_group):
                flush()
                run_op, run_medium, run_group = "R", ev.medium, ev.group
            run.extend(ev.hashes)
        elif isinstance(ev, BlocksStored):
            if ev.block_size and ev.block_size != block_tokens:
                raise KvBlockSizeError(
                    f"{path}.events[{i}].block_size: the engine caches blocks of "
                    f"{ev.block_size} tokens but model {model!r} is profiled with block_tokens "
                    f"{block_tokens}; start the engine with --block-size {block_tokens} or fix "
                    "the model profile"
                )
            if not (
                run_op == "S"
                and ev.linear == run_linear
                and ev.medium == run_medium
                and ev.group == run_group
            ):
                flush()
                run_op, run_linear, run_medium, run_group = "S", ev.linear, ev.medium, ev.group
            run.extend(ev.hashes)
        else:
            flush()
            run_op = ""
            out.append(AllCleared())
    flush()
    return out


def payload_events(
    payload: bytes | object, block_tokens: int, model: str, path: str = "batch"
) -> list[KvEvent]:
    """Decode one batch (msgpack bytes, or a JSON-parsed object) into index operations."""
    if isinstance(payload, bytes | bytearray | memoryview):
        batch = kv_vllm.batch_decode(bytes(payload), path)
    else:
        batch = kv_vllm.batch_convert(payload, path)
    return index_events(batch, block_tokens, model, path)
