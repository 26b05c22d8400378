"""Simulate a rebalancer's candidate against the current setting on the recent traffic, in
bounded time, before it is proposed (issue 12: proposals are simulated before they are shown).

Pure: no Django. The traffic is each PD cluster's own window: Poisson arrivals at its observed
rate, prompts drawn from its histogram of incremental lengths, its mean output length (each
origin drawn on its own seeded stream, then merged). Both settings run on the same requests
(common random numbers) through the same router, in two situations:

* at the observed rates: the candidate must not be worse than what runs now (its sustained
  share at most 1 point lower, its P90 TTFT at most 10% + 0.25 s higher, and at most 1 point
  more of its decisions ``link_congested``);
* under stress, every rate scaled so that the fleet runs at ``stress`` (0.95) of the current
  setting's predicted capacity (the gain the analytical model claims is a capacity gain, which
  only shows near capacity): the candidate must do better (a sustained share at least 1 point
  higher, or a P90 TTFT at least 5% lower without sustaining less).

When the rate a situation runs at is more than either setting carries (both sustain less than
``OVERLOADED_SUSTAINED`` of it), its TTFTs are queueing times that grow with the run: the
verdict then says so and rests on the rates each setting carried, not on "a gain".

Bounded time: each run replays at most ``max_requests`` requests, and all runs together stop at
``max_wall_s`` of wall-clock time; a verification cut short says so (``confirmed is None``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from scheduling.core.scenario import (
    ArrivalSpec,
    EmpiricalDist,
    FixedDist,
    Scenario,
    WorkloadSpec,
)
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import (
    SimulationConfig,
    SimulationResult,
    result_build,
    simulation_build,
)
from scheduling.core.simulator.workload import RequestSpec, Workload, workload_build

#: Verdict reasons (``Verdict.reason``).
CONFIRMED = "confirmed"
WORSE_AT_OBSERVED = "worse_at_observed_rate"
NO_GAIN_UNDER_STRESS = "no_gain_under_stress"
CUT_SHORT = "cut_short"
CONFIRMED_OVERLOADED = "confirmed_overloaded"

#: Below this sustained share of the offered rate a setting does not carry it (the run's queue
#: grows for as long as arrivals last).
OVERLOADED_SUSTAINED = 0.9


@dataclass(frozen=True)
class Limits:
    """How much simulation a verification may cost."""

    max_requests: int = 2000
    max_wall_s: float = 20.0
    stress: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class Traffic:
    """One PD cluster's recent traffic: arrival rate, incremental-length histogram points
    ``(tokens, count)`` and mean output length."""

    rate_rps: float
    lengths: tuple[tuple[float, float], ...]
    output_tokens: float


@dataclass(frozen=True)
class SettingRun:
    """What one simulated setting did."""

    rate_rps: float
    requests: int
    sustained_fraction: float
    ttft_mean_s: float
    ttft_p90_s: float
    link_congested: float
    stable: bool


@dataclass(frozen=True)
class Verdict:
    """Whether the simulation confirms the candidate (``None``: cut short), why, and the runs
    (``observed``/``stress``: (current, candidate))."""

    confirmed: bool | None
    reason: str
    detail: str
    observed: tuple[SettingRun, SettingRun] | None
    stress: tuple[SettingRun, SettingRun] | None
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        def pair(p: tuple[SettingRun, SettingRun] | None) -> dict[str, Any] | None:
            if p is None:
                return None
            return {"current": _run_dict(p[0]), "proposed": _run_dict(p[1])}

        return {
            "confirmed": self.confirmed,
            "reason": self.reason,
            "detail": self.detail,
            "observed": pair(self.observed),
            "stress": pair(self.stress),
            "wall_s": self.wall_s,
        }


def _run_dict(r: SettingRun) -> dict[str, Any]:
    return {
        "rate_rps": r.rate_rps,
        "requests": r.requests,
        "sustained_fraction": _finite(r.sustained_fraction),
        "ttft_mean_s": _finite(r.ttft_mean_s),
        "ttft_p90_s": _finite(r.ttft_p90_s),
        "link_congested": r.link_congested,
        "stable": r.stable,
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class SimulationCutShort(Exception):
    """The wall-clock budget ran out in the middle of a run."""


class _Deadline(list[Any]):
    """The request list handed to the simulator: it stops the run when time is up."""

    def __init__(self, items: Iterable[Any], deadline: float) -> None:
        super().__init__(items)
        self.deadline = deadline
        self.reads = 0

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        if self.reads % 200 == 0 and time.perf_counter() > self.deadline:
            raise SimulationCutShort
        return super().__getitem__(index)


def traffic_workload(
    scenario: Scenario, traffic: Mapping[str, Traffic], *, scale: float, requests: int, seed: int
) -> Workload:
    """Each origin's Poisson arrivals at ``scale`` x its rate from its own histogram, merged
    by arrival time and cut at ``requests`` in all."""
    total = sum(t.rate_rps for t in traffic.values()) * scale
    merged: list[RequestSpec] = []
    for k, (name, t) in enumerate(sorted(traffic.items())):
        if t.rate_rps <= 0 or not t.lengths:
            continue
        share = t.rate_rps * scale / total
        workload = WorkloadSpec(
            arrival=ArrivalSpec(process="poisson", rate_per_s=t.rate_rps * scale),
            input_tokens=EmpiricalDist(tuple(t.lengths)),
            output_tokens=FixedDist(max(1.0, t.output_tokens)),
            trace=None,
            phases=(),
            origins={name: 1.0},
            prefix_hit_fraction=None,
        )
        own = workload_build(
            replace(scenario, workload=workload, events=()),
            rate_per_s=t.rate_rps * scale,
            seed=seed * 1000 + k,
            requests=max(1, math.ceil(requests * share)),
        )
        merged.extend(own.requests)
    merged.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(merged[:requests]), (), total)


def _simulate(
    scenario: Scenario,
    settings: Mapping[str, tuple[float, int, int]],
    workload: Workload,
    deadline: float,
) -> SettingRun:
    fleet = fleet_setting(
        scenario,
        {name: t for name, (t, _, _) in settings.items()},
        {name: (n_p, n_d) for name, (_, n_p, n_d) in settings.items()},
    )
    config = SimulationConfig(policy="prfaas")
    started = time.perf_counter()
    sim, dispatcher = simulation_build(scenario, fleet, workload, config)
    sim.requests = _Deadline(sim.requests, deadline)
    sim.run()
    result: SimulationResult = result_build(
        scenario, fleet, workload, config, sim, dispatcher, started, False
    )
    decisions = sum(result.reasons.values())
    return SettingRun(
        rate_rps=result.offered_rate_rps,
        requests=result.requests,
        sustained_fraction=result.sustained_fraction,
        ttft_mean_s=result.ttft.mean,
        ttft_p90_s=result.ttft.p90,
        link_congested=result.reasons.get("link_congested", 0) / decisions if decisions else 0.0,
        stable=result.stable,
    )


def run_from_dict(data: Mapping[str, Any]) -> SettingRun:
    """A :class:`SettingRun` back from :meth:`Verdict.to_dict`'s form (None figures: nan)."""

    def num(key: str) -> float:
        value = data.get(key)
        return float(value) if isinstance(value, int | float) else math.nan

    return SettingRun(
        rate_rps=num("rate_rps"),
        requests=int(data.get("requests") or 0),
        sustained_fraction=num("sustained_fraction"),
        ttft_mean_s=num("ttft_mean_s"),
        ttft_p90_s=num("ttft_p90_s"),
        link_congested=num("link_congested"),
        stable=bool(data.get("stable")),
    )


def overloaded(current: SettingRun, candidate: SettingRun) -> bool:
    """Neither setting carries the rate they ran at."""
    return all(not (r.sustained_fraction >= OVERLOADED_SUSTAINED) for r in (current, candidate))


def overloaded_detail(current: SettingRun, candidate: SettingRun) -> str:
    """What a run at a rate neither setting carries shows: the rates each one carried."""
    carried_now = current.rate_rps * current.sustained_fraction
    carried = candidate.rate_rps * candidate.sustained_fraction
    change = f" ({carried / carried_now - 1:+.0%})" if carried_now > 0 else ""
    return (
        f"at {current.rate_rps:.2f} req/s offered, more than either setting carries (now "
        f"{current.sustained_fraction:.0%} of it, the proposal {candidate.sustained_fraction:.0%}"
        f"): the proposal carries {carried:.2f} req/s against {carried_now:.2f} now{change}; "
        "their TTFTs are queueing times of an overloaded run"
    )


def _not_worse(current: SettingRun, candidate: SettingRun) -> str:
    if candidate.sustained_fraction < current.sustained_fraction - 0.01:
        return (
            f"sustains {candidate.sustained_fraction:.1%} of the observed rate against "
            f"{current.sustained_fraction:.1%} now"
        )
    if candidate.ttft_p90_s > 1.10 * current.ttft_p90_s + 0.25:
        return f"P90 TTFT {candidate.ttft_p90_s:.2f} s against {current.ttft_p90_s:.2f} s now"
    if candidate.link_congested > current.link_congested + 0.01:
        return (
            f"{candidate.link_congested:.1%} of decisions link_congested against "
            f"{current.link_congested:.1%} now"
        )
    return ""


def _better(current: SettingRun, candidate: SettingRun) -> bool:
    if candidate.sustained_fraction >= current.sustained_fraction + 0.01:
        return True
    return (
        candidate.ttft_p90_s <= 0.95 * current.ttft_p90_s
        and candidate.sustained_fraction >= current.sustained_fraction - 0.005
    )


def candidate_verify(
    scenario: Scenario,
    traffic: Mapping[str, Traffic],
    current: Mapping[str, tuple[float, int, int]],
    candidate: Mapping[str, tuple[float, int, int]],
    *,
    capacity_rps: float,
    limits: Limits = Limits(),
) -> Verdict:
    """Run ``current`` and ``candidate`` (each PD cluster's (threshold, n_p, n_d)) on the
    recent ``traffic`` (see the module). ``capacity_rps``: the current setting's predicted
    capacity for the whole fleet, at the traffic's mix."""
    started = time.perf_counter()
    deadline = started + limits.max_wall_s
    observed_rate = sum(t.rate_rps for t in traffic.values())
    pairs: dict[str, tuple[SettingRun, SettingRun]] = {}
    situations = [("observed", 1.0)]
    if observed_rate > 0 and math.isfinite(capacity_rps) and capacity_rps > 0:
        scale = limits.stress * capacity_rps / observed_rate
        if scale > 1.05:
            situations.append(("stress", scale))
        else:
            situations = [("stress", max(scale, 1.0))]
    try:
        for name, scale in situations:
            workload = traffic_workload(
                scenario, traffic, scale=scale, requests=limits.max_requests, seed=limits.seed
            )
            pairs[name] = (
                _simulate(scenario, current, workload, deadline),
                _simulate(scenario, candidate, workload, deadline),
            )
    except SimulationCutShort:
        return Verdict(
            None,
            CUT_SHORT,
            f"the simulation did not finish within {limits.max_wall_s:g} s",
            pairs.get("observed"),
            pairs.get("stress"),
            time.perf_counter() - started,
        )
    wall = time.perf_counter() - started
    observed, stress = pairs.get("observed"), pairs.get("stress")
    if observed is not None:
        worse = _not_worse(*observed)
        if worse:
            return Verdict(
                False,
                WORSE_AT_OBSERVED,
                f"at the observed rate the candidate {worse}",
                observed,
                stress,
                wall,
            )
    if stress is not None and not _better(*stress):
        cur, cand = stress
        detail = (
            f"{overloaded_detail(cur, cand)}: no gain"
            if overloaded(cur, cand)
            else f"near the current capacity ({cur.rate_rps:.2f} req/s) the candidate sustains "
            f"{cand.sustained_fraction:.1%} with P90 TTFT {cand.ttft_p90_s:.2f} s and "
            f"{cand.link_congested:.1%} of decisions link_congested, against "
            f"{cur.sustained_fraction:.1%}, {cur.ttft_p90_s:.2f} s and {cur.link_congested:.1%} now"
        )
        return Verdict(False, NO_GAIN_UNDER_STRESS, detail, observed, stress, wall)
    for pair in (observed, stress):
        if pair is not None and overloaded(*pair):
            return Verdict(
                True, CONFIRMED_OVERLOADED, overloaded_detail(*pair), observed, stress, wall
            )
    return Verdict(True, CONFIRMED, _confirmed_detail(stress), observed, stress, wall)


def _confirmed_detail(stress: tuple[SettingRun, SettingRun] | None) -> str:
    if stress is None:
        return "at the observed rate the proposal does no worse than the current setting"
    cur, cand = stress
    return (
        f"near the current capacity ({cur.rate_rps:.2f} req/s) the proposal sustains "
        f"{cand.sustained_fraction:.0%} with P90 TTFT {cand.ttft_p90_s:.2f} s, against "
        f"{cur.sustained_fraction:.0%} and {cur.ttft_p90_s:.2f} s now"
    )
