"""Group commit for the route path's Redis scripts: concurrent calls share one command.

On this path a Redis round trip costs far more CPU than the script it runs (two syscalls and
redis-py's client machinery on each side, per command). The prefix-match and the reservation
scripts already take any number of items (chains; reservations, admitted one by one in order
against the budget), so while one command is in flight the route calls that need the same
script queue their items, and the next command carries all of them: N concurrent calls make
about N / (calls per round trip) commands instead of N, and a lone call waits for nothing.

Atomicity is the script's own: each reservation is still checked against its link's budget
inside one script run, whoever else's items share the command. A call that gives up waiting
(its deadline) leaves its items in the command; a reservation admitted then expires at its
predicted transfer end like any other (the budget is only ever under-used).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _LoopQueue(Generic[Item, Result]):
    waiting: list[tuple[Sequence[Item], asyncio.Future[list[Result]]]] = field(default_factory=list)
    busy: bool = False
    # The drain task in flight (held: the loop keeps only a weak reference to its tasks).
    task: asyncio.Task[None] | None = None


class Coalesced(Generic[Item, Result]):
    """``run(items) -> one result per item`` called for many callers at once, per event loop."""

    def __init__(self, run: Callable[[list[Item]], Awaitable[list[Result]]]) -> None:
        self._run = run
        self._queues: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, _LoopQueue[Item, Result]
        ] = weakref.WeakKeyDictionary()

    async def call(self, items: Sequence[Item]) -> list[Result]:
        """The results of ``items``, in order (``run``'s exception, if its command failed)."""
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _LoopQueue()
        future: asyncio.Future[list[Result]] = loop.create_future()
        queue.waiting.append((items, future))
        if not queue.busy:
            queue.busy = True
            queue.task = loop.create_task(self._drain(queue))
        return await future

    async def _drain(self, queue: _LoopQueue[Item, Result]) -> None:
        try:
            while queue.waiting:
                batch, queue.waiting = queue.waiting, []
                flat = [item for items, _ in batch for item in items]
                try:
                    results = await self._run(flat)
                except BaseException as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                at = 0
                for items, future in batch:
                    if not future.done():
                        future.set_result(results[at : at + len(items)])
                    at += len(items)
        finally:
            queue.busy = False
