"""Group commit of the route path's scripts: concurrent calls share commands, each gets its
own results in order, and a failed command fails every call that shared it."""

from __future__ import annotations

import asyncio

import pytest

from scheduling.coalesce import Coalesced


class Squares:
    """A command that takes a while (a round trip) and answers each item."""

    def __init__(self) -> None:
        self.commands: list[list[int]] = []

    async def __call__(self, items: list[int]) -> list[int]:
        self.commands.append(items)
        await asyncio.sleep(0.01)
        if any(x < 0 for x in items):
            raise ValueError("negative")
        return [x * x for x in items]


async def test_concurrent_calls_share_commands_and_get_their_own_results() -> None:
    run = Squares()
    squares = Coalesced(run)
    got = await asyncio.gather(*(squares.call([k, k + 100]) for k in range(20)))
    assert got == [[k * k, (k + 100) ** 2] for k in range(20)]
    # Arrived together: one command.
    assert [len(c) for c in run.commands] == [40]


async def test_calls_arriving_during_a_command_go_together_in_the_next() -> None:
    run = Squares()
    squares = Coalesced(run)
    first = asyncio.ensure_future(squares.call([1]))
    await asyncio.sleep(0.001)  # its command is in flight
    later = await asyncio.gather(*(squares.call([k]) for k in range(2, 12)))
    assert await first == [1] and later == [[k * k] for k in range(2, 12)]
    assert run.commands == [[1], list(range(2, 12))]


async def test_a_lone_call_waits_for_nothing_but_its_command() -> None:
    run = Squares()
    squares = Coalesced(run)
    assert await squares.call([3]) == [9]
    assert await squares.call([4]) == [16]
    assert run.commands == [[3], [4]]


async def test_a_failed_command_fails_the_calls_that_shared_it_only() -> None:
    run = Squares()
    squares = Coalesced(run)
    first = asyncio.ensure_future(squares.call([1]))
    await asyncio.sleep(0)
    shared = [asyncio.ensure_future(squares.call([x])) for x in (2, -1)]
    assert await first == [1]
    for call in shared:
        with pytest.raises(ValueError, match="negative"):
            await call
    assert await squares.call([5]) == [25]


async def test_a_call_that_gives_up_leaves_the_others_served() -> None:
    run = Squares()
    squares = Coalesced(run)
    impatient = asyncio.ensure_future(asyncio.wait_for(squares.call([7]), timeout=0.001))
    patient = asyncio.ensure_future(squares.call([8]))
    with pytest.raises(TimeoutError):
        await impatient
    assert await patient == [64]
