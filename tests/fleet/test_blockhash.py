"""The router-side block hashes reproduce what real vLLM engines published for the same token
ids: the committed fixture (prompts run through tests/engines' real vLLM), and the shared
capture's first request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet import blockhash
from tests.fleet.captured import CapturedFrame

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0.32_block_hashes.json"


def fixture_prompts() -> list[dict[str, Any]]:
    return list(json.loads(FIXTURE.read_text())["prompts"])


def prompt_id(prompt: dict[str, Any]) -> str:
    return f"{prompt['algorithm']}-{len(prompt['token_ids'])}"


@pytest.mark.parametrize("prompt", fixture_prompts(), ids=prompt_id)
def test_hashes_match_what_vllm_published(prompt: dict[str, Any]) -> None:
    token_ids = list(prompt["token_ids"])
    published = prompt["published_block_hashes"]
    block_size = int(prompt["block_size"])
    keys = blockhash.block_keys(token_ids, block_size, algorithm=str(prompt["algorithm"]))
    assert keys[: len(published)] == published
    assert len(keys) == len(token_ids) // block_size


def test_at_least_three_prompts_and_both_algorithms_are_covered() -> None:
    prompts = fixture_prompts()
    assert len({p["algorithm"] for p in prompts}) == 2
    assert sum(p["algorithm"] == "sha256" for p in prompts) >= 3


def test_the_shared_capture_matches_too(captured_frames: list[CapturedFrame]) -> None:
    first = next(f for f in captured_frames if f.section == "A")
    event = first.decoded[1][0]
    assert blockhash.block_keys(event["token_ids"], 32) == event["block_hashes"]
    digests = blockhash.block_hashes(event["token_ids"], 32)
    by_digest = next(f for f in captured_frames if f.section == "D").decoded_hashes()
    assert digests == by_digest


def test_lora_and_salt_change_every_hash_and_only_full_blocks_are_hashed() -> None:
    tokens = list(range(100))
    plain = blockhash.block_keys(tokens, 32)
    lora = blockhash.block_keys(tokens, 32, lora_name="adapter", lora_path="/a")
    salted = blockhash.block_keys(tokens, 32, cache_salt="tenant-1")
    assert len(plain) == 3
    assert not set(plain) & set(lora)
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # the salt is in block 0
    assert blockhash.block_keys(tokens[:31], 32) == []


def test_unreproducible_algorithms_are_refused_by_name() -> None:
    with pytest.raises(blockhash.BlockHashAlgorithmError, match=r"xxhash.*sha256, sha256_cbor"):
        blockhash.block_keys([1] * 32, 32, algorithm="xxhash")
