"""vLLM's KV-cache event wire format: the decoder into the engine-neutral events of
:mod:`scheduling.core.kv_events`, and the encoder from them.

Contract: :func:`batch_decode` turns one ZMQ payload (the third frame) into a neutral
:class:`~scheduling.core.kv_events.EventBatch`, or raises :class:`KvEventFormatError` whose
message starts with the path of the offending part. :func:`batch_convert` does the same for an
already parsed object (the JSON API). :func:`batch_encode` writes neutral events exactly as
vLLM 0.32 publishes them: the emulated engines, and the agent's uplink (the control plane's
``/kv-events/msgpack`` reads vLLM's format, whatever engine the agent sits beside). One decoder
for real and emulated engines.

Encodings seen (``tests/fixtures/vllm-0.32-cpu/captured-kv-events.txt``, and the format note):

- vLLM 0.32: batch **array** ``[ts, events, data_parallel_rank]``, events **maps** tagged by
  ``"type"``, defaults omitted (the real capture);
- vLLM ~0.9-0.11: batch array, events **arrays** ``[tag, field, ...]`` in declaration order,
  trailing defaults omitted;
- all-map: batch ``{"ts", "events", "data_parallel_rank"}`` with map events.

Each is a msgspec typed decoder, tried in that order (a decoder that does not fit fails fast).
Hashes are uint64 ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or the 32-byte
digest (``=0``). Fields added by later versions (``locality``, ``ownership``, ``session_id``,
...) are ignored; an event type this version does not know is skipped (a newer engine), a known
one with a wrong shape is an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from scheduling.core.kv_events import (
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EventBatch,
    KvEvent,
    KvEventFormatError,
)

#: ``kv_cache_spec_kind`` values of full-attention blocks; any other kind (sliding window,
#: Mamba, the other request-level states) is a linear-state checkpoint.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "full", "mla"})
#: What a linear-state checkpoint is written as (any kind outside the full ones reads back so):
#: the state of a hybrid model's linear-attention layers.
LINEAR_KIND = "mamba"


# --- events, map form (vLLM 0.32: tag under "type") ------------------------------------------


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


# --- events, array form (older vLLM: [tag, fields...]) -------------------------------------


class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch (vLLM's ``KVEventBatch``)."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchMapEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchArrayEvents(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _MapBatchMapEvents(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _MapBatchArrayEvents(msgspec.Struct, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


_SHAPES: tuple[type, ...] = (
    _ArrayBatchMapEvents,
    _ArrayBatchArrayEvents,
    _MapBatchMapEvents,
    _MapBatchArrayEvents,
)
_DECODERS: list[msgspec.msgpack.Decoder[Any]] = [
    msgspec.msgpack.Decoder(shape) for shape in _SHAPES
]
_ENCODER = msgspec.msgpack.Encoder()


_BASE: dict[type, type[VllmEvent]] = {
    _BlockStoredArray: BlockStored,
    _BlockRemovedArray: BlockRemoved,
    _AllBlocksClearedArray: AllBlocksCleared,
}


def _base(ev: Any) -> VllmEvent:
    """An array-form event as its one public type (consumers compare and match on those)."""
    base = _BASE.get(type(ev))
    if base is None:
        return ev
    return base(**{f: getattr(ev, f) for f in base.__struct_fields__})


def _batch(raw: Any) -> VllmBatch:
    events = raw.events
    if events and type(events[0]) in _BASE:
        events = [_base(ev) for ev in events]
    return VllmBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


def _neutral(ev: VllmEvent) -> KvEvent:
    if type(ev) is BlockRemoved:
        return BlocksRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    if type(ev) is BlockStored:
        kind = ev.kv_cache_spec_kind
        linear = kind is not None and kind.lower() not in FULL_ATTENTION_KINDS
        return BlocksStored(
            ev.block_hashes, ev.block_size, linear, ev.medium, ev.group_idx, ev.parent_block_hash
        )
    return CacheCleared()


def _checked(batch: VllmBatch, path: str, ints_checked: bool = False) -> EventBatch:
    """Rules the types do not say. ``ints_checked``: msgpack integers are 64-bit by format,
    so only hashes parsed from JSON (any size) need their range checked."""
    for i, ev in enumerate(batch.events):
        if isinstance(ev, BlockStored):
            if ev.block_size < 0:
                raise KvEventFormatError(f"{path}.events[{i}].block_size: must be positive")
            if (
                ev.token_ids
                and ev.block_size
                and len(ev.token_ids) != (len(ev.block_hashes) * ev.block_size)
            ):
                raise KvEventFormatError(
                    f"{path}.events[{i}].token_ids: {len(ev.token_ids)} tokens for "
                    f"{len(ev.block_hashes)} blocks of {ev.block_size}"
                )
            if ev.extra_keys is not None and len(ev.extra_keys) != len(ev.block_hashes):
                raise KvEventFormatError(
                    f"{path}.events[{i}].extra_keys: {len(ev.extra_keys)} entries for "
                    f"{len(ev.block_hashes)} blocks (one per block)"
                )
        if type(ev) is AllBlocksCleared:
            continue
        # one pass per hash; this runs for every block of the fleet, so it stays cheap
        for j, h in enumerate(ev.block_hashes):  # type: ignore[union-attr]
            if type(h) is int:
                if not ints_checked and not -(1 << 63) <= h < (1 << 64):
                    raise KvEventFormatError(
                        f"{path}.events[{i}].block_hashes[{j}]: does not fit in 64 bits"
                    )
            elif len(h) not in (8, 32):
                raise KvEventFormatError(
                    f"{path}.events[{i}].block_hashes[{j}]: a binary hash has 8 or 32 "
                    f"bytes, not {len(h)}"
                )
    events = [_neutral(ev) for ev in batch.events]
    return EventBatch(batch.ts, events, batch.data_parallel_rank)


def batch_decode(payload: bytes, path: str = "batch") -> EventBatch:
    """One msgpack payload, in any of the encodings above."""
    for decoder in _DECODERS:
        try:
            return _checked(_batch(decoder.decode(payload)), path, ints_checked=True)
        except msgspec.DecodeError:
            continue
    # An event type this version does not know (skipped), or a malformed batch: decode
    # loosely, then event by event, so the error names the part at fault.
    try:
        loose = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventFormatError(f"{path}: not msgpack ({exc})") from None
    return batch_convert(loose, path)


def _tag_of(event: Any) -> Any:
    if isinstance(event, dict):
        return event.get("type")
    if isinstance(event, list | tuple) and event:
        return event[0]
    return None


def _hex_hashes(event: dict[str, Any] | list[Any], path: str) -> Any:
    """JSON carries 32-byte digests (or 64-bit keys) as hex strings: make them bytes."""

    def conv(value: Any, where: str) -> Any:
        if isinstance(value, str):
            text = value.lower().removeprefix("0x")
            try:
                raw = bytes.fromhex(text)
            except ValueError:
                raise KvEventFormatError(f"{where}: not a hex string") from None
            if len(raw) not in (8, 32):
                raise KvEventFormatError(f"{where}: a hex hash has 16 or 64 digits")
            return raw
        return value

    if isinstance(event, dict):
        out = dict(event)
        if isinstance(out.get("block_hashes"), list):
            out["block_hashes"] = [
                conv(h, f"{path}.block_hashes[{i}]") for i, h in enumerate(out["block_hashes"])
            ]
        if "parent_block_hash" in out:
            out["parent_block_hash"] = conv(out["parent_block_hash"], f"{path}.parent_block_hash")
        return out
    if len(event) > 1 and isinstance(event[1], list):
        arr = list(event)
        arr[1] = [conv(h, f"{path}.block_hashes[{i}]") for i, h in enumerate(arr[1])]
        if event[0] == "BlockStored" and len(arr) > 2:
            arr[2] = conv(arr[2], f"{path}.parent_block_hash")
        return arr
    return event


_FIELDS = {
    "BlockStored": BlockStored.__struct_fields__,
    "BlockRemoved": BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}


def _located(message: str, where: str, tag: str, is_map: bool) -> str:
    """msgspec's ``... - at `$[1][0]``` as ``where.block_hashes[0]: ...`` (field names for the
    array form too, so the error names what is wrong)."""
    found = re.search(r" - at `\$(.*)`$", message)
    if not found:
        return f"{where}: {message}"
    text, rest = message[: found.start()], found.group(1)
    if not is_map:
        index = re.match(r"\[(\d+)\]", rest)
        fields = _FIELDS.get(tag, ())
        if index and 0 < int(index.group(1)) <= len(fields):
            rest = "." + fields[int(index.group(1)) - 1] + rest[index.end() :]
    return f"{where}{rest}: {text}"


def batch_convert(obj: Any, path: str = "batch") -> EventBatch:
    """A batch already parsed into Python objects (JSON), in either encoding."""
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise KvEventFormatError(
            f"{path}: a batch is [ts, events] (array encoding) or {{ts, events}} (map encoding)"
        )
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventFormatError(f"{path}.ts: must be a number (unix seconds)")
    if not isinstance(events, list):
        raise KvEventFormatError(f"{path}.events: must be a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KvEventFormatError(f"{path}.data_parallel_rank: must be an integer")
    out: list[VllmEvent] = []
    for i, ev in enumerate(events):
        where = f"{path}.events[{i}]"
        tag = _tag_of(ev)
        if not isinstance(ev, dict | list | tuple) or not isinstance(tag, str):
            raise KvEventFormatError(f"{where}: an event is a [tag, ...] list or a {{type}} map")
        if tag not in KNOWN_TAGS:
            continue
        shaped = _hex_hashes(ev if isinstance(ev, dict) else list(ev), where)
        try:
            out.append(
                _base(
                    msgspec.convert(shaped, type=_MapEvent if isinstance(ev, dict) else _ArrayEvent)
                )
            )
        except msgspec.ValidationError as exc:
            raise KvEventFormatError(_located(str(exc), where, tag, isinstance(ev, dict))) from None
    return _checked(VllmBatch(ts=float(ts), events=out, data_parallel_rank=rank), path)


class _WireBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    # vLLM 0.32's declaration: the first five fields have no default, so they are always sent
    # (``null`` included); the rest are omitted at their default.
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _wire(ev: KvEvent) -> Any:
    if isinstance(ev, BlocksStored):
        return _WireBlockStored(
            block_hashes=list(ev.hashes),
            parent_block_hash=ev.parent,
            token_ids=[],  # not carried: the index needs the hashes only
            block_size=ev.block_size,
            lora_id=None,
            medium=ev.medium,
            lora_name=None,
            group_idx=ev.group,
            kv_cache_spec_kind=LINEAR_KIND if ev.linear else None,
        )
    if isinstance(ev, BlocksRemoved):
        return _WireBlockRemoved(list(ev.hashes), ev.medium, ev.group)
    return AllBlocksCleared()


def batch_encode(events: Sequence[KvEvent], ts: float, data_parallel_rank: int | None = 0) -> bytes:
    """A payload exactly as vLLM 0.32 publishes it: array batch, map events, its required
    fields always present and the others omitted at their default (the emulated engines, the
    agent's uplink)."""
    return _ENCODER.encode(_WireBatch(ts, [_wire(ev) for ev in events], data_parallel_rank))
