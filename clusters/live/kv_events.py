"""Decoding vLLM KV-cache event batches (``../shared/samples/vllm-kv-events.md``).

Agents forward each ZMQ message ``[topic, seq, payload]`` as JSON. vLLM's msgspec payload
comes in two encodings, and both are accepted:

- **array** (``array_like=True``): batch ``[ts, events, dp_rank?]``, each event
  ``[tag, field, ...]`` with the fields in declaration order, trailing defaults omitted;
- **map**: batch ``{"ts", "events", "data_parallel_rank"?}``, each event
  ``{"type": tag, "block_hashes": ..., ...}``.

Events: ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window),
``BlockRemoved`` (block_hashes, medium, group_idx), ``AllBlocksCleared``. A ``BlockStored``
whose ``kv_cache_spec_kind`` names a non-full-attention group (mamba, linear, sliding
window) stores linear-state checkpoints. Unknown event tags are skipped (newer engines), a
known event with a wrong shape is an error naming its path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clusters.live.prefix_index import (
    AllCleared,
    BlockHashError,
    KvEvent,
    RemovedBlocks,
    StoredBlocks,
    block_hash_key,
)

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
FULL_ATTENTION_KINDS = frozenset({"full_attention", "full", "mla", "mla_attention"})


class KvEventFormatError(ValueError):
    """A batch or event that is not vLLM's shape; the message starts with its path."""


def _fields(event: Any, names: Sequence[str], path: str) -> dict[str, Any]:
    if isinstance(event, Mapping):
        return {k: event.get(k) for k in names}
    values = list(event[1:])
    if len(values) > len(names):
        raise KvEventFormatError(f"{path}: {len(values)} fields, at most {len(names)} expected")
    return dict(zip(names, values + [None] * (len(names) - len(values)), strict=True))


def _hashes(value: Any, path: str) -> list[str]:
    if not isinstance(value, list):
        raise KvEventFormatError(f"{path}.block_hashes: must be a list")
    out = []
    for i, h in enumerate(value):
        try:
            out.append(block_hash_key(h))
        except BlockHashError as exc:
            raise KvEventFormatError(f"{path}.block_hashes[{i}]: {exc}") from None
    return out


def kv_event_decode(event: Any, path: str) -> KvEvent | None:
    """One event in either encoding; None for an event type this version does not know."""
    if isinstance(event, Mapping):
        tag = event.get("type")
    elif isinstance(event, list) and event:
        tag = event[0]
    else:
        raise KvEventFormatError(f"{path}: an event is a [tag, ...] list or a {{type: ...}} map")
    if not isinstance(tag, str):
        raise KvEventFormatError(f"{path}: the event tag must be a string")
    if tag == "BlockStored":
        f = _fields(event, STORED_FIELDS, path)
        kind = f.get("kv_cache_spec_kind")
        if kind is not None and not isinstance(kind, str):
            raise KvEventFormatError(f"{path}.kv_cache_spec_kind: must be a string or null")
        linear = kind is not None and kind.lower() not in FULL_ATTENTION_KINDS
        return StoredBlocks(tuple(_hashes(f["block_hashes"], path)), linear=linear)
    if tag == "BlockRemoved":
        f = _fields(event, REMOVED_FIELDS, path)
        return RemovedBlocks(tuple(_hashes(f["block_hashes"], path)))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None


def kv_batch_decode(batch: Any, path: str = "batch") -> tuple[float | None, list[KvEvent]]:
    """``(ts, events)`` of one batch in either encoding."""
    if isinstance(batch, Mapping):
        ts, events = batch.get("ts"), batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
    else:
        raise KvEventFormatError(
            f"{path}: a batch is [ts, events] (array encoding) or {{ts, events}} (map encoding)"
        )
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
        raise KvEventFormatError(f"{path}.ts: must be a number (unix seconds)")
    if not isinstance(events, list):
        raise KvEventFormatError(f"{path}.events: must be a list")
    out: list[KvEvent] = []
    for i, ev in enumerate(events):
        decoded = kv_event_decode(ev, f"{path}.events[{i}]")
        if decoded is not None:
            out.append(decoded)
    return (float(ts) if ts is not None else None), out
