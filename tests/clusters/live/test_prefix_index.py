"""The global prefix index against real Redis: matches, caps, gaps, clears, hash folding."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence

import pytest
import redis

from clusters.live import prefix_index as px
from clusters.live.prefix_index import AllCleared, KvEvent, RemovedBlocks, StoredBlocks
from controlplane.redis_connection import redis_async
from controlplane.redis_scripts import pipeline_run


def chain(n: int, start: int = 1) -> list[str]:
    return [px.block_hash_key(start + i) for i in range(n)]


def test_int_and_digest_encodings_fold_to_the_same_key() -> None:
    digest = bytes(range(24)) + (1234).to_bytes(8, "big")
    assert px.block_hash_key(digest) == px.block_hash_key(1234)
    assert px.block_hash_key(digest.hex()) == px.block_hash_key(1234)
    assert px.block_hash_key(-1) == "ffffffffffffffff"


@pytest.mark.parametrize("bad", ["xyz", "12", 1 << 64, -(1 << 63) - 1, True, 1.5])
def test_malformed_block_hashes_are_refused(bad: object) -> None:
    with pytest.raises(px.BlockHashError):
        px.block_hash_key(bad)  # type: ignore[arg-type]


def test_longest_prefix_per_instance_and_cluster(redis_client: redis.Redis) -> None:
    c = chain(6)
    px.kv_batch_apply("a", 0, [StoredBlocks(c[:4])])
    px.kv_batch_apply("b", 0, [StoredBlocks(c[:2] + c[3:5])])  # hole at block 2
    match = px.prefix_match(c, block_size=16)
    assert match.tokens_by_instance == {"a": 64, "b": 32}
    assert match.by_cluster({"a": "pd", "b": "prfaas"}) == {"pd": 64, "prfaas": 32}


def test_hybrid_models_use_only_exact_linear_checkpoints(redis_client: redis.Redis) -> None:
    c = chain(6)
    px.kv_batch_apply("a", 0, [StoredBlocks(c[:5]), StoredBlocks([c[2]], linear=True)])
    px.kv_batch_apply("b", 0, [StoredBlocks(c[:4])])  # reports no checkpoints at all
    match = px.prefix_match(c, block_size=10, hybrid=True)
    assert match.tokens_by_instance == {"a": 30, "b": 40}


def test_removed_and_cleared_blocks_stop_matching(redis_client: redis.Redis) -> None:
    c = chain(4)
    px.kv_batch_apply("a", 0, [StoredBlocks(c)])
    px.kv_batch_apply("a", 1, [RemovedBlocks([c[2]])])
    assert px.prefix_match(c, 1).tokens_by_instance == {"a": 2}
    px.kv_batch_apply("a", 2, [AllCleared()])
    assert px.prefix_match(c, 1).tokens_by_instance == {}


def test_memory_is_capped_per_instance_by_evicting_oldest(redis_client: redis.Redis) -> None:
    c = chain(10)
    result = px.kv_batch_apply("a", 0, [StoredBlocks(c)], cap=4)
    assert result.evicted == 6
    assert px.prefix_index_states(["a"])[0].blocks == 4
    assert px.prefix_match(c, 1).tokens_by_instance == {}  # the oldest, c[0], is gone
    assert px.prefix_match(c[6:], 1).tokens_by_instance == {"a": 4}


def test_an_old_epoch_is_evicted_at_the_pace_of_the_stores_that_follow(
    redis_client: redis.Redis,
) -> None:
    # Cap 2,048: epochs of 128 stores. Store 2,049 opens epoch 16, and epoch 0 is to go.
    cap = 16 * 128
    c = chain(cap + 128)
    px.kv_batch_apply("a", 0, [StoredBlocks(c[:cap])], cap=cap)
    first = px.kv_batch_apply("a", 1, [StoredBlocks(c[cap : cap + 1])], cap=cap)
    # One store does not pay for the whole epoch (that held Redis ~80 ms at the default cap)...
    assert 0 < first.evicted < 128
    rest = px.kv_batch_apply("a", 2, [StoredBlocks(c[cap + 1 :])], cap=cap)
    # ... and the stores that follow evict the rest of it: the index is back at the cap.
    assert first.evicted + rest.evicted == 128
    assert px.prefix_index_states(["a"])[0].blocks == cap
    assert px.prefix_match(c, 1).tokens_by_instance == {}  # c[0] went with epoch 0
    assert px.prefix_match(c[128:], 1).tokens_by_instance == {"a": cap}


def _apply_async(
    batches: Sequence[tuple[int | None, Sequence[KvEvent]]], share: float
) -> list[px.BatchResult]:
    async def run() -> list[px.BatchResult]:
        client = redis_async()
        try:
            return await px.kv_batches_apply_async("a", batches, client=client, redis_share=share)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_post_applied_at_a_share_of_redis_gives_the_same_index(redis_client: redis.Redis) -> None:
    # 50 batches of 16 blocks: four script calls of at most MAX_BLOCKS_PER_CALL, spaced out.
    c = chain(800)
    batches: list[tuple[int | None, Sequence[KvEvent]]] = [
        (k, [StoredBlocks(c[16 * k : 16 * (k + 1)])]) for k in range(50)
    ]
    results = _apply_async(batches, share=0.25)
    assert [r.status for r in results] == ["applied"] * 50
    assert px.prefix_match(c, 1).tokens_by_instance == {"a": 800}
    assert _apply_async(batches[-2:], share=0.25)[0].status == "duplicate"


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_of_redis_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="redis_share"):
        _apply_async([(0, [StoredBlocks(chain(1))])], share=share)


def test_the_cap_keeps_a_block_stored_again_since(redis_client: redis.Redis) -> None:
    c = chain(8)
    px.kv_batch_apply("a", 0, [StoredBlocks(c[:4])], cap=4)
    # c[0] is stored again (vLLM re-caches it after an eviction), then four newer blocks:
    # the cap evicts c[1..3] (stored earliest), never the re-stored c[0].
    px.kv_batch_apply("a", 1, [RemovedBlocks(c[:1]), StoredBlocks(c[:1])], cap=4)
    px.kv_batch_apply("a", 2, [StoredBlocks(c[5:8])], cap=4)
    assert px.prefix_index_states(["a"])[0].blocks == 4
    assert px.prefix_match(c[:1], 1).tokens_by_instance == {"a": 1}
    assert px.prefix_match(c[1:2], 1).tokens_by_instance == {}


def test_sequence_gap_marks_instance_degraded_until_cleared(redis_client: redis.Redis) -> None:
    c = chain(3)
    assert px.kv_batch_apply("a", 0, [StoredBlocks(c[:1])]).state == "exact"
    gap = px.kv_batch_apply("a", 4, [StoredBlocks(c[1:2])])
    assert (gap.gap, gap.state) == (3, "degraded")
    state = px.prefix_index_states(["a"])[0]
    assert (state.state, state.gaps, state.missed_batches, state.last_seq) == ("degraded", 1, 3, 4)
    assert px.prefix_match(c, 1).degraded == frozenset({"a"})
    assert px.kv_batch_apply("a", 5, [AllCleared()]).state == "exact"
    assert px.prefix_match(c, 1).degraded == frozenset()


def test_redelivered_batch_is_skipped(redis_client: redis.Redis) -> None:
    c = chain(2)
    px.kv_batch_apply("a", 0, [])
    px.kv_batch_apply("a", 1, [StoredBlocks(c[:1])])
    px.kv_batch_apply("a", 2, [RemovedBlocks(c[:1])])
    again = px.kv_batch_apply("a", 1, [StoredBlocks(c[:1])])
    assert again.status == "duplicate"
    assert px.prefix_match(c, 1).tokens_by_instance == {}


def test_engine_restart_resets_the_instance(redis_client: redis.Redis) -> None:
    c = chain(2)
    px.kv_batch_apply("a", 0, [StoredBlocks(c)])
    px.kv_batch_apply("a", 7, [])
    restart = px.kv_batch_apply("a", 0, [StoredBlocks(c[:1])])
    assert (restart.status, restart.state) == ("restart", "exact")
    assert px.prefix_match(c, 1).tokens_by_instance == {"a": 1}


def test_evicting_a_linear_checkpoint_keeps_the_full_attention_blocks(
    redis_client: redis.Redis,
) -> None:
    """The issue's 6 -> 0 case: blocks 1-6 in the full-attention group (0), checkpoints at 3
    and 6 in the linear group (1); BlockRemoved [h3] of the linear group leaves 6 matched."""
    c = chain(6)
    px.kv_batch_apply(
        "a",
        0,
        [
            StoredBlocks(c, group=0),
            StoredBlocks([c[2], c[5]], linear=True, group=1),
        ],
    )
    assert px.prefix_match(c, 1, hybrid=True).tokens_by_instance == {"a": 6}
    px.kv_batch_apply("a", 1, [RemovedBlocks([c[2]], group=1)])
    assert px.prefix_match(c, 1, hybrid=True).tokens_by_instance == {"a": 6}
    state = px.prefix_index_states(["a"])[0]
    assert (state.blocks, state.checkpoints) == (6, 1)
    # the full-attention group's eviction of h3 does cut the run, at block 2
    px.kv_batch_apply("a", 2, [RemovedBlocks([c[2]], group=0)])
    assert px.prefix_match(c, 1, hybrid=False).tokens_by_instance == {"a": 2}


def test_a_removal_without_a_group_removes_every_kind(redis_client: redis.Redis) -> None:
    c = chain(3)
    px.kv_batch_apply("a", 0, [StoredBlocks(c, group=0), StoredBlocks(c, linear=True, group=1)])
    px.kv_batch_apply("a", 1, [RemovedBlocks(c[1:])])
    state = px.prefix_index_states(["a"])[0]
    assert (state.blocks, state.checkpoints) == (1, 1)


def test_a_gpu_eviction_keeps_the_cpu_tier_copy(redis_client: redis.Redis) -> None:
    c = chain(4)
    px.kv_batch_apply("a", 0, [StoredBlocks(c, medium="GPU"), StoredBlocks(c[:2], medium="CPU")])
    px.kv_batch_apply("a", 1, [RemovedBlocks(c, medium="GPU")])
    assert px.prefix_match(c, 1).tokens_by_instance == {"a": 2}
    px.kv_batch_apply("a", 2, [RemovedBlocks(c[:2], medium="cpu")])
    assert px.prefix_match(c, 1).tokens_by_instance == {}
    assert px.prefix_index_states(["a"])[0].blocks == 0


def test_instances_sharing_blocks_are_matched_and_removed_apart(redis_client: redis.Redis) -> None:
    c = chain(5)
    for name in ("a", "b", "c"):
        px.kv_batch_apply(name, 0, [StoredBlocks(c)])
    px.kv_batch_apply("b", 1, [RemovedBlocks(c[3:])])
    px.kv_batch_apply("c", 1, [AllCleared()])
    assert px.prefix_match(c, 16).tokens_by_instance == {"a": 80, "b": 48}
    px.prefix_index_instance_reset("a")
    assert px.prefix_match(c, 16).tokens_by_instance == {"b": 48}


def test_the_pacer_runs_one_call_at_a_time_and_leaves_redis_the_rest() -> None:
    # Two posts applied at once by one process: their calls take turns, and after a call of
    # d seconds at a share of 1/3 the next one waits 2d (sleeps never end early).
    pacer = px.RedisPacer()
    spans: list[tuple[float, float]] = []

    async def post() -> None:
        for _ in range(3):
            async with pacer.turn(1 / 3):
                began = time.perf_counter()
                await asyncio.sleep(0.01)
                spans.append((began, time.perf_counter()))

    async def both() -> None:
        await asyncio.gather(post(), post())

    asyncio.run(both())
    spans.sort()
    assert len(spans) == 6
    for (began, ended), (start, _) in itertools.pairwise(spans):
        assert start >= ended  # never two at once
        assert start - ended >= 2 * (ended - began) * 0.999


def _walk(
    c: Sequence[str], full: dict[str, set[str]], linear: dict[str, set[str]], hybrid: bool
) -> dict[str, int]:
    """The match block by block, in Python: what the server-side walk must give."""
    alive, last, usable = set(full), {}, {}
    for depth, key in enumerate(c, start=1):
        alive = {inst for inst in alive if key in full[inst]}
        if not alive:
            break
        for inst in alive:
            last[inst] = depth
            if key in linear[inst]:
                usable[inst] = depth
    out = {}
    for inst, blocks in last.items():
        if hybrid and linear[inst]:
            blocks = usable.get(inst, 0)
        if blocks:
            out[inst] = blocks
    return out


@pytest.mark.parametrize("seed", range(6))
def test_matches_are_the_block_by_block_walk_whatever_the_holders(
    redis_client: redis.Redis, seed: int
) -> None:
    rng = random.Random(seed)
    c = chain(40)
    instances = ["a", "b", "c", "d"]
    full: dict[str, set[str]] = {inst: set() for inst in instances}
    linear: dict[str, set[str]] = {inst: set() for inst in instances}
    for inst in instances:
        stored = c[: rng.randint(0, 40)]
        holes = set(rng.sample(stored, k=min(len(stored), rng.randint(0, 3))))
        checkpoints = [k for k in stored if rng.random() < 0.2] if inst in "ab" else []
        events: list[KvEvent] = [StoredBlocks(stored[i : i + 7]) for i in range(0, len(stored), 7)]
        if checkpoints:
            events.append(StoredBlocks(checkpoints, linear=True))
        if holes:
            events.append(RemovedBlocks(sorted(holes), group=0))
        px.kv_batch_apply(inst, 0, events)
        full[inst] = set(stored) - holes
        linear[inst] = set(checkpoints)
    # Chains that diverge, stop early, or start elsewhere, in one call.
    chains = [c, c[:25], c[:10] + chain(5, start=1000), c[3:], c[:1]]
    for hybrid in (False, True):
        raw = pipeline_run(redis_client, lambda p: px.prefix_matches_queue(p, chains, hybrid))  # noqa: B023
        got = px.prefix_matches_parse(raw, len(chains), 1)
        assert [m.tokens_by_instance for m in got] == [
            _walk(one, full, linear, hybrid) for one in chains
        ]
