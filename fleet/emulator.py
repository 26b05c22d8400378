"""The fleet emulator: a simulated PrfaaS fleet that drives the control plane over HTTP.

It plays the part of everything outside the control plane, through the same doors a real
deployment uses:

* **the router**: every request of the scenario's workload (or trace) is decided by
  ``POST /api/v1/route`` (``/route/batch`` when several arrive together) through
  :class:`fleet.client.RouterClient`, fallback included;
* **the engines**: the decisions are carried out by the simulator's fleet model
  (:class:`scheduling.core.simulator.engine.Simulation`: FCFS prefill queues, the fluid
  cross-datacenter link, batched decode, hybrid prefix caches), on a clock ``speed`` times
  faster than the wall clock;
* **the engines' KV events**: each emulated engine publishes its prefix cache's stores and
  evictions as vLLM 0.32 does (:func:`scheduling.core.kv_events.batch_encode`: msgpack batches with a
  sequence number from 0 per engine process, ``BlockStored`` runs per KV group, one
  ``BlockRemoved`` per evicted block) and keeps a replay buffer like vLLM's;
* **the agents**: the frames go through the fleet agent's own code, the same path as a real
  engine's (:class:`fleet.agent.kv.KvStream`: sequence tracking, replay, compaction; then
  :class:`fleet.agent.uplink.Uplink`: bounded buffers, ``POST /api/v1/kv-events/msgpack``), and
  every ``telemetry_s`` wall seconds the instances' queues and KV usage and the links' bytes go
  through the same uplink to ``POST /api/v1/telemetry``. Only the socket is skipped: frames are
  handed to the stream in process instead of over ZMQ.

It obeys the control plane: the fleet is built from ``GET /api/v1/policy`` (re-read with its
ETag), and a role change there drains the instance in the simulation and flips it; an instance
marked ``down`` stops. Faults come from the scenario's timed ``events`` and from a Redis list
(:func:`emulator_fault_push`, ``manage.py emulate_fault``): a link's capacity, an instance going
down or coming back, a traffic surge, longer or shorter prompts. With an ``admin`` token a link
or instance fault is also recorded in the inventory, as a network or health monitor would.

Time: the fleet lives on the simulated clock, the control plane on the wall clock. Telemetry is
rescaled so that rates read in fleet time (a link's bytes are reported over the wall interval
divided by ``speed``), so the control plane compares them with the capacities it knows.

No Django here: the command (``manage.py emulate``) passes URLs, tokens and a Redis client.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleet.agent.kv import KvStream
from fleet.agent.metrics import AgentMetrics
from fleet.agent.uplink import KV_PATH, TELEMETRY_PATH, Uplink
from fleet.client import RouterApiError, RouterClient, RouterUnavailableError
from scheduling.core import kv_events as wire
from scheduling.core import routing
from scheduling.core.scenario import LinkEvent, RateEvent, Scenario, StateEvent
from scheduling.core.service_levels import TTFT_BUCKETS_S, ttft_bucket
from scheduling.core.simulator.cache import HybridPrefixCache
from scheduling.core.simulator.engine import OFF, Assignment, FleetEvent, Simulation
from scheduling.core.simulator.fleet import (
    ACTIVE,
    DOWN,
    DecodeInstance,
    PrefillInstance,
    SimRequest,
)
from scheduling.core.simulator.link import FluidLink
from scheduling.core.simulator.workload import RequestSpec, Workload

log = logging.getLogger(__name__)

# Redis key of the fault channel: a list of JSON faults, pushed on the right, popped on the left.
FAULTS_KEY = "emulator:faults"
# Redis key of the emulator's status line (a JSON string, refreshed every few seconds).
STATUS_KEY = "emulator:status"
# A status older than this says no emulator is running (one writes it every ``status_s``).
STATUS_FRESH_S = 30.0
# The per-cluster service counters of every telemetry report, newest first (15 min at 1 s).
SERVICE_KEY = "emulator:service"
SERVICE_KEPT = 900
FAULT_KINDS = ("link", "instance", "surge", "prompts")

GIB = float(1 << 30)
# Loops of a finite workload get fresh block hashes (new conversations), far above trace ids.
_LOOP_SALT = 1 << 40
_FRESH_BASE = 1 << 52
# Keep route request bodies under the API's body limit (default 256 KiB): hashes per call.
_MAX_HASHES_PER_CALL = 6000
# Block hashes per published batch (a vLLM step publishes a few hundred at most).
_MAX_HASHES_PER_BATCH = 2000
# Batches an emulated engine keeps for replay (vLLM's default buffer_steps).
_REPLAY_BUFFER = 10_000
# KV groups as a hybrid vLLM model numbers them: full attention first, the linear state next.
FULL_GROUP, LINEAR_GROUP = 0, 1
_MAX_BATCH = 500
# Wall seconds the emulator may fall behind its clock before it stops trying to catch up.
MAX_LAG_S = 5.0


class EmulatorError(ValueError):
    """The emulator cannot start as asked (message says why)."""


class FaultError(ValueError):
    """A fault that is not one of the known shapes (message says why)."""


class _Stop(Exception):
    """Internal: unwinds the simulation when the emulator is asked to stop."""


# ---------------------------------------------------------------------------------------------
# Faults


def fault_validate(fault: Mapping[str, Any]) -> dict[str, Any]:
    """A fault as the channel carries it, checked; raises :class:`FaultError` naming the key.

    Shapes: ``{"kind": "link", "link": "source->target", "gbps": >= 0}``;
    ``{"kind": "instance", "instance": name, "state": "down" | "active"}``;
    ``{"kind": "surge", "rate_scale": > 0, "cluster": optional pd cluster}``;
    ``{"kind": "prompts", "scale": > 0}`` (prompt lengths multiplied by ``scale``).
    """
    kind = fault.get("kind")
    if kind not in FAULT_KINDS:
        raise FaultError(f"kind: must be one of {', '.join(FAULT_KINDS)}, not {kind!r}")

    def number(key: str, *, positive: bool) -> float:
        value = fault.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise FaultError(f"{key}: a number is required")
        if value < 0 or (positive and value == 0):
            raise FaultError(f"{key}: must be {'positive' if positive else 'at least 0'}")
        return float(value)

    def name(key: str, *, optional: bool = False) -> str | None:
        value = fault.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise FaultError(f"{key}: a name is required")
        return value

    if kind == "link":
        link = name("link")
        assert link is not None
        if "->" not in link:
            raise FaultError("link: write it as source->target")
        return {"kind": kind, "link": link, "gbps": number("gbps", positive=False)}
    if kind == "instance":
        state = fault.get("state")
        if state not in (DOWN, ACTIVE):
            raise FaultError("state: must be down or active")
        return {"kind": kind, "instance": name("instance"), "state": state}
    if kind == "surge":
        out: dict[str, Any] = {"kind": kind, "rate_scale": number("rate_scale", positive=True)}
        cluster = name("cluster", optional=True)
        if cluster is not None:
            out["cluster"] = cluster
        return out
    return {"kind": kind, "scale": number("scale", positive=True)}


def emulator_fault_push(client: Any, fault: Mapping[str, Any]) -> dict[str, Any]:
    """Queue a fault for the running emulator (``client``: a redis-py client)."""
    checked = fault_validate(fault)
    client.rpush(FAULTS_KEY, json.dumps(checked))
    return checked


def emulator_faults_pop(client: Any, limit: int = 100) -> list[dict[str, Any]]:
    """Take the queued faults; a malformed one is logged and dropped."""
    out: list[dict[str, Any]] = []
    for _ in range(limit):
        raw = client.lpop(FAULTS_KEY)
        if raw is None:
            break
        try:
            out.append(fault_validate(json.loads(raw)))
        except (ValueError, TypeError) as exc:
            log.warning("emulator: ignored fault %r: %s", raw, exc)
    return out


def emulator_status_read(client: Any) -> dict[str, Any] | None:
    """The running emulator's last status (None when none was written)."""
    raw = client.get(STATUS_KEY)
    return json.loads(raw) if raw else None


def scenario_faults(
    events: Sequence[LinkEvent | StateEvent | RateEvent], members: Mapping[str, Sequence[str]]
) -> list[tuple[float, dict[str, Any]]]:
    """A scenario's timed ``events`` as faults, by time (``members``: instances per cluster,
    for an event that takes a whole cluster down or up)."""
    out: list[tuple[float, dict[str, Any]]] = []
    for event in events:
        if isinstance(event, LinkEvent):
            link = f"{event.source}->{event.target}"
            out.append((event.at_s, {"kind": "link", "link": link, "gbps": event.gbps}))
        elif isinstance(event, StateEvent):
            names = (
                [event.instance]
                if event.instance is not None
                else list(members.get(event.cluster or "", ()))
            )
            for name in names:
                out.append(
                    (event.at_s, {"kind": "instance", "instance": name, "state": event.state})
                )
        else:
            out.append(
                (
                    event.at_s,
                    {"kind": "surge", "rate_scale": event.rate_scale, "cluster": event.cluster},
                )
            )
    return sorted(out, key=lambda e: e[0])


# ---------------------------------------------------------------------------------------------
# Prefix caches that remember what they stored and evicted (for KV events)


class _Journal(OrderedDict[int, float]):
    """The entries of one cache, with a journal of keys stored and evicted since last read."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[bool, int]] = []  # (stored?, key)

    def __setitem__(self, key: int, value: float) -> None:
        if key not in self:
            self.events.append((True, key))
        super().__setitem__(key, value)

    def popitem(self, last: bool = True) -> tuple[int, float]:
        key, value = super().popitem(last=last)
        self.events.append((False, key))
        return key, value


class ReportingPrefixCache(HybridPrefixCache):
    """The simulator's hybrid prefix cache, journaling stores and evictions."""

    def __init__(
        self, capacity_bytes: float, block_bytes: Sequence[float], state_bytes: float
    ) -> None:
        super().__init__(capacity_bytes, block_bytes, state_bytes)
        self.journal = _Journal()
        self._entries = self.journal

    def take_events(self) -> list[tuple[bool, int]]:
        events = self.journal.events
        self.journal.events = []
        return events


def kv_batch_events(events: Sequence[tuple[bool, int]], block_tokens: int) -> list[wire.KvEvent]:
    """A journal as vLLM 0.32 reports it: a ``BlockStored`` per run of stored blocks of one KV
    group (full attention, group 0; linear-state checkpoints, key ``~h`` for the state ending at
    block ``h``, group 1 of kind ``mamba``), and one ``BlockRemoved`` per evicted block naming
    its group, in order. The emulator has no token ids, so ``token_ids`` is empty and the first
    block's parent is not given."""
    out: list[wire.KvEvent] = []
    for (stored, linear), run in itertools.groupby(events, key=lambda e: (e[0], e[1] < 0)):
        hashes: list[int | bytes] = [(~key if linear else key) % (1 << 64) for _, key in run]
        group = LINEAR_GROUP if linear else FULL_GROUP
        if stored:
            out.append(
                wire.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_tokens,
                    medium="GPU",
                    extra_keys=[None] * len(hashes),
                    group_idx=group,
                    kv_cache_spec_kind="mamba" if linear else "full_attention",
                )
            )
        else:
            out.extend(wire.BlockRemoved([h], medium="GPU", group_idx=group) for h in hashes)
    return out


class EmulatedEngineEvents:
    """One emulated engine's KV-event publisher: sequence numbers from 0 (a new process), the
    msgpack payloads vLLM sends, and its replay buffer; each frame goes to the agent stream."""

    def __init__(self, stream: KvStream) -> None:
        self.stream = stream
        self.seq = -1
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=_REPLAY_BUFFER)
        stream.replay = self.replay

    def publish(self, events: Sequence[wire.KvEvent], ts: float) -> None:
        self.seq += 1
        payload = wire.batch_encode(events, ts)
        self.buffer.append((self.seq, payload))
        self.stream.frame_receive(b"kv-events", self.seq.to_bytes(8, "big"), payload)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.buffer if seq >= start]


# ---------------------------------------------------------------------------------------------
# The workload, endless and adjustable


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


# ---------------------------------------------------------------------------------------------
# The emulator


@dataclass
class EmulatorConfig:
    """How to emulate: the control plane, tokens, pace and reporting periods (wall seconds)."""

    base_url: str
    router_token: str
    agent_token: str
    admin_token: str = ""
    speed: float = 4.0
    telemetry_s: float = 1.0
    policy_s: float = 2.0
    batch_window_s: float = 0.2
    status_s: float = 10.0
    duration_s: float | None = None  # wall seconds; None: until stopped
    requests: int | None = None
    loop: bool = True
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.speed > 0 or not math.isfinite(self.speed):
            raise EmulatorError("speed must be a positive number")
        for name in ("telemetry_s", "policy_s", "batch_window_s", "status_s"):
            if not getattr(self, name) > 0:
                raise EmulatorError(f"{name} must be positive")
        if not self.router_token or not self.agent_token:
            raise EmulatorError("a router token and an agent token are needed")


@dataclass
class EmulatorStats:
    """Counters for the status line."""

    routed: int = 0
    remote: int = 0
    local: int = 0
    offloaded: int = 0
    replaced: int = 0
    unroutable: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    telemetry_posts: int = 0
    kv_posts: int = 0
    post_errors: int = 0
    faults: int = 0
    flips: int = 0


class FleetEmulator:
    """Emulates the fleet of ``scenario`` against the control plane at ``config.base_url``.

    Also the simulation's dispatcher (``assign``/``tick``/``fleet_changed``): it asks the
    control plane where each request goes and paces the simulated clock on the wall clock.
    """

    def __init__(
        self,
        scenario: Scenario,
        workload: Workload,
        config: EmulatorConfig,
        *,
        faults: Any = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.scenario = scenario
        self.config = config
        self.faults = faults  # redis-py client of the fault channel (None: scenario events only)
        self._clock = clock
        self._sleep = sleep
        self._out = out or (lambda line: log.info("%s", line))
        self.stats = EmulatorStats()
        self.stopping = False
        # Simulated seconds between ticks: ``batch_window_s`` of wall time.
        self.tick_s: float | None = config.batch_window_s * config.speed
        self.client = RouterClient(
            config.base_url,
            config.router_token,
            timeout_s=config.timeout_s,
            retries=1,
            cooldown_s=2.0,
            transport=transport,
        )
        self.http = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            timeout=httpx.Timeout(config.timeout_s),
            transport=transport,
        )
        # The agent's uplink and streams: the same code a real engine's agent runs.
        self.agent_metrics = AgentMetrics()
        self.uplink = Uplink(
            config.base_url,
            config.agent_token,
            self.agent_metrics,
            client=httpx.Client(
                base_url=config.base_url.rstrip("/"),
                headers={"Authorization": f"Bearer {config.agent_token}"},
                timeout=httpx.Timeout(config.timeout_s),
                transport=transport,
            ),
        )
        self._engines: dict[str, EmulatedEngineEvents] = {}
        try:
            self.client.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            raise EmulatorError(f"cannot read the policy from {config.base_url}: {exc}") from exc
        snapshot = self.client.policy_snapshot
        assert snapshot is not None
        self.topology = snapshot.topology
        self.block_tokens = self.topology.model.block_tokens
        pd = sorted(c.name for c in self.topology.clusters if c.kind == "pd")
        if not pd:
            raise EmulatorError("the control plane's inventory has no pd cluster to emulate")
        self.pd_clusters = pd
        self.stream = RequestStream(
            workload,
            lambda origin: origin if origin in pd else pd[0],
            self.block_tokens,
            loop=config.loop,
            limit=config.requests,
        )
        self.sim = self._fleet_build(workload)
        self._inventory_roles = {i.name: i.role for i in self.topology.instances}
        self._down_by_inventory: set[str] = set()
        members: dict[str, list[str]] = {}
        for p in self.sim.prefill_instances:
            members.setdefault(p.cluster, []).append(p.name)
        self._events = scenario_faults(scenario.events, members)
        self._decisions: dict[int, routing.RouteDecision | None] = {}
        self._link_sent: dict[str, float] = {k: 0.0 for k in self.sim.links}
        # Per PD cluster, the cumulative counters an engine's histograms would give: arrivals,
        # first tokens, first tokens per TTFT bucket (fleet seconds); and the requests still
        # waiting for their first token.
        self._service: dict[str, dict[str, Any]] = {}
        self._awaiting: list[SimRequest] = []
        self._wall0 = 0.0
        self._started = 0.0
        self._sim0 = 0.0
        self._next_telemetry = 0.0
        self._next_policy = 0.0
        self._next_status = 0.0
        self._last_telemetry_wall = 0.0

    # -- building ---------------------------------------------------------------------------

    def _fleet_build(self, workload: Workload) -> Simulation:
        topo = self.topology
        block = self.block_tokens
        has_blocks = any(r.hash_ids is not None for r in workload.requests)
        longest = max((r.input_tokens for r in workload.requests), default=0)
        max_blocks = longest // block + 1
        block_bytes = [
            float(topo.prefix_bytes((i + 1) * block) - topo.prefix_bytes(i * block))
            for i in range(max_blocks)
        ]
        prefill: list[PrefillInstance] = []
        decode: list[DecodeInstance] = []
        for cluster in topo.clusters:
            spec = self.scenario.caches.get(cluster.name)
            gib = spec.gib_per_instance if spec is not None else 0.0

            def seconds(tokens: float, name: str = cluster.name) -> float:
                return topo.prefill_seconds(name, tokens)

            members = sorted(
                (i for i in topo.instances if i.cluster == cluster.name), key=lambda i: i.name
            )
            for inst in members:
                cache = (
                    ReportingPrefixCache(gib * GIB, block_bytes, topo.linear_state_bytes)
                    if has_blocks and gib > 0
                    else None
                )
                state = DOWN if inst.state == DOWN else ACTIVE
                is_prefill = inst.role == "prefill"
                prefill.append(
                    PrefillInstance(
                        inst.name,
                        cluster.name,
                        cluster.kind,
                        seconds,
                        cache,
                        state=state if is_prefill else OFF,
                    )
                )
                if cluster.kind == "pd" and cluster.decode is not None:
                    decode.append(
                        DecodeInstance(
                            inst.name,
                            cluster.name,
                            cluster.decode.max_batch,
                            cluster.decode.step_seconds,
                            cache,
                            state=OFF if is_prefill else state,
                        )
                    )
        links = {f"{link.source}->{link.target}": _fluid_link(link) for link in topo.links}
        return Simulation(
            requests=self.stream,
            prefill_instances=prefill,
            decode_instances=decode,
            links=links,
            dispatcher=self,
            block_tokens=block,
            sample_s=0.0,
        )

    # -- running ----------------------------------------------------------------------------

    def run(self) -> EmulatorStats:
        """Emulate until stopped (:meth:`stop`), ``duration_s`` passed or the workload ended."""
        self._wall0 = self._started = self._clock()
        self._sim0 = self.sim.now
        self._next_telemetry = self._wall0
        self._next_policy = self._wall0 + self.config.policy_s
        self._next_status = self._wall0 + self.config.status_s
        # Written at once (printed from the first interval on): emulate_fault refuses faults
        # while no emulator has a fresh status.
        self._status_store(final=False)
        self._kv_reset_all()
        try:
            self.sim.run()
        except _Stop:
            pass
        finally:
            self._status(final=True)
            self.uplink.flush(force=True)
            self._post_stats()
            self.client.close()
            self.http.close()
            self.uplink.close()
        return self.stats

    def stop(self) -> None:
        self.stopping = True

    def _pace(self) -> None:
        """Wait until the wall clock reaches the simulated time; stop when asked."""
        if self.stopping:
            raise _Stop
        now = self._clock()
        if self.config.duration_s is not None and now - self._started >= self.config.duration_s:
            raise _Stop
        target = self._wall0 + (self.sim.now - self._sim0) / self.config.speed
        if target > now:
            self._sleep(min(target - now, 1.0))
            if self.stopping:
                raise _Stop
        elif now - target > MAX_LAG_S:
            # Fell behind (a stalled control plane, a suspended process): carry on from now
            # rather than replay the backlog as a burst the fleet never offered.
            self._wall0 += now - target
            self._out(f"emulator: {now - target:.0f} s behind the wall clock; continuing from now")

    # -- Dispatcher protocol ----------------------------------------------------------------

    def fleet_changed(self, sim: Simulation) -> None:
        return None

    def tick(self, sim: Simulation) -> None:
        self._pace()
        now = self._clock()
        while self._events and self._events[0][0] <= sim.now - self._sim0:
            _, fault = self._events.pop(0)
            self.fault_apply(fault)
        if self.faults is not None:
            try:
                for fault in emulator_faults_pop(self.faults):
                    self.fault_apply(fault)
            except Exception as exc:  # the channel is optional; the fleet keeps running
                log.warning("emulator: fault channel unreadable: %s", exc)
        if now >= self._next_policy:
            self._next_policy = now + self.config.policy_s
            self._policy_follow()
        if now >= self._next_telemetry:
            self._next_telemetry = now + self.config.telemetry_s
            self._report(now)
        if now >= self._next_status:
            self._next_status = now + self.config.status_s
            self._status()

    def assign(self, sim: Simulation, request: SimRequest) -> Assignment | None:
        if request.index not in self._decisions:
            self._pace()
            self._route_upcoming(request)
        decision = self._decisions.pop(request.index, None)
        self._service_of(request.origin)["arrivals"] += 1
        self._awaiting.append(request)
        if decision is None:
            return None
        return self._assignment(sim, request, decision)

    def _service_of(self, cluster: str) -> dict[str, Any]:
        got = self._service.get(cluster)
        if got is None:
            got = self._service[cluster] = {
                "arrivals": 0,
                "first_tokens": 0,
                "ttft_buckets": [0] * (len(TTFT_BUCKETS_S) + 1),
                "ttft_sum_s": 0.0,
            }
        return got

    def _service_report(self, wall: float) -> list[dict[str, Any]]:
        """Count the first tokens since the last report; the counters of every PD cluster."""
        waiting = []
        for r in self._awaiting:
            if not math.isnan(r.first_token_s):
                counters = self._service_of(r.origin)
                counters["first_tokens"] += 1
                ttft = r.first_token_s - r.arrival_s
                counters["ttft_buckets"][ttft_bucket(ttft)] += 1
                counters["ttft_sum_s"] += ttft
            elif not r.dropped:
                waiting.append(r)
        self._awaiting = waiting
        return [
            {
                "cluster": name,
                "ts": wall,
                "arrivals": c["arrivals"],
                "first_tokens": c["first_tokens"],
                "ttft_buckets": list(c["ttft_buckets"]),
                "ttft_sum_s": c["ttft_sum_s"],
            }
            for name, c in sorted(self._service.items())
        ]

    # -- routing ----------------------------------------------------------------------------

    def _route_upcoming(self, first: SimRequest) -> None:
        """Ask the control plane about ``first`` and the requests arriving just after it."""
        horizon = first.arrival_s + self.config.batch_window_s * self.config.speed
        batch = self.stream.upcoming(first.index, horizon, _MAX_BATCH)
        chunks: list[list[SimRequest]] = [[]]
        hashes = 0
        for request in batch:
            n = len(request.hash_ids or ())
            if chunks[-1] and hashes + n > _MAX_HASHES_PER_CALL:
                chunks.append([])
                hashes = 0
            chunks[-1].append(request)
            hashes += n
        for chunk in chunks:
            self._route_chunk(chunk)

    def _route_request(self, request: SimRequest) -> routing.RouteRequest:
        return routing.RouteRequest(
            origin=request.origin,
            prompt_tokens=request.input_tokens,
            block_hashes=tuple(request.hash_ids or ()),
            request_id=f"emu-{request.index}",
            expected_output_tokens=request.output_tokens,
        )

    def _route_chunk(self, chunk: Sequence[SimRequest]) -> None:
        before_local = self.client.local_decisions
        try:
            if len(chunk) == 1:
                r = self._route_request(chunk[0])
                decisions = [
                    self.client.route(
                        r.origin,
                        r.prompt_tokens,
                        block_hashes=r.block_hashes,
                        request_id=r.request_id,
                        expected_output_tokens=r.expected_output_tokens,
                    )
                ]
            else:
                decisions = self.client.route_batch([self._route_request(r) for r in chunk])
        except (RouterApiError, RouterUnavailableError, routing.RouteError) as exc:
            if len(chunk) > 1:
                for request in chunk:  # one unroutable request must not sink its neighbours
                    self._route_chunk([request])
                return
            log.warning("emulator: request %s not routed: %s", chunk[0].index, exc)
            self.stats.unroutable += 1
            self._decisions[chunk[0].index] = None
            return
        local = self.client.local_decisions - before_local
        self.stats.local += local
        self.stats.remote += len(decisions) - local
        for request, decision in zip(chunk, decisions, strict=True):
            self._decisions[request.index] = decision
            self.stats.routed += 1
            self.stats.reasons[decision.reason] += 1
            if decision.route == "prfaas":
                self.stats.offloaded += 1

    def _assignment(
        self, sim: Simulation, request: SimRequest, decision: routing.RouteDecision
    ) -> Assignment | None:
        """Carry a decision out on the simulated fleet; an instance that cannot take the work
        (down, or no longer in that role) hands it to the least-loaded peer of its cluster."""
        prefill = sim.prefill_by_name.get(decision.prefill.instance)
        if prefill is None or prefill.state not in (ACTIVE,):
            prefill = self._prefill_peer(sim, decision.prefill.cluster, request.origin)
            self.stats.replaced += 1
            if prefill is None:
                return None
        decode = sim.decode_by_name.get(decision.decode.instance)
        if decode is None or decode.state != ACTIVE:
            decode = self._decode_peer(sim, request.origin)
            if decode is None:
                return None
        link = None
        if prefill.cluster != decode.cluster:
            link = sim.link_between.get((prefill.cluster, decode.cluster))
        cached = sim.cluster_match(request, prefill.cluster)
        transfer_link = None
        transfer_bytes = 0.0
        moved = decision.cache_transfer
        if moved is not None and moved.bytes > 0:
            transfer_link = sim.link_joining(moved.source_cluster, moved.target_cluster)
            if transfer_link is not None:
                transfer_bytes = float(moved.bytes)
                cached = max(cached, moved.tokens)
        kv_bytes = 0.0
        if link is not None:
            held = sim.cluster_match(request, decode.cluster)
            kv_bytes = float(self.topology.kv_transfer_bytes(request.input_tokens, held))
        return Assignment(
            route="prfaas" if link is not None else "local",
            prefill=prefill,
            decode=decode,
            cached_tokens=cached,
            reason=decision.reason,
            threshold=decision.threshold,
            link=link,
            kv_bytes=kv_bytes,
            cache_transfer_link=transfer_link,
            cache_transfer_bytes=transfer_bytes,
        )

    @staticmethod
    def _prefill_peer(sim: Simulation, cluster: str, origin: str) -> PrefillInstance | None:
        for wanted in (cluster, origin):
            peers = [p for p in sim.prefill_instances if p.cluster == wanted and p.state == ACTIVE]
            if peers:
                return min(peers, key=lambda p: (p.backlog_s(sim.now), p.name))
        return None

    @staticmethod
    def _decode_peer(sim: Simulation, cluster: str) -> DecodeInstance | None:
        peers = [d for d in sim.decode_instances if d.cluster == cluster and d.state == ACTIVE]
        return min(peers, key=lambda d: (d.load(), d.name)) if peers else None

    # -- obeying the control plane ----------------------------------------------------------

    def _policy_follow(self) -> None:
        """Re-read the policy (ETag); follow role changes and instances marked down/active."""
        try:
            changed = self.client.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            log.warning("emulator: policy not refreshed: %s", exc)
            return
        snapshot = self.client.policy_snapshot
        if not changed or snapshot is None:
            return
        self.topology = snapshot.topology
        sim = self.sim
        for inst in snapshot.topology.instances:
            name = inst.name
            known = sim.prefill_by_name.get(name) or sim.decode_by_name.get(name)
            if known is None:
                continue  # added after start: the emulator only runs the fleet it started with
            if self._inventory_roles.get(name) != inst.role:
                self._inventory_roles[name] = inst.role
                if self._sim_role(name) != inst.role and name in sim.decode_by_name:
                    sim.role_flip(name, inst.role)
                    self.stats.flips += 1
                    self._out(f"emulator: {name} drains, then serves {inst.role}")
            down = self._sim_state(name) == DOWN
            if inst.state == DOWN and not down:
                sim.instance_fail(name)
                self._down_by_inventory.add(name)
            elif inst.state != DOWN and down and name in self._down_by_inventory:
                self._down_by_inventory.discard(name)
                sim.instance_recover(name)

    def _sim_role(self, name: str) -> str:
        prefill = self.sim.prefill_by_name.get(name)
        if prefill is not None and prefill.state != OFF:
            return "prefill"
        return "decode"

    def _sim_state(self, name: str) -> str:
        prefill = self.sim.prefill_by_name.get(name)
        decode = self.sim.decode_by_name.get(name)
        for personality in (prefill, decode):
            if personality is not None and personality.state != OFF:
                return personality.state
        return OFF

    # -- faults -----------------------------------------------------------------------------

    def fault_apply(self, fault: Mapping[str, Any]) -> None:
        """Inject one fault now (already validated); unknown names are reported and skipped."""
        sim = self.sim
        kind = fault["kind"]
        self.stats.faults += 1
        if kind == "link":
            key = fault["link"]
            if key not in sim.links:
                self._out(f"emulator: no link {key} (known: {', '.join(sorted(sim.links))})")
                return
            sim._fleet_event(FleetEvent(sim.now, link=key, gbps=float(fault["gbps"])))
            self._out(f"emulator: link {key} now carries {fault['gbps']:g} Gbps")
            self._inventory_link(key, float(fault["gbps"]))
        elif kind == "instance":
            name = fault["instance"]
            if name not in sim.prefill_by_name and name not in sim.decode_by_name:
                self._out(f"emulator: no instance {name}")
                return
            if fault["state"] == DOWN:
                sim.instance_fail(name)
            else:
                self._down_by_inventory.discard(name)
                sim.instance_recover(name)
            self._out(f"emulator: instance {name} is {fault['state']}")
            self._inventory_instance(name, fault["state"])
        elif kind == "surge":
            cluster = fault.get("cluster")
            if cluster is not None and cluster not in self.stream.streams:
                self._out(f"emulator: no traffic arrives at {cluster}")
                return
            self.stream.rate_scale(float(fault["rate_scale"]), cluster)
            self._out(f"emulator: traffic x{fault['rate_scale']:g} at {cluster or 'every origin'}")
        else:
            self.stream.prompt_scale = float(fault["scale"])
            self._out(f"emulator: prompt lengths x{fault['scale']:g}")

    def _admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        if not self.config.admin_token:
            return None
        headers = {"Authorization": f"Bearer {self.config.admin_token}"}
        try:
            response = self.http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            log.warning("emulator: %s %s failed: %s", method, path, exc)
            return None
        if response.status_code >= 400:
            log.warning("emulator: %s %s: %s %s", method, path, response.status_code, response.text)
            return None
        return response

    def _inventory_link(self, key: str, gbps: float) -> None:
        """Record the link's new capacity in the inventory (admin token only)."""
        source, target = key.split("->", 1)
        listing = self._admin("GET", "/api/v1/links", params={"limit": 1000})
        if listing is None:
            return
        body = listing.json()
        items = body.get("items", body) if isinstance(body, dict) else body
        for row in items:
            if row.get("source") == source and row.get("target") == target:
                self._admin(
                    "PATCH",
                    f"/api/v1/links/{row['id']}",
                    json={"version": row["version"], "gbps": gbps},
                )

    def _inventory_instance(self, name: str, state: str) -> None:
        """Record an instance that went down or came back (admin token only)."""
        listing = self._admin("GET", "/api/v1/instances", params={"name": name})
        if listing is None:
            return
        body = listing.json()
        items = body.get("items", body) if isinstance(body, dict) else body
        for row in items:
            if row.get("name") == name and row.get("state") != state:
                self._admin(
                    "PATCH",
                    f"/api/v1/instances/{row['id']}",
                    json={"version": row["version"], "state": state},
                )

    # -- reporting --------------------------------------------------------------------------

    def _report(self, wall: float) -> None:
        """One telemetry batch (instances and links) and the KV events since the last one."""
        sim = self.sim
        interval = wall - self._last_telemetry_wall if self._last_telemetry_wall else 0.0
        self._last_telemetry_wall = wall
        instances = []
        for name in sorted(set(sim.prefill_by_name) | set(sim.decode_by_name)):
            sample = self._instance_sample(name, wall)
            if sample is not None:
                instances.append(sample)
        links = []
        for key, link in sim.links.items():
            link.advance(sim.now)
            sent = link.sent_bytes - self._link_sent[key]
            self._link_sent[key] = link.sent_bytes
            if interval > 0:
                # Fleet time runs `speed` times faster: report its rate, not the wall rate.
                links.append(
                    {
                        "source": link.source,
                        "target": link.target,
                        "ts": wall,
                        "bytes_sent": max(0, round(sent / self.config.speed)),
                        "interval_s": interval,
                    }
                )
        clusters = self._service_report(wall)
        self.uplink.telemetry_put(instances, links, clusters)
        if self.faults is not None and clusters:
            # What the emulator reported, for whoever checks the control plane's figures.
            try:
                pipe = self.faults.pipeline(transaction=False)
                pipe.lpush(SERVICE_KEY, json.dumps({"ts": wall, "clusters": clusters}))
                pipe.ltrim(SERVICE_KEY, 0, SERVICE_KEPT - 1)
                pipe.execute()
            except Exception as exc:
                log.warning("emulator: service counters not written: %s", exc)
        self._kv_report(wall)
        self.uplink.flush(force=True)
        self._post_stats()

    def _instance_sample(self, name: str, wall: float) -> dict[str, Any] | None:
        sim = self.sim
        prefill = sim.prefill_by_name.get(name)
        decode = sim.decode_by_name.get(name)
        if prefill is not None and prefill.state not in (OFF, DOWN):
            tokens = sum(r.incremental_tokens for r in prefill.queue)
            current = prefill.current
            if current is not None and current.service_s > 0:
                left = max(0.0, prefill.busy_until - sim.now) / current.service_s
                tokens += round(current.incremental_tokens * left)
            cache = prefill.cache
            return {
                "instance": name,
                "ts": wall,
                "queue_depth": prefill.depth(),
                "running": 0,
                "waiting": 0,
                "kv_usage": _usage(cache),
                "queued_prefill_tokens": tokens,
            }
        if decode is not None and decode.state not in (OFF, DOWN):
            return {
                "instance": name,
                "ts": wall,
                "queue_depth": 0,
                "running": decode.running,
                "waiting": len(decode.waiting),
                "kv_usage": min(1.0, decode.running / decode.max_batch) if decode.max_batch else 0,
            }
        return None  # down: its agent is silent

    def _caches(self) -> dict[str, ReportingPrefixCache]:
        out: dict[str, ReportingPrefixCache] = {}
        instances: list[PrefillInstance | DecodeInstance] = [
            *self.sim.prefill_instances,
            *self.sim.decode_instances,
        ]
        for instance in instances:
            if isinstance(instance.cache, ReportingPrefixCache):
                out[instance.name] = instance.cache
        return out

    def _engine(self, name: str) -> EmulatedEngineEvents:
        engine = self._engines.get(name)
        if engine is None:
            # a new engine process: its stream resumes after what the index last applied, and
            # the engine's seq 0 tells the control plane to start the instance afresh
            stream = KvStream(
                name,
                self.uplink.kv_batch_put,
                self.agent_metrics,
                last_seq=self.uplink.kv_last_seq(name),
            )
            engine = self._engines[name] = EmulatedEngineEvents(stream)
        return engine

    def _kv_reset_all(self) -> None:
        """Fresh engines: each publishes an empty batch at seq 0, as a vLLM that just started
        does with its first step, so the index forgets the previous run's entries."""
        for name in sorted(self._caches()):
            self._engine(name).publish([], self._clock())
        self.uplink.flush(force=True)

    def _kv_report(self, wall: float) -> None:
        for name, cache in sorted(self._caches().items()):
            events = cache.take_events()
            for start in range(0, len(events), _MAX_HASHES_PER_BATCH):
                part = events[start : start + _MAX_HASHES_PER_BATCH]
                self._engine(name).publish(kv_batch_events(part, self.block_tokens), wall)

    def _post_stats(self) -> None:
        """The emulator's post counters, read from the agent's own metrics."""
        ok = errors = 0
        kv = telemetry = 0
        for metric in self.agent_metrics.posts.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                path, outcome = sample.labels["endpoint"], sample.labels["outcome"]
                if outcome == "ok":
                    ok += int(sample.value)
                    kv += int(sample.value) if path == KV_PATH else 0
                    telemetry += int(sample.value) if path == TELEMETRY_PATH else 0
                else:
                    errors += int(sample.value)
        self.stats.kv_posts, self.stats.telemetry_posts = kv, telemetry
        self.stats.post_errors = errors

    def _status(self, final: bool = False) -> None:
        s = self.stats
        elapsed = max(1e-9, self._clock() - self._started)
        lag = (self._wall0 + (self.sim.now - self._sim0) / self.config.speed) - self._clock()
        mix = ", ".join(f"{k} {v}" for k, v in s.reasons.most_common(4))
        line = (
            f"emulator: {elapsed:.0f} s, fleet clock {self.sim.now:.0f} s, {s.routed} routed "
            f"({s.routed / elapsed:.1f}/s, {s.offloaded} offloaded, {s.local} decided locally), "
            f"in system {self.sim.in_system}, dropped {self.sim.dropped}; {mix}"
        )
        if lag < -5:
            line += f"; {-lag:.0f} s behind the wall clock"
        self._out(line + (" (stopped)" if final else ""))
        self._status_store(final)

    def _status_store(self, final: bool) -> None:
        """The status line's figures in Redis (``STATUS_KEY``), for ``emulate_fault``."""
        s = self.stats
        if self.faults is not None:
            status = {
                "ts": self._clock(),
                "fleet_clock_s": self.sim.now,
                "routed": s.routed,
                "offloaded": s.offloaded,
                "local_decisions": s.local,
                "dropped": self.sim.dropped,
                "in_system": self.sim.in_system,
                "reasons": dict(s.reasons),
                "stopped": final,
            }
            try:
                self.faults.set(STATUS_KEY, json.dumps(status), ex=3600)
            except Exception as exc:
                log.warning("emulator: status not written: %s", exc)


def _fluid_link(link: routing.LinkSpec) -> FluidLink:
    return FluidLink(link.source, link.target, link.gbps * 1e9 / 8, link.rtt_ms / 1000.0)


def _usage(cache: HybridPrefixCache | None) -> float:
    if cache is None or cache.capacity_bytes <= 0:
        return 0.0
    return min(1.0, cache.used_bytes / cache.capacity_bytes)
