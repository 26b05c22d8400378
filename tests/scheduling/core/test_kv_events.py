"""Decoding vLLM's KV-event payloads, checked on the frames a real vLLM 0.32 published
(``tests/fixtures/vllm-0.32-cpu``): int and digest hashes, map events, the older array events,
all-map batches, and errors that name the part at fault."""

from __future__ import annotations

import msgspec
import pytest

from scheduling.core import kv_events as wire
from tests.fleet.captured import CapturedFrame

FIELDS = {
    "BlockStored": wire.BlockStored.__struct_fields__,
    "BlockRemoved": wire.BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}


def as_capture(ev: wire.KvEvent) -> dict[str, object]:
    """An event as the capture's JSON decoding writes it (bytes as {"__bytes_hex__"})."""
    out: dict[str, object] = {"type": type(ev).__name__}
    for name in FIELDS[type(ev).__name__]:
        value = getattr(ev, name)
        if name in ("block_hashes",):
            value = [{"__bytes_hex__": h.hex()} if isinstance(h, bytes) else h for h in value]
        if name == "parent_block_hash" and isinstance(value, bytes):
            value = {"__bytes_hex__": value.hex()}
        out[name] = value
    return out


def test_every_captured_frame_decodes_to_what_the_capture_says(
    captured_frames: list[CapturedFrame],
) -> None:
    assert len(captured_frames) >= 8
    for frame in captured_frames:
        batch = wire.batch_decode(frame.payload)
        ts, events, rank = frame.decoded
        assert (batch.ts, batch.data_parallel_rank) == (ts, rank)
        assert len(batch.events) == len(events)
        for got, want in zip(batch.events, events, strict=True):
            mine = as_capture(got)
            assert {k: v for k, v in mine.items() if k in want} == want
        assert frame.topic == b"kv-events"


def test_int_and_digest_encodings_carry_the_same_block_keys(
    captured_frames: list[CapturedFrame],
) -> None:
    by = {f.section: wire.batch_decode(f.payload) for f in captured_frames}
    ints = by["A"].events[0]
    digests = by["D"].events[0]
    assert isinstance(ints, wire.BlockStored) and isinstance(digests, wire.BlockStored)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in digests.block_hashes)
    folded = [int.from_bytes(h[-8:], "big") for h in digests.block_hashes]  # type: ignore[index]
    assert folded == ints.block_hashes
    assert max(h for h in ints.block_hashes if isinstance(h, int)) > 1 << 63  # above int64
    assert ints.token_ids == digests.token_ids


def test_the_emulator_encoder_writes_vllm_bytes_exactly(
    captured_frames: list[CapturedFrame],
) -> None:
    for frame in captured_frames:
        batch = wire.batch_decode(frame.payload)
        assert wire.batch_encode(batch.events, batch.ts, batch.data_parallel_rank) == frame.payload


def _array_form(ev: wire.KvEvent) -> list[object]:
    names = FIELDS[type(ev).__name__]
    values = [getattr(ev, n) for n in names]
    while values and values[-1] is None:  # omit trailing defaults, as msgspec does
        values.pop()
    return [type(ev).__name__, *values]


def test_older_array_events_and_all_map_batches_decode_the_same(
    captured_frames: list[CapturedFrame],
) -> None:
    for frame in captured_frames:
        real = wire.batch_decode(frame.payload)
        array_form = msgspec.msgpack.encode([real.ts, [_array_form(e) for e in real.events]])
        map_form = msgspec.msgpack.encode(
            {
                "ts": real.ts,
                "events": [msgspec.to_builtins(e, builtin_types=(bytes,)) for e in real.events],
            }
        )
        for payload in (array_form, map_form):
            assert wire.batch_decode(payload).events == real.events


def test_json_shaped_batches_take_hex_digests() -> None:
    digest = "ab" * 24 + f"{2:016x}"
    batch = wire.batch_convert([1.0, [["BlockStored", [1, digest], None, [], 16]]])
    event = batch.events[0]
    assert isinstance(event, wire.BlockStored)
    assert event.block_hashes == [1, bytes.fromhex(digest)] and event.block_size == 16


def test_unknown_event_types_from_newer_engines_are_skipped() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockPromoted", "block_hashes": [1]}, {"type": "AllBlocksCleared"}]]
    )
    assert wire.batch_decode(payload).events == [wire.AllBlocksCleared()]


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
        wire.KvEventFormatError, match=message.replace("[", r"\[").replace("]", r"\]")
    ):
        wire.batch_decode(payload)
