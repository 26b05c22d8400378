"""Routing in the simulator: the project's pure router, fed by the simulated fleet.

:class:`RouterDispatcher` turns each simulated request into a
:class:`scheduling.core.routing.RouteRequest`, gives :func:`scheduling.core.routing.route_decide` a
:class:`~scheduling.core.routing.LiveState` read off the simulated fleet (prefill backlogs, decode
batches, link egress and reserved in-flight bytes, prefix matches from the simulated caches)
and carries out the :class:`~scheduling.core.routing.RouteDecision`. The topology is built once and
rebuilt only when the fleet changes shape (role flips, link capacity).

``routing_length="prompt"`` hides the caches from the router (it then routes by prompt
length); prefill still reuses whatever its cluster has cached, so the comparison with
``"incremental"`` isolates the routing input.

With ``dynamic=True`` (``prfaas-dual``) the short-term controller runs before every decision:
:func:`scheduling.core.routing.control_signals` and :func:`scheduling.core.routing.control_update` move the
effective threshold of the request's origin on the simulated clock. The long-term loop is a
:class:`Replanner` ticked every ``tick_s`` seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from scheduling.core import routing
from scheduling.core.link import Link
from scheduling.core.simulator.engine import OFF, Assignment, Simulation
from scheduling.core.simulator.fleet import DOWN, SimRequest

ROUTING_LENGTHS = ("incremental", "prompt")


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """One cluster as a simulation runs it: its hardware and how many instances of each role."""

    name: str
    kind: str  # "prfaas" or "pd"
    accelerator: str
    prefill_seconds: tuple[tuple[float, float], ...]
    n_prefill: int
    n_decode: int = 0
    max_batch: int = 0
    step_seconds: float = 0.0
    cache_gib_per_instance: float = 0.0
    site: str = ""


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """A whole configuration to simulate: clusters, links, thresholds per PD cluster."""

    policy: str
    clusters: tuple[ClusterPlan, ...]
    links: tuple[Link, ...]
    thresholds: Mapping[str, int]
    planned_capacity_rps: float | None = None


@dataclass(frozen=True, slots=True)
class ReplanInput:
    """What the long-term loop sees of one PD cluster at a tick."""

    cluster: str
    now: float
    window_start_s: float
    requests: Sequence[SimRequest]  # arrived at this origin within the window
    threshold: float
    prefill: tuple[str, ...]  # active prefill instances, by name
    decode: tuple[str, ...]
    loads: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Replan:
    """The long-term loop's answer for one PD cluster: a new threshold and role flips."""

    threshold: float
    flips: tuple[tuple[str, str], ...] = ()  # (instance, new role)


class Replanner(Protocol):
    """The long-term decision, on the simulated clock (``None``: keep everything)."""

    def replan(self, inp: ReplanInput) -> Replan | None: ...


def topology_build(
    model: routing.ModelSpec,
    plan: FleetPlan,
    roles: Mapping[str, str],
    link_gbps: Mapping[str, float],
) -> routing.Topology:
    """The router's topology for the fleet as it is now (only each instance's active role)."""
    clusters = []
    for c in plan.clusters:
        decode = routing.DecodeProfile(c.max_batch, c.step_seconds) if c.kind == "pd" else None
        clusters.append(
            routing.ClusterSpec(c.name, c.kind, c.prefill_seconds, c.accelerator, c.site, decode)
        )
    instances = [
        routing.InstanceSpec(name, name.rsplit("-", 1)[0], role) for name, role in roles.items()
    ]
    links = [
        # The router needs a positive capacity; a cut link reads as saturated. A budget of
        # None is the router's default, from the capacity now (as the server's snapshot).
        replace(link, gbps=max(link_gbps.get(link.key, link.gbps), 1e-9))
        for link in plan.links
    ]
    return routing.Topology(model, tuple(clusters), tuple(instances), tuple(links))


@dataclass(eq=False)
class RouterDispatcher:
    """Places every simulated request with :func:`scheduling.core.routing.route_decide`."""

    model: routing.ModelSpec
    plan: FleetPlan
    policy: routing.RoutingPolicy
    dynamic: bool = False
    routing_length: str = "incremental"
    replanner: Replanner | None = None
    tick_s: float | None = None
    topology: routing.Topology = field(init=False)
    control: dict[str, routing.ControlState] = field(default_factory=dict)
    decisions: int = 0
    replans: list[tuple[float, str, float, int, int]] = field(default_factory=list)
    _window_start: float = 0.0
    _seen: int = 0
    _load_memo: dict[str, tuple[tuple[object, ...], routing.InstanceLoad]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.routing_length not in ROUTING_LENGTHS:
            raise ValueError(f"routing_length must be one of {ROUTING_LENGTHS}")
        if self.replanner is None:
            self.tick_s = None
        roles: dict[str, str] = {}
        for c in self.plan.clusters:
            for i in range(c.n_prefill + c.n_decode):
                roles[f"{c.name}-{i}"] = "prefill" if i < c.n_prefill else "decode"
        self.topology = topology_build(self.model, self.plan, roles, {})

    # -- Dispatcher protocol ------------------------------------------------------------------

    def fleet_changed(self, sim: Simulation) -> None:
        roles: dict[str, str] = {}
        for prefill in sim.prefill_instances:
            if prefill.state != OFF:
                roles[prefill.name] = "prefill"
        for decode in sim.decode_instances:
            if decode.state != OFF:
                roles[decode.name] = "decode"
        gbps = {key: link.capacity_bps * 8 / 1e9 for key, link in sim.links.items()}
        self.topology = topology_build(self.model, self.plan, roles, gbps)

    def live_state(self, sim: Simulation) -> routing.LiveState:
        """The fleet as telemetry would report it right now (always fresh in simulation)."""
        now = sim.now
        loads: dict[str, routing.InstanceLoad] = {}
        memo = self._load_memo
        for prefill in sim.prefill_instances:
            state = prefill.state
            if state == OFF:
                continue
            if prefill.current is None and not prefill.queue:
                # Idle instances report the same load until they get work: reuse it.
                key: tuple[object, ...] = (state,)
                cached = memo.get(prefill.name)
                if cached is None or cached[0] != key:
                    cached = (key, routing.InstanceLoad(state=state))
                    memo[prefill.name] = cached
                loads[prefill.name] = cached[1]
            else:
                loads[prefill.name] = routing.InstanceLoad(
                    queue_depth=len(prefill.queue) + 1,
                    queued_prefill_s=prefill.backlog_s(now),
                    state=state,
                )
        for decode in sim.decode_instances:
            state = decode.state
            if state == OFF:
                continue
            key = (state, decode.running, decode.assigned)
            cached = memo.get(decode.name)
            if cached is None or cached[0] != key:
                cached = (
                    key,
                    routing.InstanceLoad(
                        running=decode.running,
                        # Waiting for a slot or still on the way (the engine holds it already).
                        waiting=decode.assigned,
                        # Blocks are held for the KV on its way too (allocated on arrival).
                        kv_usage=min(1.0, (decode.running + decode.assigned) / decode.max_batch),
                        state=state,
                    ),
                )
                memo[decode.name] = cached
            loads[decode.name] = cached[1]
        # In flight = bytes reserved, as the server counts them (scheduling.core.link): from
        # the decision (a request queued for its PrfaaS prefill holds its KV's bytes already)
        # until its transfer has landed.
        links = {
            (link.source, link.target): routing.LinkLoad(
                egress_gbps=sum(f.rate for f in link.flows) * 8 / 1e9,
                inflight_bytes=math.ceil(max(0.0, link.reserved_bytes)),
                updated_at=now,
            )
            for link in sim.links.values()
        }
        return routing.LiveState(now=now, instances=loads, links=links, telemetry_at=now)

    def assign(self, sim: Simulation, request: SimRequest) -> Assignment | None:
        live = self.live_state(sim)
        topology = self.topology
        if self.dynamic:
            origin = request.origin
            state = self.control.get(origin) or routing.control_initial(sim.now)
            signals = routing.control_signals(origin, topology, live)
            state = routing.control_update(state, signals, self.policy.guards, sim.now)
            self.control[origin] = state
            live = routing.LiveState(
                now=live.now,
                instances=live.instances,
                links=live.links,
                control=self.control,
                telemetry_at=live.telemetry_at,
            )
        aware = self.routing_length == "incremental"
        matches = self._prefix_matches(sim, request) if aware else ()
        cached = (
            {request.origin: request.hinted_cached_tokens}
            if (aware and request.hinted_cached_tokens)
            else {}
        )
        route_request = routing.RouteRequest(
            origin=request.origin,
            prompt_tokens=request.input_tokens,
            prefix_matches=matches,
            cached_tokens=cached,
            request_id=str(request.index),
        )
        try:
            decision = routing.route_decide(route_request, self.policy, topology, live)
        except routing.RouteUnavailable:
            return None
        self.decisions += 1
        prefill = sim.prefill_by_name[decision.prefill.instance]
        decode = sim.decode_by_name[decision.decode.instance]
        route = decision.route
        link = (
            sim.link_between.get((prefill.cluster, decode.cluster)) if route == "prfaas" else None
        )
        cached_tokens = decision.cached_tokens
        kv_bytes = float(decision.kv_bytes)
        if not aware:
            # Blind routing, but the engines still reuse what their clusters hold.
            cached_tokens = sim.cluster_match(request, prefill.cluster)
            held = sim.cluster_match(request, decode.cluster)
            kv_bytes = float(topology.kv_transfer_bytes(request.input_tokens, held))
        transfer_link = None
        transfer_bytes = 0.0
        moved = decision.cache_transfer
        if moved is not None and moved.bytes > 0:
            transfer_link = sim.link_joining(moved.source_cluster, moved.target_cluster)
            transfer_bytes = float(moved.bytes)
        return Assignment(
            route=route,
            prefill=prefill,
            decode=decode,
            cached_tokens=cached_tokens,
            reason=decision.reason,
            threshold=decision.threshold,
            link=link,
            kv_bytes=kv_bytes if link is not None else 0.0,
            cache_transfer_link=transfer_link,
            cache_transfer_bytes=transfer_bytes,
        )

    def _prefix_matches(
        self, sim: Simulation, request: SimRequest
    ) -> tuple[routing.PrefixMatch, ...]:
        """Usable prefixes in the simulated caches: per prefill instance, and each cluster's
        decode-side pool (reachable over RDMA from any of its prefill instances)."""
        if request.hash_ids is None:
            return ()
        out: list[routing.PrefixMatch] = []
        for prefill in sim.prefill_instances:
            if prefill.state in (OFF, DOWN) or prefill.cache is None:
                continue
            tokens = sim.prefix_match(request, prefill.cache)
            if tokens > 0:
                out.append(routing.PrefixMatch(prefill.cluster, tokens, prefill.name))
        pools: dict[str, int] = {}
        for decode in sim.decode_instances:
            if decode.state in (OFF, DOWN) or decode.cache is None:
                continue
            tokens = sim.prefix_match(request, decode.cache)
            if tokens > pools.get(decode.cluster, 0):
                pools[decode.cluster] = tokens
        out.extend(routing.PrefixMatch(cluster, tokens) for cluster, tokens in pools.items())
        return tuple(out)

    # -- long term ----------------------------------------------------------------------------

    def tick(self, sim: Simulation) -> None:
        if self.replanner is None:
            return
        now = sim.now
        arrived = sim.requests[self._seen : sim.arrived]
        self._seen = sim.arrived
        start = self._window_start
        self._window_start = now
        thresholds = dict(self.policy.thresholds)
        changed = False
        for cluster in self.plan.clusters:
            if cluster.kind != "pd":
                continue
            name = cluster.name
            prefill = tuple(
                p.name for p in sim.prefill_instances if p.cluster == name and p.state != OFF
            )
            decode = tuple(
                d.name for d in sim.decode_instances if d.cluster == name and d.state != OFF
            )
            loads = {p: sim.prefill_by_name[p].backlog_s(now) for p in prefill}
            loads.update({d: sim.decode_by_name[d].load() for d in decode})
            answer = self.replanner.replan(
                ReplanInput(
                    cluster=name,
                    now=now,
                    window_start_s=start,
                    requests=[r for r in arrived if r.origin == name],
                    threshold=self.policy.threshold(name),
                    prefill=prefill,
                    decode=decode,
                    loads=loads,
                )
            )
            if answer is None:
                continue
            if math.isfinite(answer.threshold):
                thresholds[name] = round(answer.threshold)
                changed = True
            for instance, role in answer.flips:
                sim.role_flip(instance, role)
            to_prefill = sum(1 for _, role in answer.flips if role == "prefill")
            to_decode = len(answer.flips) - to_prefill
            # The split this re-plan moves to (flips complete once their instances drain).
            self.replans.append(
                (
                    now,
                    name,
                    answer.threshold,
                    len(prefill) + to_prefill - to_decode,
                    len(decode) + to_decode - to_prefill,
                )
            )
        if changed:
            self.policy = routing.RoutingPolicy(
                version=self.policy.version + 1, thresholds=thresholds, guards=self.policy.guards
            )
