"""Sizing advice (``plan --advise``, the what-if page): how many more PrfaaS instances or how
much more line rate would raise a fleet's rate (its goodput under a TTFT target, else its
planned rate at the load), by how much, and what share of requests its link guards would then
refuse. Each change is planned whole (:mod:`scheduling.core.planner`); a trace is planned window
by window, as its plan is.

Pure Python and numpy: no Django.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from scheduling.core.fleet import FleetSpec, Lengths
from scheduling.core.operating import WorkloadWindow
from scheduling.core.planner import DEFAULT_LOAD, plan_fleet, plan_for_ttft, predict_at_load


@dataclass(frozen=True)
class Sizing:
    """What sizing advice compares for one fleet: its rate (goodput under the TTFT target, or
    the planned rate at the load) and the share of requests its links' guards refuse there
    (``link_congested``: prefilled locally), which a wider link lowers."""

    rate_rps: float
    refused_fraction: float


@dataclass(frozen=True)
class Advice:
    """One sizing change and what it would bring: the new rate (goodput under the TTFT target,
    or the planned rate at load when no target is given), its gain over today's, and the share
    of requests the links would refuse at it (today's is :class:`Sizing`'s)."""

    change: str
    kind: str  # "prfaas_instances" or "link_gbps"
    target: str  # the PrfaaS cluster, or the link "source->target"
    amount: float  # instances added, or Gbps added
    rate_rps: float
    gain: float
    refused_fraction: float


def sizing_advice(
    fleet: FleetSpec,
    sizing_of: Callable[[FleetSpec], Sizing],
    *,
    instance_steps: tuple[int, ...] = (1, 2, 4),
    gbps_factors: tuple[float, ...] = (1.5, 2.0),
    min_gain: float = 0.01,
) -> tuple[Sizing, tuple[Advice, ...]]:
    """Today's sizing and, for each change that raises its rate by at least ``min_gain``, the
    change, its gain and the refused share it leaves: more instances in each PrfaaS cluster,
    more line rate on each live link (its budget, when it follows the line rate, grows with
    it). ``sizing_of`` plans a fleet and returns what to compare (goodput under the target, or
    the planned rate), with the refused share at that rate."""
    base = sizing_of(fleet)
    out: list[Advice] = []
    for pool in fleet.prfaas:
        for step in instance_steps:
            bigger = replace(
                fleet,
                prfaas=tuple(
                    replace(p, instances=p.instances + step) if p.name == pool.name else p
                    for p in fleet.prfaas
                ),
            )
            out.append(
                _advice(
                    f"{pool.name}: +{step} instances",
                    "prfaas_instances",
                    pool.name,
                    step,
                    base,
                    sizing_of(bigger),
                )
            )
    for i, link in enumerate(fleet.links):
        if link.gbps <= 0:
            continue
        for factor in gbps_factors:
            more = link.gbps * (factor - 1.0)
            links = list(fleet.links)
            links[i] = replace(link, gbps=link.gbps * factor)
            out.append(
                _advice(
                    f"{link.key}: +{more:g} Gbps (a {link.gbps * factor:g} Gbps link)",
                    "link_gbps",
                    link.key,
                    more,
                    base,
                    sizing_of(replace(fleet, links=tuple(links))),
                )
            )
    useful = [a for a in out if a.gain >= min_gain]
    useful.sort(key=lambda a: (-a.gain, a.amount))
    return base, tuple(useful)


def _advice(
    change: str, kind: str, target: str, amount: float, base: Sizing, sized: Sizing
) -> Advice:
    rate = sized.rate_rps
    gain = rate / base.rate_rps - 1.0 if base.rate_rps > 0 else (math.inf if rate > 0 else 0.0)
    return Advice(change, kind, target, float(amount), rate, gain, sized.refused_fraction)


def advice_to_dict(base: Sizing, advice: tuple[Advice, ...]) -> dict[str, object]:
    return {
        "rate_rps": base.rate_rps,
        "refused_fraction": base.refused_fraction,
        "changes": [
            {
                "change": a.change,
                "kind": a.kind,
                "target": a.target,
                "amount": a.amount,
                "rate_rps": a.rate_rps,
                "gain": a.gain if math.isfinite(a.gain) else None,
                "refused_fraction": a.refused_fraction,
            }
            for a in advice
        ],
    }


def sizing_at_load(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    *,
    threshold_step: float = 100,
    load: float = DEFAULT_LOAD,
    output_scv: float = 0.0,
    windows: Sequence[WorkloadWindow] = (),
) -> Sizing:
    """What sizing advice compares without a TTFT target: the planned rate (``load`` x
    Lambda_max, or x the heaviest window's with ``windows``, as :func:`plan`) and the share
    of requests the link guards refuse there."""
    ev = plan_fleet(
        fleet,
        lengths,
        output_tokens,
        threshold_step=threshold_step,
        load=load,
        output_scv=output_scv,
    )
    if load * ev.throughput_rps <= 0:
        return Sizing(0.0, 0.0)
    at, _ = predict_at_load(fleet, lengths, output_tokens, ev, load, output_scv, 1.0, windows)
    return Sizing(at.rate_rps, at.refused_fraction)


def sizing_for_ttft(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    slo_s: float,
    *,
    threshold_step: float = 100,
    load: float = DEFAULT_LOAD,
    output_scv: float = 0.0,
    windows: Sequence[WorkloadWindow] = (),
) -> Sizing:
    """What sizing advice compares under a P90 TTFT target: the goodput
    (:func:`plan_for_ttft`, a trace's ``windows`` judged each) and the share of requests the
    link guards refuse at it."""
    slo, _ = plan_for_ttft(
        fleet,
        lengths,
        output_tokens,
        slo_s,
        threshold_step=threshold_step,
        load=load,
        output_scv=output_scv,
        windows=windows,
    )
    return Sizing(slo.rate_rps, slo.at_rate.refused_fraction if slo.at_rate is not None else 0.0)
