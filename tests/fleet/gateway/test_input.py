"""Client input the gateway must refuse or bear: prompts too long to hash, long prompts hashed
without holding the event loop, and bad OpenAI fields answered in OpenAI's error shape before
anything is decided, reserved or prefilled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from fleet.blockhash import block_keys
from fleet.gateway.app import (
    HASH_SLICE_BLOCKS,
    IDS_CHECKED_AT_ONCE,
    block_keys_async,
    ids_check_async,
)
from tests.fleet.gateway.conftest import PRFAAS, Stack

pytestmark = pytest.mark.timeout(300)


def post(stack: Stack, body: dict[str, Any], rid: str, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway}/v1/completions",
        json={"model": "tiny", **body},
        headers={"X-Request-Id": rid},
        timeout=timeout_s,
    )


def test_a_prompt_past_the_limit_is_refused_before_it_is_hashed(
    stack_factory: Callable[..., Stack],
) -> None:
    # Issue 30, finding 9: a 5M-token prompt spent 371 ms in block_keys and 100 ms parsing.
    stack = stack_factory(max_prompt_tokens=100_000)
    hashed = stack.gateway_metric("prfaas_gateway_step_seconds_count", step="hash")
    ids = post(stack, {"prompt": [7] * 100_001, "max_tokens": 2}, "long-ids")
    text = post(stack, {"prompt": "y" * 150_000, "max_tokens": 2}, "long-text")
    for got in (ids, text):
        assert got.status_code == 400, got.text
        error = got.json()["error"]
        assert error["code"] == "prompt_too_long" and error["param"] == "prompt"
        assert error["type"] == "invalid_request_error"
    assert stack.gateway_metric("prfaas_gateway_step_seconds_count", step="hash") == hashed
    assert stack.gateway_metric("prfaas_gateway_errors_total", kind="prompt_too_long") == 2


async def loop_turns_during(work: Awaitable[Any]) -> tuple[Any, int]:
    """``work``'s result, and how many times the event loop ran another task while it ran:
    a task that yields at once every turn counts them (no clock involved)."""
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    beside = asyncio.create_task(other())
    await asyncio.sleep(0)
    started = turns
    result = await work
    done = True
    await beside
    return result, turns - started


def test_a_long_prompt_is_checked_and_hashed_with_the_loop_free_between_slices() -> None:
    # Finding 9: a canary beside a 5M-token prompt waited up to 712 ms, held behind the id
    # check and the block hashing of the whole prompt in one go. Both now yield to the loop
    # between slices: every other task gets a turn after each slice of a 1M-token prompt.
    tokens = [i % 50_000 for i in range(1_000_000)]
    block_tokens = 16

    async def both() -> tuple[int, tuple[tuple[int, ...], int]]:
        _, checked = await loop_turns_during(ids_check_async(tokens))
        return checked, await loop_turns_during(block_keys_async(tokens, block_tokens))

    checked_turns, (keys, hashed_turns) = asyncio.run(both())
    assert checked_turns >= len(tokens) // IDS_CHECKED_AT_ONCE - 1
    assert hashed_turns >= len(tokens) // block_tokens // HASH_SLICE_BLOCKS - 1
    # Sliced, the chain is the same as hashed in one go.
    assert keys == tuple(block_keys(tokens, block_tokens))


def test_a_long_prompt_through_the_gateway_is_hashed_and_served(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(max_prompt_tokens=1_100_000, max_model_len=2_000_000)
    hashed = stack.gateway_metric("prfaas_gateway_step_seconds_count", step="hash")
    got = httpx.post(
        f"{stack.gateway}/v1/completions",
        content=orjson.dumps(
            {"model": "tiny", "prompt": [i % 10 for i in range(1_000_000)], "max_tokens": 2}
        ),
        headers={"X-Request-Id": "long-0", "Content-Type": "application/json"},
        timeout=120,
    )
    assert got.status_code == 200, got.text
    assert stack.gateway_metric("prfaas_gateway_step_seconds_count", step="hash") == hashed + 1


def test_bad_openai_fields_are_refused_before_anything_is_decided(
    stack_factory: Callable[..., Stack],
) -> None:
    # Finding 10: with decide: remote, max_tokens of -1, 10^12 or true gave a text/plain 500
    # and no outcome; with -1 the request was offloaded and prefilled before the decode
    # engine refused it, its KV left held at PrfaaS and its link bytes reserved.
    stack = stack_factory(decide="remote")
    long_prompt = list(range(1, 6000))  # above the threshold: it would be offloaded
    before = stack.engine_stats()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"n": 3}, "n"),
        ({"prompt": [1, -2, 3]}, "prompt"),
    ]
    for extra, param in cases:
        got = post(stack, {"prompt": long_prompt, "max_tokens": 4, **extra}, f"bad-{param}")
        assert got.status_code == 400, (extra, got.text)
        assert got.headers["content-type"] == "application/json"
        error = got.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert got.json()["detail"].startswith(param)
    after = stack.engine_stats()
    assert [s["requests"] for s in after.values()] == [s["requests"] for s in before.values()]
    live = httpx.get(
        f"{stack.control_plane}/api/v1/route/live",
        headers=stack.headers(stack.router_token),
        timeout=10,
    ).json()
    assert [lk["inflight_bytes"] for lk in live["links"]] == [0]

    # An 11M-token prompt (past the gateway's limit, and the control plane's) is a 400 too.
    huge = post(stack, {"prompt": "z" * 11_000, "max_tokens": 2}, "huge")
    assert huge.status_code in (200, 400)  # (11,000 bytes: within the limit, served)
    # An error after the decision is JSON in OpenAI's shape and has its outcome.
    for name in (f"{PRFAAS}-p0", f"{PRFAAS}-p1", "pd-g-p0", "pd-g-p1"):
        stack.fault(name, "error", 5)
    failed = post(stack, {"prompt": long_prompt, "max_tokens": 4}, "all-down")
    assert failed.status_code == 502 and failed.json()["error"]["type"] == "server_error"
    outcome = stack.outcome_of("all-down")
    assert outcome["status"] == "failed" and outcome["released_bytes"] > 0
