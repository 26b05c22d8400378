"""Run one simulation: build the configuration, replay the workload, measure.

:func:`simulate` is the entry point the CLI, the capacity search, the bench and the tests
share. It returns a :class:`SimulationResult` (plain data; :meth:`SimulationResult.to_dict`
gives the CLI's ``--json`` object).
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduling.core import routing
from scheduling.core.link import link_key
from scheduling.core.planner import (
    DEFAULT_LOAD,
    PlanResult,
    fleet_from_scenario,
    plan_scenario,
    plan_workload,
)
from scheduling.core.prefix_cache import HybridPrefixCache, prefix_block_bytes
from scheduling.core.scenario import LinkEvent, Scenario, StateEvent
from scheduling.core.scenario_fleet import trace_workload
from scheduling.core.simulator.engine import OFF, FleetEvent, Simulation
from scheduling.core.simulator.fleet import ACTIVE, DecodeInstance, PrefillInstance, SimRequest
from scheduling.core.simulator.link import FluidLink
from scheduling.core.simulator.policies import fleet_plan, origin_map
from scheduling.core.simulator.replan import PlannerReplanner
from scheduling.core.simulator.routing import FleetPlan, Replanner, RouterDispatcher
from scheduling.core.simulator.workload import Workload, workload_build
from scheduling.core.trace import trace_read

GIB = float(1 << 30)

#: A run keeps up with its load when completions while arrivals last, after warm-up, are at
#: least this share of the offered rate (``SimulationResult.sustained_fraction``): the one
#: criterion of the project (capacity search, agreement, brute force).
MIN_SUSTAINED = 0.97


@dataclass(frozen=True)
class SimulationConfig:
    """How to run: policy, load, length of the run and options (CLI flags map one to one)."""

    policy: str = "prfaas"
    rate_per_s: float | None = None
    requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    skip_bad: bool = False
    threshold: float | None = None
    ttft_slo_s: float | None = None
    routing_length: str = "incremental"
    replan_interval_s: float = 600.0
    sample_s: float | None = None  # queue sampling period; None: about 2,000 samples a run
    stability_tolerance: float = 0.02  # backlog growth allowed, as a share of the arrival rate


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class LinkReport:
    """One link over the run: bytes and the per-second utilisation series."""

    key: str
    capacity_gbps: float
    mean_gbps: float
    p99_gbps: float
    peak_gbps: float
    sent_bytes: float
    delivered_bytes: float
    aborted_bytes: float
    series_gbps: tuple[float, ...]


@dataclass(frozen=True)
class SimulationResult:
    """What one run measured (times in seconds, rates per second of simulated time)."""

    scenario: str
    policy: str
    seed: int
    offered_rate_rps: float
    requests: int
    finished: int
    dropped: int
    dropped_by_reason: dict[str, int]
    skipped_lines: tuple[int, ...]
    redispatched: int
    duration_s: float
    throughput_rps: float
    ttft: Percentiles
    tpot_mean_s: float
    tpot_p99_s: float
    slo_attainment: float
    goodput_rps: float
    offload_fraction: float
    cache_hit_fraction: float
    cache_hit_request_fraction: float
    kv_bytes_offloaded: float
    cache_transfer_bytes: float
    links: tuple[LinkReport, ...]
    queue_t: tuple[float, ...]
    queue_in_system: tuple[int, ...]
    queue_prefill: dict[str, tuple[int, ...]]
    queue_decode: dict[str, tuple[int, ...]]
    mean_in_system: float
    mean_sojourn_s: float
    backlog_growth_rps: float
    stable: bool
    thresholds: dict[str, int]
    split: dict[str, tuple[int, int]]
    planned_capacity_rps: float | None
    replans: tuple[tuple[float, str, float, int, int], ...]
    wall_s: float
    reasons: dict[str, int] = field(default_factory=dict)
    per_request: tuple[SimRequest, ...] = ()
    #: completions per second while arrivals last, after the first tenth of them (warm-up):
    #: the rate the fleet keeps up with. ``throughput_rps`` spans the run to its last
    #: completion, so even a fleet that keeps up reads below the offered rate by the drain.
    sustained_rps: float = math.nan

    @property
    def sustained_fraction(self) -> float:
        """Sustained throughput as a share of the offered rate."""
        if not self.offered_rate_rps > 0:
            return math.nan
        return self.sustained_rps / self.offered_rate_rps

    @property
    def link_mean_gbps(self) -> float:
        return sum(link.mean_gbps for link in self.links)

    @property
    def link_p99_gbps(self) -> float:
        if not self.links:
            return 0.0
        width = max(len(link.series_gbps) for link in self.links)
        total = np.zeros(width)
        for link in self.links:
            total[: len(link.series_gbps)] += np.asarray(link.series_gbps)
        return float(np.percentile(total, 99)) if width else 0.0

    @property
    def sustained(self) -> bool:
        """Queues stable (no backlog trend) and at least MIN_SUSTAINED of the load completed.

        Requests the router cannot place (``no_capacity``: e.g. a fleet without local prefill
        whose only link's budget is full) are losses, not a growing queue: a fleet that refuses
        a steady 1.5% of its load has no backlog trend and loses some request in any long
        enough run, so "nothing dropped" would make the verdict depend on the run's length.
        The share completed is what the rest of the project holds a fleet to. A run too short
        to measure it (under ten requests) falls back on "nothing dropped".
        """
        if not self.stable:
            return False
        fraction = self.sustained_fraction
        if math.isnan(fraction):
            return self.dropped_by_reason.get("no_capacity", 0) == 0
        return fraction >= MIN_SUSTAINED

    def to_dict(self) -> dict[str, Any]:
        ttft = self.ttft
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "seed": self.seed,
            "rate_rps": self.offered_rate_rps,
            "requests": self.requests,
            "finished": self.finished,
            "dropped": self.dropped,
            "dropped_by_reason": dict(self.dropped_by_reason),
            "skipped": len(self.skipped_lines),
            "skipped_lines": list(self.skipped_lines[:100]),
            "redispatched": self.redispatched,
            "duration_s": self.duration_s,
            "throughput_rps": self.throughput_rps,
            "sustained_rps": self.sustained_rps,
            "sustained_fraction": self.sustained_fraction,
            "ttft": {"mean": ttft.mean, "p50": ttft.p50, "p90": ttft.p90, "p99": ttft.p99},
            "tpot": {"mean": self.tpot_mean_s, "p99": self.tpot_p99_s},
            "slo_attainment": self.slo_attainment,
            "goodput_rps": self.goodput_rps,
            "offload_fraction": self.offload_fraction,
            "cache_hit_fraction": self.cache_hit_fraction,
            "cache_hit_request_fraction": self.cache_hit_request_fraction,
            "kv_bytes_offloaded": self.kv_bytes_offloaded,
            "cache_transfer_bytes": self.cache_transfer_bytes,
            "link": {
                "mean_gbps": self.link_mean_gbps,
                "p99_gbps": self.link_p99_gbps,
                "links": {
                    link.key: {
                        "capacity_gbps": link.capacity_gbps,
                        "mean_gbps": link.mean_gbps,
                        "p99_gbps": link.p99_gbps,
                        "peak_gbps": link.peak_gbps,
                        "sent_bytes": link.sent_bytes,
                        "delivered_bytes": link.delivered_bytes,
                        "aborted_bytes": link.aborted_bytes,
                    }
                    for link in self.links
                },
            },
            "queues": {
                "mean_in_system": self.mean_in_system,
                "max_in_system": max(self.queue_in_system, default=0),
                "max_prefill_queued": {k: max(v, default=0) for k, v in self.queue_prefill.items()},
                "max_decode_waiting": {k: max(v, default=0) for k, v in self.queue_decode.items()},
                "backlog_growth_rps": self.backlog_growth_rps,
                "stable": self.stable,
            },
            "mean_sojourn_s": self.mean_sojourn_s,
            "reasons": dict(self.reasons),
            "thresholds": dict(self.thresholds),
            "split": {k: {"n_p": v[0], "n_d": v[1]} for k, v in self.split.items()},
            "planned_capacity_rps": self.planned_capacity_rps,
            "replans": len(self.replans),
            "wall_s": self.wall_s,
        }


def _percentiles(values: np.ndarray) -> Percentiles:
    if values.size == 0:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Percentiles(float(values.mean()), float(p50), float(p90), float(p99))


def _sustained_rps(requests: Sequence[SimRequest]) -> float:
    """Completions per second over ``[t10, t_last]``: from the arrival of the first tenth of
    the requests (the fleet has filled up) to the last arrival (see SimulationResult)."""
    if len(requests) < 10:
        return math.nan
    start = requests[len(requests) // 10].arrival_s
    end = requests[-1].arrival_s
    if not end > start:
        return math.nan
    done = sum(1 for r in requests if not r.dropped and start <= r.finish_s <= end)
    return done / (end - start)


def _growth(t: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``y`` over ``t`` (0 with too few points)."""
    if t.size < 3 or float(np.ptp(t)) <= 0:
        return 0.0
    tc = t - t.mean()
    return float(np.dot(tc, y - y.mean()) / np.dot(tc, tc))


def simulation_build(
    scenario: Scenario,
    fleet: FleetPlan,
    workload: Workload,
    config: SimulationConfig,
    *,
    replanner: Replanner | None = None,
) -> tuple[Simulation, RouterDispatcher]:
    """The simulated fleet for ``fleet`` and the dispatcher that routes through the routing."""
    model = routing.ModelSpec(
        scenario.model.name,
        scenario.model.block_tokens,
        tuple(scenario.model.kv_cache_mib),
        scenario.model.linear_state_mib,
    )
    dynamic = fleet.policy == "prfaas-dual"
    policy = routing.RoutingPolicy(version=1, thresholds=dict(fleet.thresholds))
    if dynamic and replanner is None:
        replanner = PlannerReplanner(scenario)
    dispatcher = RouterDispatcher(
        model,
        fleet,
        policy,
        dynamic=dynamic,
        routing_length=config.routing_length,
        replanner=replanner if dynamic else None,
        tick_s=config.replan_interval_s if dynamic else None,
    )
    topology = dispatcher.topology
    block = scenario.model.block_tokens
    has_blocks = any(r.hash_ids is not None for r in workload.requests)
    max_blocks = max((r.input_tokens // block for r in workload.requests), default=0) + 1
    block_bytes = prefix_block_bytes(topology.prefix_bytes, block, max_blocks)

    def cache_for(gib: float) -> HybridPrefixCache | None:
        if not has_blocks or gib <= 0:
            return None
        return HybridPrefixCache(gib * GIB, block_bytes, topology.linear_state_bytes)

    prefill: list[PrefillInstance] = []
    decode: list[DecodeInstance] = []
    for cluster in fleet.clusters:
        seconds = functools.partial(topology.prefill_seconds, cluster.name)
        for i in range(cluster.n_prefill + cluster.n_decode):
            name = f"{cluster.name}-{i}"
            cache = cache_for(cluster.cache_gib_per_instance)
            is_prefill = i < cluster.n_prefill
            prefill.append(
                PrefillInstance(
                    name,
                    cluster.name,
                    cluster.kind,
                    seconds,
                    cache,
                    state=ACTIVE if is_prefill else OFF,
                )
            )
            if cluster.kind == "pd":
                decode.append(
                    DecodeInstance(
                        name,
                        cluster.name,
                        cluster.max_batch,
                        cluster.step_seconds,
                        cache,
                        state=OFF if is_prefill else ACTIVE,
                    )
                )
    links = {
        link_key(link.source, link.target): FluidLink(
            link.source, link.target, link.gbps * 1e9 / 8, link.rtt_ms / 1000.0
        )
        for link in fleet.links
    }
    names = {p.name for p in prefill} | {d.name for d in decode}
    cluster_names = {c.name for c in fleet.clusters}
    events: list[FleetEvent] = []
    for event in scenario.events:
        if isinstance(event, LinkEvent):
            key = link_key(event.source, event.target)
            if key in links:
                events.append(FleetEvent(event.at_s, link=key, gbps=event.gbps))
        elif isinstance(event, StateEvent) and (
            event.instance in names or event.cluster in cluster_names
        ):
            events.append(
                FleetEvent(
                    event.at_s,
                    instance=event.instance,
                    cluster=event.cluster,
                    state=event.state,
                )
            )
    origins = origin_map(fleet, {r.origin: 1.0 for r in workload.requests})
    requests = [
        SimRequest(
            index,
            spec.arrival_s,
            spec.input_tokens,
            spec.output_tokens,
            origins[spec.origin],
            spec.hash_ids,
            spec.cached_tokens,
        )
        for index, spec in enumerate(workload.requests)
    ]
    span = workload.duration_s
    sample_s = config.sample_s or max(span / 2000.0, 0.05)
    sim = Simulation(
        requests=requests,
        prefill_instances=prefill,
        decode_instances=decode,
        links=links,
        dispatcher=dispatcher,
        block_tokens=block,
        fleet_events=events,
        sample_s=sample_s,
    )
    return sim, dispatcher


def plan_for(
    scenario: Scenario, *, skip_bad: bool = False, load: float = DEFAULT_LOAD
) -> PlanResult:
    """The planner's answer for the scenario's traffic, planned to run at ``load`` of its
    capacity. A trace is planned from the rows this simulator's reader accepts (so
    ``skip_bad`` applies), as an empirical distribution."""
    workload = scenario.workload
    if workload is None or workload.trace is None:
        return plan_scenario(scenario, load=load)
    spec = workload.trace
    read = trace_read(
        spec.path, spec.format, skip_bad=skip_bad, block_tokens=scenario.model.block_tokens
    )
    return plan_workload(
        fleet_from_scenario(scenario), trace_workload(scenario, read.rows), load=load
    )


def simulate(
    scenario: Scenario,
    config: SimulationConfig,
    *,
    plan: PlanResult | None = None,
    fleet: FleetPlan | None = None,
    workload: Workload | None = None,
    replanner: Replanner | None = None,
    keep_requests: bool = False,
) -> SimulationResult:
    """Simulate ``config.policy`` on ``scenario``; ``plan``/``fleet``/``workload`` may be
    passed in to reuse them across runs (a capacity search plans once)."""
    started = time.perf_counter()
    if fleet is None:
        if plan is None:
            plan = plan_for(scenario, skip_bad=config.skip_bad)
        fleet = fleet_plan(scenario, config.policy, plan, threshold=config.threshold)
    if workload is None:
        workload = workload_build(
            scenario,
            rate_per_s=config.rate_per_s,
            seed=config.seed,
            requests=config.requests,
            duration_s=config.duration_s,
            skip_bad=config.skip_bad,
        )
    sim, dispatcher = simulation_build(scenario, fleet, workload, config, replanner=replanner)
    sim.run()
    return result_build(scenario, fleet, workload, config, sim, dispatcher, started, keep_requests)


def _slo_tpot(scenario: Scenario) -> float:
    return 1.0 / scenario.slo.decode_tokens_per_s if scenario.slo is not None else math.inf


def result_build(
    scenario: Scenario,
    fleet: FleetPlan,
    workload: Workload,
    config: SimulationConfig,
    sim: Simulation,
    dispatcher: RouterDispatcher,
    started: float,
    keep_requests: bool,
) -> SimulationResult:
    requests: Sequence[SimRequest] = sim.requests
    done = [r for r in requests if not r.dropped and not math.isnan(r.finish_s)]
    arrival = np.array([r.arrival_s for r in done])
    first_token = np.array([r.first_token_s for r in done])
    finish = np.array([r.finish_s for r in done])
    outputs = np.array([r.output_tokens for r in done], dtype=float)
    ttft = first_token - arrival
    tpot = (finish - first_token) / np.maximum(outputs, 1.0)
    start = requests[0].arrival_s if requests else 0.0
    last_arrival = requests[-1].arrival_s if requests else 0.0
    end = float(finish.max()) if finish.size else start
    duration = max(end - start, 1e-9)
    offered = (len(requests) - 1) / (last_arrival - start) if last_arrival > start else 0.0
    slo_tpot = _slo_tpot(scenario)
    meets = tpot <= slo_tpot * (1 + 1e-9)
    if config.ttft_slo_s is not None:
        meets &= ttft <= config.ttft_slo_s
    attainment = float(meets.mean()) if meets.size else 0.0
    routed = [r for r in requests if r.route]
    offloaded = sum(1 for r in routed if r.route == "prfaas")
    prompt_tokens = sum(r.input_tokens for r in routed)
    cached_tokens = sum(r.cached_tokens for r in routed)
    reports = []
    for key, link in sim.links.items():
        series = np.asarray(link.buckets, dtype=float) * 8 / 1e9 / link.bucket_s
        span = max(duration, link.bucket_s)
        reports.append(
            LinkReport(
                key=key,
                capacity_gbps=next((lp.gbps for lp in fleet.links if lp.key == key), 0.0),
                mean_gbps=link.sent_bytes * 8 / 1e9 / span,
                p99_gbps=float(np.percentile(series, 99)) if series.size else 0.0,
                peak_gbps=float(series.max()) if series.size else 0.0,
                sent_bytes=link.sent_bytes,
                delivered_bytes=link.delivered_bytes,
                aborted_bytes=link.aborted_bytes,
                series_gbps=tuple(series.tolist()),
            )
        )
    samples = sim.samples
    t = np.array([s.t for s in samples])
    in_system = np.array([s.in_system for s in samples])
    half = (t >= start + (last_arrival - start) / 2) & (t <= last_arrival)
    growth = _growth(t[half], in_system[half].astype(float))
    stable = growth <= config.stability_tolerance * max(offered, 1e-12)
    clusters = sorted({c for s in samples for c in s.prefill_queued})
    dclusters = sorted({c for s in samples for c in s.decode_waiting})
    sojourn = (finish - arrival) if done else np.array([])
    sustained = _sustained_rps(requests)
    dropped = Counter(r.dropped for r in requests if r.dropped)
    reasons = Counter(r.reason for r in routed)
    split = {}
    for cluster in fleet.clusters:
        if cluster.kind == "pd":
            n_p = sum(
                1 for p in sim.prefill_instances if p.cluster == cluster.name and p.state != OFF
            )
            n_d = sum(
                1 for d in sim.decode_instances if d.cluster == cluster.name and d.state != OFF
            )
            split[cluster.name] = (n_p, n_d)
    return SimulationResult(
        scenario=scenario.name,
        policy=fleet.policy,
        seed=config.seed,
        offered_rate_rps=offered,
        requests=len(requests),
        finished=len(done),
        dropped=sim.dropped,
        dropped_by_reason=dict(dropped),
        skipped_lines=workload.skipped_lines,
        redispatched=sim.redispatched,
        duration_s=duration,
        throughput_rps=len(done) / duration,
        ttft=_percentiles(ttft),
        tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
        tpot_p99_s=float(np.percentile(tpot, 99)) if tpot.size else math.nan,
        slo_attainment=attainment,
        goodput_rps=float(meets.sum()) / duration,
        offload_fraction=offloaded / len(routed) if routed else 0.0,
        cache_hit_fraction=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        cache_hit_request_fraction=(
            sum(1 for r in routed if r.cached_tokens > 0) / len(routed) if routed else 0.0
        ),
        kv_bytes_offloaded=sum(r.kv_bytes for r in routed if r.route == "prfaas"),
        cache_transfer_bytes=sum(r.cache_transfer_bytes for r in routed),
        links=tuple(reports),
        queue_t=tuple(t.tolist()),
        queue_in_system=tuple(int(x) for x in in_system),
        queue_prefill={c: tuple(s.prefill_queued.get(c, 0) for s in samples) for c in clusters},
        queue_decode={c: tuple(s.decode_waiting.get(c, 0) for s in samples) for c in dclusters},
        mean_in_system=sim.area / duration,
        mean_sojourn_s=float(sojourn.mean()) if sojourn.size else math.nan,
        backlog_growth_rps=growth,
        stable=bool(stable),
        thresholds=dict(dispatcher.policy.thresholds),
        split=split,
        planned_capacity_rps=fleet.planned_capacity_rps,
        replans=tuple(dispatcher.replans),
        wall_s=time.perf_counter() - started,
        reasons=dict(reasons),
        per_request=tuple(requests) if keep_requests else (),
        sustained_rps=sustained,
    )
