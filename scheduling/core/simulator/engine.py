"""The discrete-event engine: one simulated clock, a heap of events, the fleet and its links.

Arrivals come from a pre-built, time-sorted list and are merged with the event heap, so the
heap only holds events in flight. Where each request goes is not decided here: a
:class:`Dispatcher` (the router adapter of :mod:`scheduling.core.simulator.routing`, or a test
double) answers with an :class:`Assignment`, and the engine carries it out.

A request's path: arrival -> (optional cross-cluster prefix transfer) -> FCFS prefill queue ->
prefill (for an offloaded request its KVCache streams over the link during the prefill) ->
KV at the decode instance (RDMA inside a cluster is free; over the link it lands one RTT after
the last byte) -> wait for a batch slot -> decode ``output_tokens`` steps. The first token is
delivered when decoding starts: TTFT = first_token_s - arrival_s, TPOT = step time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduling.core.simulator.fleet import (
    ACTIVE,
    DOWN,
    DRAINING,
    DecodeInstance,
    PrefillInstance,
    SimRequest,
)
from scheduling.core.simulator.link import Flow, FluidLink

OFF = "off"  # the inactive personality of a PD instance (its other role is the active one)

_PREFILL_DONE = 0
_LINK_WAKE = 1
_KV_LANDED = 2
_DECODE_DONE = 3
_SAMPLE = 4
_FLEET_EVENT = 5
_TICK = 6


@dataclass(slots=True)
class Assignment:
    """Where one request goes: the dispatcher's answer, in fleet objects."""

    route: str  # "local" or "prfaas"
    prefill: PrefillInstance
    decode: DecodeInstance
    cached_tokens: int
    reason: str = ""
    threshold: float = math.nan
    link: FluidLink | None = None  # the link an offloaded request's KVCache crosses
    kv_bytes: float = 0.0  # what crosses it: the KV the decode cluster does not hold yet
    cache_transfer_link: FluidLink | None = None
    cache_transfer_bytes: float = 0.0


class Dispatcher(Protocol):
    """Decides each request's placement; may act on the clock through ``tick``."""

    tick_s: float | None

    def assign(self, sim: Simulation, request: SimRequest) -> Assignment | None: ...

    def tick(self, sim: Simulation) -> None: ...

    def fleet_changed(self, sim: Simulation) -> None: ...


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """A timed change to the fleet (from the scenario's ``events``)."""

    at_s: float
    link: str | None = None  # "source->target"
    gbps: float | None = None
    instance: str | None = None
    cluster: str | None = None
    state: str | None = None


@dataclass(slots=True)
class Sample:
    """The fleet's queues at one instant."""

    t: float
    in_system: int
    prefill_queued: dict[str, int]
    decode_waiting: dict[str, int]
    link_in_flight_bytes: dict[str, float]
    link_reserved_bytes: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Simulation:
    """The whole simulated system; :meth:`run` plays it to the end."""

    requests: Sequence[SimRequest]
    prefill_instances: list[PrefillInstance]
    decode_instances: list[DecodeInstance]
    links: dict[str, FluidLink]
    dispatcher: Dispatcher
    block_tokens: int = 512
    fleet_events: Sequence[FleetEvent] = ()
    sample_s: float = 5.0
    now: float = 0.0
    in_system: int = 0
    finished: int = 0
    dropped: int = 0
    redispatched: int = 0
    samples: list[Sample] = field(default_factory=list)
    arrived: int = 0
    area: float = 0.0  # integral of in_system over time (Little's law check)
    _area_t: float = 0.0
    pending_flips: dict[str, str] = field(default_factory=dict)
    on_flip: Callable[[Simulation, str, str], None] | None = None
    _heap: list[tuple[float, int, int, object, object]] = field(default_factory=list)
    _seq: int = 0
    _periodic: int = 0  # SAMPLE and TICK events in the heap: they alone never end a run
    prefill_by_name: dict[str, PrefillInstance] = field(default_factory=dict)
    decode_by_name: dict[str, DecodeInstance] = field(default_factory=dict)
    link_between: dict[tuple[str, str], FluidLink] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefill_by_name = {p.name: p for p in self.prefill_instances}
        self.decode_by_name = {d.name: d for d in self.decode_instances}
        for link in self.links.values():
            self.link_between[(link.source, link.target)] = link

    def link_joining(self, a: str, b: str) -> FluidLink | None:
        """The link from cluster ``a`` to ``b``, else the one from ``b`` to ``a``: a cache
        transfer between two clusters rides whichever link joins them."""
        return self.link_between.get((a, b)) or self.link_between.get((b, a))

    # -- events -------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, a: object = None, b: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, a, b))

    def run(self) -> None:
        """Play every arrival and every event they cause, until the fleet is empty."""
        requests = self.requests
        for event in sorted(self.fleet_events, key=lambda e: e.at_s):
            self._push(event.at_s, _FLEET_EVENT, event)
        tick_s = self.dispatcher.tick_s
        if tick_s:
            self._push(tick_s, _TICK)
            self._periodic += 1
        if self.sample_s > 0:
            self._push(0.0, _SAMPLE)
            self._periodic += 1
        heap = self._heap
        pop = heapq.heappop
        count = len(requests)
        index = 0
        next_arrival = requests[0].arrival_s if count else math.inf
        while True:
            if heap and heap[0][0] <= next_arrival:
                at, _, kind, a, b = pop(heap)
                self.now = at
                if kind == _PREFILL_DONE:
                    self._prefill_done(a)  # type: ignore[arg-type]
                elif kind == _LINK_WAKE:
                    link: FluidLink = a  # type: ignore[assignment]
                    if link.version == b:
                        link.advance(at)
                        self._link_touch(link)
                elif kind == _KV_LANDED:
                    self._kv_landed(a, b)  # type: ignore[arg-type]
                elif kind == _DECODE_DONE:
                    self._decode_done(a, b)  # type: ignore[arg-type]
                elif kind == _SAMPLE:
                    self._periodic -= 1
                    self._sample(self._progress_possible(index < count))
                elif kind == _TICK:
                    self._periodic -= 1
                    if self._progress_possible(index < count):
                        self.dispatcher.tick(self)
                        self._push(at + (tick_s or 0.0), _TICK)
                        self._periodic += 1
                else:
                    self._fleet_event(a)  # type: ignore[arg-type]
            elif index < count:
                request = requests[index]
                index += 1
                next_arrival = requests[index].arrival_s if index < count else math.inf
                self.now = request.arrival_s
                self.arrived += 1
                self._count(1)
                self._dispatch(request)
            else:
                break
        for link in self.links.values():
            link.advance(self.now)
        self._strand()

    def _progress_possible(self, more_arrivals: bool) -> bool:
        """Whether anything but the periodic events themselves can still happen."""
        return more_arrivals or (self.in_system > 0 and len(self._heap) > self._periodic)

    def _strand(self) -> None:
        """Requests left when no event can move them (a link cut for good): counted as dropped,
        and what their transfers had sent as aborted."""
        if self.in_system <= 0:
            return
        for link in self.links.values():
            for flow in list(link.flows):
                link.abort(flow)
        for request in self.requests[: self.arrived]:
            if not request.dropped and math.isnan(request.finish_s):
                self._drop(request, "stranded")

    def _count(self, change: int) -> None:
        now = self.now
        self.area += self.in_system * (now - self._area_t)
        self._area_t = now
        self.in_system += change

    # -- placement ----------------------------------------------------------------------------

    def prefix_match(self, request: SimRequest, instance_cache: object) -> int:
        """Tokens of ``request``'s prompt usable from one instance's cache."""
        if request.hash_ids is None or instance_cache is None:
            return 0
        full = request.input_tokens // self.block_tokens
        blocks = instance_cache.match_blocks(request.hash_ids, full)  # type: ignore[attr-defined]
        return min(blocks * self.block_tokens, request.input_tokens - 1)

    def _dispatch(self, request: SimRequest) -> None:
        assignment = self.dispatcher.assign(self, request)
        if assignment is None:
            self._drop(request, "no_capacity")
            return
        prefill = assignment.prefill
        request.route = assignment.route
        request.reason = assignment.reason
        request.threshold = assignment.threshold
        request.prefill_instance = prefill
        request.decode_instance = assignment.decode
        # The decode engine holds the request (waiting for its KV) from the decision on, so its
        # load counts it: the router does not pile later decisions onto the same instance.
        assignment.decode.assigned += 1
        request.assigned_decode = assignment.decode
        cached = max(0, min(assignment.cached_tokens, request.input_tokens - 1))
        request.cached_tokens = cached
        request.incremental_tokens = request.input_tokens - cached
        request.service_s = max(0.0, prefill.prefill_seconds(request.incremental_tokens))
        link = assignment.link
        if link is not None:
            request.kv_bytes = assignment.kv_bytes
            request.link_key = link.key
            link.reserved_bytes += request.kv_bytes
        else:
            request.kv_bytes = 0.0
            request.link_key = ""
        if assignment.cache_transfer_link is not None and assignment.cache_transfer_bytes > 0:
            moving = assignment.cache_transfer_link
            request.cache_transfer_bytes = assignment.cache_transfer_bytes
            moving.reserved_bytes += request.cache_transfer_bytes
            request.cache_link_key = moving.key
            flow = Flow(
                request,
                request.cache_transfer_bytes,
                request.cache_transfer_bytes,
                math.inf,
                False,
                "cache",
            )
            moving.advance(self.now)
            moving.flows.append(flow)
            self._link_touch(moving)
            return
        self._prefill_enqueue(request)

    def cluster_match(self, request: SimRequest, cluster: str) -> int:
        """Longest usable prefix anywhere in a cluster (RDMA makes a peer's cache local)."""
        if request.hash_ids is None:
            return request.hinted_cached_tokens if cluster == request.origin else 0
        best = 0
        for prefill in self.prefill_instances:
            if prefill.cluster == cluster and prefill.state != DOWN and prefill.cache is not None:
                best = max(best, self.prefix_match(request, prefill.cache))
        for decode in self.decode_instances:
            if decode.cluster == cluster and decode.state != DOWN and decode.cache is not None:
                best = max(best, self.prefix_match(request, decode.cache))
        return best

    # -- prefill ------------------------------------------------------------------------------

    def _prefill_enqueue(self, request: SimRequest) -> None:
        prefill = request.prefill_instance
        assert prefill is not None
        if prefill.state == DOWN:
            self._redispatch(request)
            return
        if prefill.current is None:
            self._prefill_start(prefill, request)
        else:
            prefill.queue.append(request)
            prefill.queued_work_s += request.service_s

    def _prefill_start(self, prefill: PrefillInstance, request: SimRequest) -> None:
        now = self.now
        prefill.current = request
        prefill.busy_until = now + request.service_s
        request.prefill_start_s = now
        if request.link_key:
            link = self.links[request.link_key]
            link.advance(now)
            size = request.kv_bytes
            cap = size / request.service_s if request.service_s > 0 else math.inf
            flow = Flow(request, size, size, cap, request.service_s > 0)
            request.flow = flow
            link.flows.append(flow)
            self._link_touch(link)
        self._push(prefill.busy_until, _PREFILL_DONE, prefill)

    def _prefill_done(self, prefill: PrefillInstance) -> None:
        request = prefill.current
        if request is None or prefill.busy_until != self.now:
            return  # the instance failed and was restarted since this event was scheduled
        now = self.now
        request.prefill_end_s = now
        prefill.busy_s += request.service_s
        prefill.served += 1
        prefill.current = None
        if request.hash_ids is not None and prefill.cache is not None:
            full = request.input_tokens // self.block_tokens
            prefill.cache.store(request.hash_ids, full)
        if prefill.queue:
            upcoming = prefill.queue.popleft()
            prefill.queued_work_s -= upcoming.service_s
            if not prefill.queue:
                prefill.queued_work_s = 0.0
            self._prefill_start(prefill, upcoming)
        else:
            self._check_drained(prefill.name)
        if request.link_key:
            link = self.links[request.link_key]
            link.advance(now)
            flow: Flow = request.flow  # type: ignore[assignment]
            flow.producing = False
            flow.cap_bps = math.inf
            self._link_touch(link)
        else:
            request.kv_ready_s = now
            self._decode_enqueue(request)

    # -- link ---------------------------------------------------------------------------------

    def _link_touch(self, link: FluidLink) -> None:
        """After a change on ``link`` (already advanced to now): deliver, reshare, re-arm."""
        now = self.now
        for flow in link.finished():
            self._push(now + link.rtt_s, _KV_LANDED, flow.owner, flow.kind)
        link.reshare()
        link.version += 1
        wait = link.next_completion()
        if wait < math.inf:
            self._push(now + wait, _LINK_WAKE, link, link.version)

    def _kv_landed(self, request: SimRequest, kind: str) -> None:
        if request.dropped:
            return
        if kind == "cache":
            self.links[request.cache_link_key].reserved_bytes -= request.cache_transfer_bytes
            self._prefill_enqueue(request)
            return
        link = self.links[request.link_key]
        link.reserved_bytes -= request.kv_bytes
        request.kv_ready_s = self.now
        self._decode_enqueue(request)

    # -- decode -------------------------------------------------------------------------------

    def _decode_enqueue(self, request: SimRequest) -> None:
        decode = request.decode_instance
        assert decode is not None
        if decode.state in (DOWN, OFF):
            replacement = self._decode_replacement(decode.cluster)
            if replacement is None:
                self._drop(request, "decode_unavailable")
                return
            decode = replacement
            request.decode_instance = decode
        if decode.running < decode.max_batch and not decode.waiting:
            self._decode_admit(decode, request)
        else:
            decode.waiting.append(request)

    def _decode_replacement(self, cluster: str) -> DecodeInstance | None:
        best: DecodeInstance | None = None
        for decode in self.decode_instances:
            if (
                decode.cluster == cluster
                and decode.state == ACTIVE
                and (best is None or decode.load() < best.load())
            ):
                best = decode
        return best

    def _decode_admit(self, decode: DecodeInstance, request: SimRequest) -> None:
        now = self.now
        self._unassign(request)
        decode.running += 1
        decode.running_requests.add(request)
        request.first_token_s = now
        duration = request.output_tokens * decode.step_s
        decode.busy_slot_s += duration
        if request.hash_ids is not None and decode.cache is not None:
            decode.cache.store(request.hash_ids, request.input_tokens // self.block_tokens)
        self._push(now + duration, _DECODE_DONE, decode, request)

    def _decode_done(self, decode: DecodeInstance, request: SimRequest) -> None:
        if request.dropped or request not in decode.running_requests:
            return
        decode.running_requests.discard(request)
        decode.running -= 1
        decode.served += 1
        request.finish_s = self.now
        self.finished += 1
        self._count(-1)
        while decode.waiting and decode.running < decode.max_batch and decode.state != DOWN:
            self._decode_admit(decode, decode.waiting.popleft())
        if decode.idle:
            self._check_drained(decode.name)

    # -- failures, drops and role changes ------------------------------------------------------

    @staticmethod
    def _unassign(request: SimRequest) -> None:
        held = request.assigned_decode
        if held is not None:
            held.assigned -= 1
            request.assigned_decode = None

    def _drop(self, request: SimRequest, reason: str) -> None:
        if request.dropped:
            return
        self._unassign(request)
        request.dropped = reason
        self.dropped += 1
        self._count(-1)
        if request.link_key and math.isnan(request.kv_ready_s):
            self.links[request.link_key].reserved_bytes -= request.kv_bytes

    def _redispatch(self, request: SimRequest) -> None:
        """Send a request whose prefill instance failed back through the dispatcher."""
        self.redispatched += 1
        self._unassign(request)
        if request.link_key:
            self.links[request.link_key].reserved_bytes -= request.kv_bytes
        request.link_key = ""
        request.flow = None
        request.prefill_start_s = math.nan
        self._dispatch(request)

    def _fleet_event(self, event: FleetEvent) -> None:
        if event.link is not None:
            link = self.links[event.link]
            link.advance(self.now)
            link.capacity_bps = (event.gbps or 0.0) * 1e9 / 8
            self._link_touch(link)
        else:
            names = (
                {event.instance}
                if event.instance is not None
                else {p.name for p in self.prefill_instances if p.cluster == event.cluster}
                | {d.name for d in self.decode_instances if d.cluster == event.cluster}
            )
            for name in sorted(names):
                if event.state == DOWN:
                    self.instance_fail(name)
                else:
                    self.instance_recover(name)
        self.dispatcher.fleet_changed(self)

    def instance_fail(self, name: str) -> None:
        """An instance goes down: prefill work is re-dispatched, running decodes are lost."""
        prefill = self.prefill_by_name.get(name)
        decode = self.decode_by_name.get(name)
        for instance in (prefill, decode):
            if instance is not None and instance.state != OFF:
                instance.state = DOWN
        self.dispatcher.fleet_changed(self)
        if prefill is not None and prefill.state == DOWN:
            orphans = list(prefill.queue)
            prefill.queue.clear()
            prefill.queued_work_s = 0.0
            if prefill.current is not None:
                current = prefill.current
                prefill.current = None
                prefill.busy_until = math.nan
                if current.link_key and current.flow is not None:
                    link = self.links[current.link_key]
                    link.advance(self.now)
                    link.abort(current.flow)  # type: ignore[arg-type]
                    self._link_touch(link)
                orphans.insert(0, current)
            for request in orphans:
                self._redispatch(request)
        if decode is not None and decode.state == DOWN:
            for request in sorted(decode.running_requests, key=lambda r: r.index):
                self._drop(request, "decode_failed")
            decode.running_requests.clear()
            decode.running = 0
            waiting = list(decode.waiting)
            decode.waiting.clear()
            for request in waiting:
                self._decode_enqueue(request)

    def instance_recover(self, name: str) -> None:
        for instance in (self.prefill_by_name.get(name), self.decode_by_name.get(name)):
            if instance is not None and instance.state == DOWN:
                instance.state = ACTIVE
                if isinstance(instance, PrefillInstance):
                    instance.busy_until = 0.0

    def role_flip(self, name: str, to_role: str) -> None:
        """Drain ``name`` in its current role; once empty it serves ``to_role``."""
        source = self.prefill_by_name[name] if to_role == "decode" else self.decode_by_name[name]
        if source.state != ACTIVE:
            return
        source.state = DRAINING
        self.pending_flips[name] = to_role
        self._check_drained(name)

    def _check_drained(self, name: str) -> None:
        to_role = self.pending_flips.get(name)
        if to_role is None:
            return
        source = self.prefill_by_name[name] if to_role == "decode" else self.decode_by_name[name]
        target = self.decode_by_name[name] if to_role == "decode" else self.prefill_by_name[name]
        if not source.idle:
            return
        del self.pending_flips[name]
        source.state = OFF
        target.state = ACTIVE
        if self.on_flip is not None:
            self.on_flip(self, name, to_role)
        self.dispatcher.fleet_changed(self)

    # -- observation --------------------------------------------------------------------------

    def _sample(self, again: bool) -> None:
        queued: dict[str, int] = {}
        for prefill in self.prefill_instances:
            queued[prefill.cluster] = queued.get(prefill.cluster, 0) + prefill.depth()
        waiting: dict[str, int] = {}
        for decode in self.decode_instances:
            waiting[decode.cluster] = waiting.get(decode.cluster, 0) + len(decode.waiting)
        in_flight = {key: link.in_flight_bytes() for key, link in self.links.items()}
        reserved = {key: link.reserved_bytes for key, link in self.links.items()}
        self.samples.append(Sample(self.now, self.in_system, queued, waiting, in_flight, reserved))
        if again:
            self._push(self.now + self.sample_s, _SAMPLE)
            self._periodic += 1
