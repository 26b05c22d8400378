"""Decoding vLLM's KV-event payloads into the engine-neutral events, checked on the frames a
real vLLM 0.32 published (``tests/fixtures/vllm-0.32-cpu``): int and digest hashes, map events,
the older array events, all-map batches, errors that name the part at fault, and the encoder
the emulated engines and the agent's uplink write vLLM's shape with."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent
from tests.fleet.captured import CapturedFrame

FIELDS = {
    "BlockStored": kv_vllm.BlockStored.__struct_fields__,
    "BlockRemoved": kv_vllm.BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}


def _bytes(value: Any) -> Any:
    """The capture's JSON writes bytes as {"__bytes_hex__": ...}."""
    if isinstance(value, dict) and "__bytes_hex__" in value:
        return bytes.fromhex(value["__bytes_hex__"])
    if isinstance(value, list):
        return [_bytes(v) for v in value]
    return value


def as_neutral(event: dict[str, Any]) -> KvEvent:
    """What the capture's decoding of a vLLM event means, in the neutral terms."""
    kind = event.get("kv_cache_spec_kind")
    if event["type"] == "BlockStored":
        return BlocksStored(
            _bytes(event["block_hashes"]),
            event.get("block_size", 0),
            kind is not None and kind not in kv_vllm.FULL_ATTENTION_KINDS,
            event.get("medium"),
            event.get("group_idx"),
            _bytes(event.get("parent_block_hash")),
        )
    if event["type"] == "BlockRemoved":
        return BlocksRemoved(
            _bytes(event["block_hashes"]), event.get("medium"), event.get("group_idx")
        )
    return CacheCleared()


def test_every_captured_frame_decodes_to_what_the_capture_says(
    captured_frames: list[CapturedFrame],
) -> None:
    assert len(captured_frames) >= 8
    for frame in captured_frames:
        batch = kv_vllm.batch_decode(frame.payload)
        ts, events, rank = frame.decoded
        assert (batch.ts, batch.rank) == (ts, rank)
        assert list(batch.events) == [as_neutral(e) for e in events]
        assert frame.topic == b"kv-events"


def test_int_and_digest_encodings_carry_the_same_block_keys(
    captured_frames: list[CapturedFrame],
) -> None:
    by = {f.section: kv_vllm.batch_decode(f.payload) for f in captured_frames}
    ints = by["A"].events[0]
    digests = by["D"].events[0]
    assert isinstance(ints, BlocksStored) and isinstance(digests, BlocksStored)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in digests.hashes)
    folded = [int.from_bytes(h[-8:], "big") for h in digests.hashes]  # type: ignore[index]
    assert folded == list(ints.hashes)
    assert max(h for h in ints.hashes if isinstance(h, int)) > 1 << 63  # above int64


def test_the_encoder_writes_vllm_s_shape_and_reads_back_the_same_events(
    captured_frames: list[CapturedFrame],
) -> None:
    for frame in captured_frames:
        batch = kv_vllm.batch_decode(frame.payload)
        payload = kv_vllm.batch_encode(batch.events, batch.ts, batch.rank)
        assert kv_vllm.batch_decode(payload) == batch
        payload_ts, events, *_ = msgspec.msgpack.decode(payload)  # vLLM 0.32: an array batch
        assert payload_ts == batch.ts
        for event, real in zip(events, frame.decoded[1], strict=True):
            # map events under "type", vLLM's required fields always there
            assert event["type"] == real["type"]
            required = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}[real["type"]]
            assert set(FIELDS[real["type"]][:required]) <= set(event)
    # A frame that carries nothing the neutral events drop (no token ids: a removal) comes
    # out byte for byte.
    plain = [f for f in captured_frames if all(not e.get("token_ids") for e in f.decoded[1])]
    assert plain
    for frame in plain:
        batch = kv_vllm.batch_decode(frame.payload)
        assert kv_vllm.batch_encode(batch.events, batch.ts, batch.rank) == frame.payload


def _array_form(event: dict[str, Any]) -> list[object]:
    names = FIELDS[event["type"]]
    values = [_bytes(event.get(n)) for n in names]
    while values and values[-1] is None:  # omit trailing defaults, as msgspec does
        values.pop()
    return [event["type"], *values]


def test_older_array_events_and_all_map_batches_decode_the_same(
    captured_frames: list[CapturedFrame],
) -> None:
    for frame in captured_frames:
        real = kv_vllm.batch_decode(frame.payload)
        ts, events, _ = frame.decoded
        array_form = msgspec.msgpack.encode([ts, [_array_form(e) for e in events]])
        map_events = [{k: _bytes(v) for k, v in e.items()} for e in events]
        map_form = msgspec.msgpack.encode({"ts": ts, "events": map_events})
        for payload in (array_form, map_form):
            assert kv_vllm.batch_decode(payload).events == real.events


def test_json_shaped_batches_take_hex_digests() -> None:
    digest = "ab" * 24 + f"{2:016x}"
    batch = kv_vllm.batch_convert([1.0, [["BlockStored", [1, digest], None, [], 16]]])
    event = batch.events[0]
    assert isinstance(event, BlocksStored)
    assert list(event.hashes) == [1, bytes.fromhex(digest)] and event.block_size == 16


def test_unknown_event_types_from_newer_engines_are_skipped() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockPromoted", "block_hashes": [1]}, {"type": "AllBlocksCleared"}]]
    )
    assert kv_vllm.batch_decode(payload).events == [CacheCleared()]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "batch: not msgpack"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", "x"]]]), "events[0].block_hashes"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "events[0]"),
        (msgspec.msgpack.encode(["now", []]), "batch.ts"),
        (msgspec.msgpack.encode([1.0, [42]]), "events[0]"),
        (
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "token_ids": [1, 2],
                            "block_size": 32,
                        }
                    ],
                ]
            ),
            "token_ids: 2 tokens for 1 blocks of 32",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 5]}]]),
            "8 or 32 bytes",
        ),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "extra_keys": [None]}]]
            ),
            "extra_keys: 1 entries for 2 blocks",
        ),
    ],
)
def test_malformed_payloads_are_refused_naming_the_part(payload: bytes, message: str) -> None:
    with pytest.raises(
        kv_vllm.KvEventFormatError, match=message.replace("[", r"\[").replace("]", r"\]")
    ):
        kv_vllm.batch_decode(payload)
