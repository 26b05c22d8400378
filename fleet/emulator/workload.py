"""The emulator's arrivals: the scenario's workload per origin, looped for ever (or not),
made one request at a time so that a surge or a change of prompt lengths changes what comes
next."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet.emulator.config import EmulatorError
from scheduling.core.scenario import Scenario, ScenarioError, scenario_load
from scheduling.core.simulator.fleet import SimRequest
from scheduling.core.simulator.workload import RequestSpec, Workload, WorkloadError, workload_build

# Loops of a finite workload get fresh block hashes (new conversations), far above trace ids.
_LOOP_SALT = 1 << 40
_FRESH_BASE = 1 << 52


@dataclass
class _OriginStream:
    """Requests arriving at one PD cluster: the base workload's, looped, scaled on the fly."""

    origin: str
    specs: Sequence[RequestSpec]
    loop: bool
    position: int = 0
    clock: float = 0.0
    rate_scale: float = 1.0

    def gap(self, index: int) -> float:
        specs = self.specs
        if index == 0:
            # Between loops: the stream's mean gap.
            span = specs[-1].arrival_s - specs[0].arrival_s
            return span / max(1, len(specs) - 1) if len(specs) > 1 else 1.0
        return max(0.0, specs[index].arrival_s - specs[index - 1].arrival_s)

    def next_spec(self) -> tuple[RequestSpec, int] | None:
        """The next request's spec and its loop number (None at the end of a finite run)."""
        n = len(self.specs)
        loop, index = divmod(self.position, n)
        if loop and not self.loop:
            return None
        if self.position:
            self.clock += self.gap(index) / self.rate_scale
        else:
            self.clock = self.specs[0].arrival_s
        self.position += 1
        return self.specs[index], loop


class RequestStream(Sequence[SimRequest]):
    """The simulation's arrivals, made one at a time so that faults change what comes next.

    The engine asks for ``requests[i]`` in order; request ``i`` is built when first asked (its
    arrival time then fixed), from the earliest next request of the per-origin streams. Only
    a small window of recent requests is kept.
    """

    def __init__(
        self,
        workload: Workload,
        origins: Callable[[str], str],
        block_tokens: int,
        *,
        loop: bool = True,
        limit: int | None = None,
    ) -> None:
        by_origin: dict[str, list[RequestSpec]] = {}
        for spec in workload.requests:
            by_origin.setdefault(origins(spec.origin), []).append(spec)
        self.streams = {
            origin: _OriginStream(origin, specs, loop) for origin, specs in by_origin.items()
        }
        self.block_tokens = block_tokens
        self.prompt_scale = 1.0
        if not loop:
            limit = len(workload.requests) if limit is None else min(limit, len(workload.requests))
        self.limit = limit
        self._heap: list[tuple[float, int, str, RequestSpec, int]] = []
        self._tie = itertools.count()
        self._made: dict[int, SimRequest] = {}
        self._fresh = itertools.count(_FRESH_BASE)
        self._ended = False
        self._next = 0
        for stream in self.streams.values():
            self._advance(stream)

    def _advance(self, stream: _OriginStream) -> None:
        nxt = stream.next_spec()
        if nxt is not None:
            spec, loop = nxt
            heapq.heappush(self._heap, (stream.clock, next(self._tie), stream.origin, spec, loop))

    def rate_scale(self, scale: float, origin: str | None = None) -> None:
        for stream in self.streams.values():
            if origin is None or stream.origin == origin:
                stream.rate_scale = scale

    def _make(self, index: int) -> SimRequest:
        if not self._heap or (self.limit is not None and index >= self.limit):
            self._ended = True
            raise IndexError(index)
        arrival, _, origin, spec, loop = heapq.heappop(self._heap)
        self._advance(self.streams[origin])
        tokens = max(1, round(spec.input_tokens * self.prompt_scale))
        hashes = spec.hash_ids
        if hashes is not None:
            if loop:
                hashes = tuple(h + loop * _LOOP_SALT for h in hashes)
            need = -(-tokens // self.block_tokens)
            if len(hashes) > need:
                hashes = hashes[:need]
            elif len(hashes) < tokens // self.block_tokens:
                hashes = hashes + tuple(
                    next(self._fresh) for _ in range(tokens // self.block_tokens - len(hashes))
                )
        request = SimRequest(
            index, arrival, tokens, spec.output_tokens, origin, hashes, spec.cached_tokens
        )
        return request

    def __len__(self) -> int:
        # The engine reads the length once; an endless stream says "very many".
        return self.limit if self.limit is not None else 1 << 62

    def __getitem__(self, index: int) -> SimRequest:  # type: ignore[override]
        made = self._made.get(index)
        if made is not None:
            return made
        if index < self._next:
            raise IndexError(f"request {index} is no longer kept")
        while self._next <= index:
            if self._ended:
                raise IndexError(index)
            made = self._make(self._next)
            self._made[self._next] = made
            self._next += 1
        if len(self._made) > 4096:
            for old in range(self._next - len(self._made), self._next - 2048):
                self._made.pop(old, None)
        assert made is not None
        return made

    def upcoming(self, first: int, until_s: float, limit: int) -> list[SimRequest]:
        """Requests ``first, first+1, ...`` arriving by ``until_s`` (at least ``first``)."""
        out: list[SimRequest] = []
        index = first
        while len(out) < limit:
            try:
                request = self[index]
            except IndexError:
                break
            if out and request.arrival_s > until_s:
                break
            out.append(request)
            index += 1
        return out

    def __iter__(self) -> Iterator[SimRequest]:
        index = 0
        while True:
            try:
                yield self[index]
            except IndexError:
                return
            index += 1


def scenario_workload(
    path: Path, *, rate_per_s: float | None, seed: int, span_s: float
) -> tuple[Scenario, Workload]:
    """The scenario at ``path`` and the workload the emulator loops: its trace whole, or
    ``span_s`` fleet seconds drawn from its distributions. :class:`EmulatorError` names the
    file and the problem."""
    if not path.is_file():
        raise EmulatorError(f"scenario file not found: {path}")
    try:
        scenario = scenario_load(path)
        has_trace = scenario.workload is not None and scenario.workload.trace is not None
        workload = workload_build(
            scenario,
            rate_per_s=rate_per_s,
            seed=seed,
            # Distributions: span_s of arrivals, looped (a trace brings its own length).
            duration_s=None if has_trace else span_s,
        )
    except (ScenarioError, WorkloadError) as exc:
        raise EmulatorError(f"{path}: {exc}") from exc
    if not workload.requests:
        raise EmulatorError(f"{path}: the workload has no requests")
    return scenario, workload
