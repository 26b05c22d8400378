"""The planner's reports: the paper's Figure 5 sweeps and the JSON-ready summaries of an
evaluation, a plan and an SLO plan that ``plan`` prints and the rebalancer stores.
Pure Python: no Django import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from scheduling.core.fleet import FleetSpec, lengths_of
from scheduling.core.goodput import SloPlan
from scheduling.core.offload import OffloadSplit, offload_split
from scheduling.core.operating import operating_point_to_dict
from scheduling.core.performance import FloatArray, LengthDistribution
from scheduling.core.planner import (
    INF,
    ClusterResult,
    Evaluation,
    PlanResult,
    evaluate,
    evaluation_settings,
)
from scheduling.core.search import threshold_grid

# --------------------------------------------------------------------------------------------
# Sweep results


@dataclass(frozen=True)
class ThresholdSweep:
    """Figure 5(b): the bounds on Lambda of one PD cluster as t moves, split fixed."""

    cluster: str
    n_p: int
    n_d: int
    thresholds: tuple[float, ...]
    offload_fraction: tuple[float, ...]
    bound_prfaas: tuple[float, ...]
    bound_pd_p: tuple[float, ...]
    bound_pd_d: tuple[float, ...]
    throughput: tuple[float, ...]


@dataclass(frozen=True)
class SplitSweep:
    """Figure 5(a): the bounds on Lambda of one PD cluster as its split moves, t fixed."""

    cluster: str
    threshold_tokens: float
    n_p: tuple[int, ...]
    bound_prfaas: tuple[float, ...]
    bound_pd_p: tuple[float, ...]
    bound_pd_d: tuple[float, ...]
    throughput: tuple[float, ...]


# --------------------------------------------------------------------------------------------
# Sweeps (paper Figure 5)


def _bounds_of(ev: Evaluation, cluster: str) -> tuple[float, float, float]:
    prf = min(
        (
            v
            for k, v in ev.stage_bounds.items()
            if k.split(":")[0] in ("prfaas", "prfaas_compute", "link")
        ),
        default=INF,
    )
    return (
        prf,
        ev.stage_bounds.get(f"pd_prefill:{cluster}", INF),
        ev.stage_bounds.get(f"pd_decode:{cluster}", INF),
    )


def astuple_shallow(split: OffloadSplit) -> tuple[FloatArray, ...]:
    """The split's arrays in field order (``dataclasses.astuple`` would copy deeply)."""
    return tuple(getattr(split, f.name) for f in fields(split))


def sweep_threshold(
    fleet: FleetSpec,
    lengths: LengthDistribution,
    output_tokens: float,
    at: Evaluation,
    *,
    cluster: str | None = None,
    threshold_step: float = 100,
) -> ThresholdSweep:
    """Move one cluster's threshold over the grid, every other setting as in ``at``."""
    name = cluster or at.clusters[0].name
    ts, ns = evaluation_settings(at)
    grid = threshold_grid(lengths, threshold_step)
    # The links' treatment of the swept cluster at every threshold, at once (as the search).
    split = offload_split(fleet, fleet.pd_pool(name), lengths_of(lengths, name), grid, load=at.load)
    rows = []
    for k, t in enumerate(grid):
        one = OffloadSplit(*(np.asarray(v)[k : k + 1] for v in astuple_shallow(split)))
        ev = evaluate(
            fleet,
            lengths,
            output_tokens,
            {**ts, name: float(t)},
            ns,
            with_ttft=False,
            load=at.load,
            offloads={name: one},
        )
        rows.append(
            (float(t), ev.cluster(name).offload_fraction, *_bounds_of(ev, name), ev.throughput_rps)
        )
    return ThresholdSweep(
        cluster=name,
        n_p=ns[name],
        n_d=fleet.pd_pool(name).instances - ns[name],
        thresholds=tuple(r[0] for r in rows),
        offload_fraction=tuple(r[1] for r in rows),
        bound_prfaas=tuple(r[2] for r in rows),
        bound_pd_p=tuple(r[3] for r in rows),
        bound_pd_d=tuple(r[4] for r in rows),
        throughput=tuple(r[5] for r in rows),
    )


def sweep_split(
    fleet: FleetSpec,
    lengths: LengthDistribution,
    output_tokens: float,
    at: Evaluation,
    *,
    cluster: str | None = None,
) -> SplitSweep:
    """Move one cluster's prefill/decode split over every value, thresholds as in ``at``."""
    name = cluster or at.clusters[0].name
    ts, ns = evaluation_settings(at)
    rows = []
    for n in range(fleet.pd_pool(name).instances + 1):
        ev = evaluate(fleet, lengths, output_tokens, ts, {**ns, name: n}, with_ttft=False)
        rows.append((n, *_bounds_of(ev, name), ev.throughput_rps))
    return SplitSweep(
        cluster=name,
        threshold_tokens=ts[name],
        n_p=tuple(int(r[0]) for r in rows),
        bound_prfaas=tuple(r[1] for r in rows),
        bound_pd_p=tuple(r[2] for r in rows),
        bound_pd_d=tuple(r[3] for r in rows),
        throughput=tuple(r[4] for r in rows),
    )


# --------------------------------------------------------------------------------------------
# Reports


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def cluster_to_dict(c: ClusterResult, n_prfaas: int) -> dict[str, Any]:
    return {
        "name": c.name,
        "share": c.share,
        "threshold_tokens": c.threshold_tokens,
        "offload_fraction": c.offload_fraction,
        "l_long": _finite(c.l_long),
        "l_short": _finite(c.l_short),
        "n_prfaas": n_prfaas,
        "n_p": c.n_p,
        "n_d": c.n_d,
        "theta_prfaas": _finite(c.theta_prfaas),
        "theta_pd_p": _finite(c.theta_pd_p),
        "theta_pd_d": _finite(c.theta_pd_d),
        "throughput_rps": c.throughput_rps,
        "egress_gbps": c.egress_gbps,
        "link_gbps": c.link_gbps,
        "ttft_mean_s": c.ttft_mean_s,
        "ttft_p90_s": c.ttft_p90_s,
        "link_congested_fraction": c.refused_fraction,
    }


def evaluation_to_dict(ev: Evaluation) -> dict[str, Any]:
    """A JSON-ready summary. With one PD cluster its fields sit at the top level; with several
    the top level carries the totals and each cluster is under ``clusters``."""
    out: dict[str, Any] = {}
    if len(ev.clusters) == 1:
        out.update(cluster_to_dict(ev.clusters[0], ev.n_prfaas))
        del out["name"], out["share"]
    else:
        out["n_prfaas"] = ev.n_prfaas
        out["clusters"] = {c.name: cluster_to_dict(c, ev.n_prfaas) for c in ev.clusters}
    out.update(
        {
            "throughput_rps": ev.throughput_rps,
            "bottleneck": ev.bottleneck,
            "bottleneck_at": ev.bottleneck_at,
            "egress_gbps": ev.egress_gbps,
            "ttft_mean_s": ev.ttft_mean_s,
            "ttft_p90_s": ev.ttft_p90_s,
            "stage_bounds": {k: _finite(v) for k, v in ev.stage_bounds.items()},
        }
    )
    return out


def plan_to_dict(result: PlanResult) -> dict[str, Any]:
    homog = evaluation_to_dict(result.homogeneous)
    homog["instances"] = result.homogeneous_instances
    equal = evaluation_to_dict(result.equal_cost_homogeneous)
    equal["instances"] = result.equal_cost_instances
    naive = evaluation_to_dict(result.naive_heterogeneous)
    prfaas = evaluation_to_dict(result.prfaas)
    if result.at_load is not None:
        prfaas["at_load"] = {"load": result.prfaas.load, **operating_point_to_dict(result.at_load)}
    if result.window_capacity_rps is not None:
        prfaas["window_capacity_rps"] = result.window_capacity_rps
    return {
        "prfaas": prfaas,
        "baselines": {
            "homogeneous": homog,
            "naive_heterogeneous": naive,
            "equal_cost_homogeneous": equal,
        },
        "gains": dict(result.gains),
        "threshold_step": result.threshold_step,
        "mean_input_tokens": result.mean_input_tokens,
        "output_tokens": result.output_tokens,
    }


def slo_plan_to_dict(slo: SloPlan, ev: Evaluation) -> dict[str, Any]:
    """JSON-ready: the goodput rate, the setting per PD cluster and the prediction there."""
    return {
        "ttft_slo_s": slo.slo_s,
        "quantile": slo.quantile,
        "rate_rps": slo.rate_rps,
        "clusters": {
            c.name: {
                "threshold_tokens": c.threshold_tokens,
                "n_p": c.n_p,
                "n_d": c.n_d,
                "offload_fraction": c.offload_fraction,
            }
            for c in ev.clusters
        },
        "throughput_rps": ev.throughput_rps,
        "at_rate": None if slo.at_rate is None else operating_point_to_dict(slo.at_rate),
    }
