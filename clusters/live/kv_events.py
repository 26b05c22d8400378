"""vLLM KV-event batches into prefix-index operations, checked against the served model.

Decoding is :mod:`scheduling.core.kv_events` (the agent's decoder: msgpack payloads as engines publish
them, or the JSON-shaped objects of ``POST /kv-events``); this module maps the typed events to
:mod:`clusters.live.prefix_index` operations:

- ``BlockStored`` -> :class:`StoredBlocks` of the event's KV group (``group_idx``), kind
  (``kv_cache_spec_kind``: full attention and MLA are full blocks; sliding window, Mamba and
  the other request-level states are linear-state checkpoints) and ``medium``;
- ``BlockRemoved`` -> :class:`RemovedBlocks` of that group and medium;
- ``AllBlocksCleared`` -> :class:`AllCleared`.

An event whose ``block_size`` differs from the model profile's ``block_tokens`` is refused
(:class:`KvBlockSizeError`): its hashes cover other token spans than ``/route`` callers hash,
and counting its blocks at the profile's size would mis-state every cached length.
"""

from __future__ import annotations

import array
import sys

from clusters.live.prefix_index import AllCleared, KvEvent, RemovedBlocks, StoredBlocks
from scheduling.core import kv_events as wire
from scheduling.core.kv_events import KvEventFormatError

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "full", "mla"})
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
    batch: wire.EventBatch, block_tokens: int, model: str, path: str = "batch"
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
        if isinstance(ev, wire.BlockRemoved):
            if not (run_op == "R" and ev.medium == run_medium and ev.group_idx == run_group):
                flush()
                run_op, run_medium, run_group = "R", ev.medium, ev.group_idx
            run.extend(ev.block_hashes)
        elif isinstance(ev, wire.BlockStored):
            if ev.block_size and ev.block_size != block_tokens:
                raise KvBlockSizeError(
                    f"{path}.events[{i}].block_size: the engine caches blocks of "
                    f"{ev.block_size} tokens but model {model!r} is profiled with block_tokens "
                    f"{block_tokens}; start the engine with --block-size {block_tokens} or fix "
                    "the model profile"
                )
            kind = ev.kv_cache_spec_kind
            linear = kind is not None and kind.lower() not in FULL_ATTENTION_KINDS
            if not (
                run_op == "S"
                and linear == run_linear
                and ev.medium == run_medium
                and ev.group_idx == run_group
            ):
                flush()
                run_op, run_linear, run_medium, run_group = "S", linear, ev.medium, ev.group_idx
            run.extend(ev.block_hashes)
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
        batch = wire.batch_decode(bytes(payload), path)
    else:
        batch = wire.batch_convert(payload, path)
    return index_events(batch, block_tokens, model, path)
