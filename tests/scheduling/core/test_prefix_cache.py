"""The hybrid prefix cache, and a trace replayed through one: the uncached lengths the planner
plans a trace from."""

from __future__ import annotations

from scheduling.core.prefix_cache import HybridPrefixCache, prefix_block_bytes, prefix_replay

BLOCK_BYTES = [100.0] * 16


def test_a_prefix_is_usable_only_up_to_a_linear_state_checkpoint() -> None:
    cache = HybridPrefixCache(10_000, BLOCK_BYTES, state_bytes=50)
    cache.store((1, 2, 3, 4), 4)  # blocks 1-4 and a checkpoint after block 4
    assert cache.match_blocks((1, 2, 3, 4, 5, 6), 6) == 4
    # Same first two blocks but a different third: the blocks match partially, yet no
    # checkpoint sits at exactly two blocks, so nothing is usable.
    assert cache.match_blocks((1, 2, 9, 10), 4) == 0
    cache.store((1, 2), 2)
    assert cache.match_blocks((1, 2, 9, 10), 4) == 2


def test_a_checkpoint_without_its_blocks_is_not_a_hit() -> None:
    cache = HybridPrefixCache(450, BLOCK_BYTES, state_bytes=50)
    cache.store((1, 2, 3, 4), 4)  # 400 + 50 bytes: full
    cache.store((7,), 1)  # 150 more: the oldest entries (blocks 1, 2) are evicted
    assert cache.evictions >= 1
    assert cache.used_bytes <= 450
    assert cache.match_blocks((1, 2, 3, 4), 4) == 0
    assert cache.match_blocks((7,), 1) == 1


def test_least_recently_used_entries_are_evicted_first() -> None:
    cache = HybridPrefixCache(3 * 150, BLOCK_BYTES, state_bytes=50)
    cache.store((1,), 1)
    cache.store((2,), 1)
    cache.store((3,), 1)
    cache.touch((1,), 1)
    cache.store((4,), 1)  # evicts prefix 2, the least recently used
    assert cache.match_blocks((1,), 1) == 1
    assert cache.match_blocks((2,), 1) == 0
    assert cache.match_blocks((3,), 1) == 1


def test_a_zero_capacity_cache_holds_nothing() -> None:
    cache = HybridPrefixCache(0, BLOCK_BYTES, state_bytes=50)
    cache.store((1, 2), 2)
    assert len(cache) == 0


def test_a_conversation_turn_reuses_the_prefix_its_last_turn_left() -> None:
    cache = HybridPrefixCache(10_000, BLOCK_BYTES, state_bytes=50)
    first = (1000, (1, 2))  # 1,000 tokens: two blocks of 512, one of them whole
    second = (1600, (1, 2, 3, 4))  # the next turn: the first turn's prompt and more
    assert prefix_replay([first, second], cache, 512) == [1000, 1600 - 512]


def test_a_replay_follows_the_checkpoint_rule_not_every_block_seen() -> None:
    cache = HybridPrefixCache(10_000, BLOCK_BYTES, state_bytes=50)
    # The second prompt shares two blocks with the first, but the first checkpointed after
    # three: no checkpoint at two blocks, so nothing is reusable.
    got = prefix_replay([(3 * 512, (1, 2, 3)), (4 * 512, (1, 2, 9, 10))], cache, 512)
    assert got == [3 * 512, 4 * 512]


def test_a_replayed_prompt_always_prefills_at_least_one_token() -> None:
    cache = HybridPrefixCache(10_000, BLOCK_BYTES, state_bytes=50)
    got = prefix_replay([(1024, (1, 2)), (1024, (1, 2)), (700, None)], cache, 512)
    assert got == [1024, 1, 700]


def test_a_small_cache_forgets_what_a_large_one_reuses() -> None:
    prompts = [(512, (k,)) for k in range(4)] * 2
    small = prefix_replay(prompts, HybridPrefixCache(2 * 150, BLOCK_BYTES, 50), 512)
    large = prefix_replay(prompts, HybridPrefixCache(8 * 150, BLOCK_BYTES, 50), 512)
    assert sum(small) == 8 * 512
    assert sum(large) == 4 * 512 + 4 * 1


def test_block_bytes_are_what_each_block_adds_to_a_prefix() -> None:
    assert prefix_block_bytes(lambda tokens: 10.0 * tokens + (5 if tokens else 0), 4, 3) == [
        45.0,
        40.0,
        40.0,
    ]
