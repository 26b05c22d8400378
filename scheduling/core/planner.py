"""The long-term planner: PrfaaS's throughput model (paper Eqs. 3-6) and the search for the
offload threshold t and the prefill/decode split that maximise sustainable throughput.

Pure Python and numpy (scipy for one LP): no Django. Frozen dataclasses in and out. The CLI,
the rebalancer and the simulator all call :func:`plan_fleet` / :func:`evaluate`, so a fleet
need not come from a scenario file (the rebalancer builds :class:`FleetSpec` from the database
and an empirical :class:`~scheduling.core.performance.DiscreteLengths` from observed traffic).

Model, generalised beyond the paper's single pair. The total arrival rate is Lambda; PD cluster
c receives the share s_c of it and offloads the fraction p_c = P(L > t_c) to PrfaaS, all of
mean length l_long,c; the rest, of mean length l_short,c, prefills on its N_p,c PD-P
instances; all of it decodes on its N_d,c PD-D instances. Stage bounds on Lambda:

* PD-P of c:  N_p,c / ((1 - p_c) s_c T_c(l_short,c))                       (Eq. 4)
* PD-D of c:  N_d,c * BS_max / (T_decode L_out) / s_c                        (Eq. 5)
* PrfaaS: compute shared by all PD clusters, each link (j -> c) within its capacity:
  one PrfaaS cluster: N_j / sum_c s_c p_c T_j(l_long,c) and B_jc / (s_c p_c S_kv(l_long,c));
  several: the largest Lambda a linear program can route (flows f_jc) within every cluster's
  compute and every link.                                                   (Eq. 3)

The links as the router applies them (:mod:`scheduling.core.link`, one model for planner, router
and simulator): a link carries at most its target share of the line rate on average (B_jc above
is that share), a request no linked link may carry (``link_never_fits``: only a link without a
budget; one bigger than a budget is admitted alone on an idle link) prefills locally, and
(``link_budget`` bound) at the planned load F x Lambda the link refuses at most 1% of the
cluster's decisions, reservations held from the decision to the transfer's end
(:mod:`scheduling.core.offload`). p_c, l_long,c and l_short,c count what the links admit.

Lambda_max is the smallest bound (Eq. 6), and the smallest bound names the bottleneck. The
search is :mod:`scheduling.core.search`; :func:`plan` also predicts the optimum at F x
Lambda_max with queueing (``at_load``, :mod:`scheduling.core.operating`). The Figure 5 sweeps and
the JSON reports are :mod:`scheduling.core.plan_report`; a scenario becomes a fleet in
:mod:`scheduling.core.scenario_fleet` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from scheduling.core.fleet import (
    FleetSpec,
    Lengths,
    Link,
    PdPool,
    PrfaasPool,
    fleet_cost,
    fleet_gpus,
    homogeneous_fleet,
    lengths_of,
    reference_pd,
)
from scheduling.core.goodput import DEFAULT_SLO_HEADROOM, SloPlan, plan_for_slo
from scheduling.core.link import DEFAULT_REFUSAL_TARGET
from scheduling.core.offload import (
    OffloadSplit,
    fit_limit_tokens,
    guard_curve,
    guard_rows,
    linked_pools,
    offload_split,
    refusal_cap,
    spill_bound,
)
from scheduling.core.operating import (
    OperatingPoint,
    WorkloadWindow,
    operating_point,
    operating_windows,
)
from scheduling.core.performance import (
    FloatArray,
    LengthDistribution,
    decode_rate_per_instance,
    kv_bytes,
    prefill_seconds,
    weighted_quantile,
)
from scheduling.core.planner_types import DEFAULT_LOAD, ClusterResult, Evaluation, PlanResult
from scheduling.core.scenario import Scenario
from scheduling.core.scenario_fleet import (
    PlannedWorkload,
    fleet_from_scenario,
    workload_lengths,
    workload_output_scv,
    workload_planned,
)
from scheduling.core.search import (
    Grid,
    compute_bound,
    exact_best,
    fleet_threshold_grid,
    grid_build,
    grid_pick,
    joint_search,
    prfaas_lp,
    safe_div,
    split_range,
    threshold_grid,
)

__all__ = [
    "DEFAULT_LOAD",
    "ClusterResult",
    "Evaluation",
    "FleetSpec",
    "Lengths",
    "Link",
    "PdPool",
    "PlanResult",
    "PlannedWorkload",
    "PrfaasPool",
    "evaluate",
    "evaluation_settings",
    "fleet_from_scenario",
    "homogeneous_fleet",
    "plan",
    "plan_fleet",
    "plan_for_ttft",
    "plan_scenario",
    "plan_workload",
    "predict_at_load",
    "threshold_grid",
    "workload_lengths",
    "workload_output_scv",
    "workload_planned",
]

INF = math.inf
#: The naive heterogeneous baseline's cap on link refusals (it has no local prefill).
NAIVE_REFUSAL_CAP = 0.01


# --------------------------------------------------------------------------------------------
# The model at one setting


def _as_mapping(fleet: FleetSpec, value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        missing = [c.name for c in fleet.pd if c.name not in value]
        if missing:
            raise ValueError(f"{what} missing for {', '.join(missing)}")
        return dict(value)
    return {c.name: value for c in fleet.pd}


def _check_load(load: float) -> None:
    if not (0 < load < 1):
        raise ValueError(f"the planned load must be within (0, 1), got {load!r}")


def _admission_bound(admit_rate: float, load: float, share: float, offload: float) -> float:
    """Lambda at which ``load`` x Lambda brings this cluster the arrivals its links admit."""
    if offload <= 0 or share <= 0:
        return INF
    return safe_div(admit_rate, load * share)


def evaluate(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    thresholds: Mapping[str, float] | float,
    splits: Mapping[str, int] | int,
    *,
    with_ttft: bool = True,
    load: float = DEFAULT_LOAD,
    refusal_target: float | None = DEFAULT_REFUSAL_TARGET,
    offloads: Mapping[str, OffloadSplit] | None = None,
) -> Evaluation:
    """The throughput model at a given setting: threshold and number of prefill instances
    (``n_p``; the rest decode) per PD cluster. A single number applies to every cluster.

    The links are part of the model as the router applies them: requests no linked link may
    carry prefill locally, and so do the offloads the link guard refuses: the links
    carry at most their target share of the line rate, the rest of the offered offloads
    prefill on the PD cluster (its ``pd_prefill`` bound counts them). Only with a cap on the
    refused share (``refusal_target``, else the links' ``max_refused_share``; none by
    default) is there a ``link_budget`` bound: at ``load`` x Lambda the links refuse at most
    the cap of the cluster's decisions (:mod:`scheduling.core.offload`).
    ``offloads``: that split, already computed for some clusters at their thresholds (one row
    each; the sweeps compute it for a whole grid at once).
    """
    _check_load(load)
    ts = _as_mapping(fleet, thresholds, "threshold")
    ns = _as_mapping(fleet, splits, "split")
    bounds: dict[str, float] = {}
    per: dict[str, dict[str, Any]] = {}
    for c in fleet.pd:
        n_p = int(ns[c.name])
        if not 0 <= n_p <= c.instances:
            raise ValueError(f"{c.name}: n_p must be within 0..{c.instances}, got {n_p}")
        sp = (offloads or {}).get(c.name) or offload_split(
            fleet,
            c,
            lengths_of(lengths, c.name),
            np.asarray([ts[c.name]], dtype=float),
            load=load,
            refusal_target=refusal_target,
            exact=True,
        )
        p, l_long, l_short = float(sp.offload[0]), float(sp.l_offload[0]), float(sp.l_local[0])
        refused = float(sp.refused[0])
        cap = refusal_cap(fleet, c.name, refusal_target)
        rate = decode_rate_per_instance(c.max_batch, c.step_seconds, output_tokens)
        theta_d = (c.instances - n_p) * rate
        theta_p = n_p / float(prefill_seconds(c.prefill, l_short)) if p < 1 else None
        # Without a cap the link guard spills what the link cannot carry to local prefill
        # (one PrfaaS pool; several are routed by the LP, within their links).
        curve = (
            guard_curve(fleet, c, lengths_of(lengths, c.name), np.array([ts[c.name]]))
            if cap is None and p > 0 and len(fleet.prfaas) <= 1
            else None
        )
        carried = INF
        if c.share > 0:
            bounds[f"pd_prefill:{c.name}"] = (
                INF if theta_p is None else safe_div(theta_p, (1 - p) * c.share)
            )
            if curve is not None:
                t_short = float(prefill_seconds(c.prefill, l_short)) if p < 1 else 0.0
                lam = float(
                    spill_bound(
                        np.array([[bounds[f"pd_prefill:{c.name}"]]]),
                        np.array([n_p]),
                        c.share,
                        np.array([p]),
                        np.array([t_short]),
                        np.array([float(prefill_seconds(c.prefill, l_long))]),
                        curve,
                        np.array([0]),
                    )[0, 0]
                )
                bounds[f"pd_prefill:{c.name}"] = lam
                # What the links carry at most (PrfaaS compute is shared out against it).
                carried = float(np.max(curve.carried[0]))
            bounds[f"pd_decode:{c.name}"] = safe_div(theta_d, c.share)
            if p > 0 and cap is not None:
                admission = _admission_bound(float(sp.admit_rate[0]), load, c.share, p)
                if refused > cap:
                    admission = 0.0
                bounds[f"link_budget:{c.name}"] = admission
        per[c.name] = {
            "p": p,
            "l_long": l_long,
            "l_short": l_short,
            "theta_p": theta_p,
            "theta_d": theta_d,
            "refused": refused,
            "carried": carried,
            "curve": curve,
        }

    demand = {c.name: (c.share * per[c.name]["p"], per[c.name]["l_long"]) for c in fleet.pd}
    offloading = [c for c in fleet.pd if demand[c.name][0] > 0]
    prfaas_bound = INF
    if offloading and len(fleet.prfaas) <= 1:
        j = fleet.prfaas[0] if fleet.prfaas else None
        key = f"prfaas_compute:{j.name}" if j else "prfaas_compute:none"
        bounds[key] = compute_bound(
            j.instances if j else 0,
            [
                (d, float(prefill_seconds(j.prefill, ll)) if j else 0.0, per[c.name]["carried"])
                for c in offloading
                for d, ll in (demand[c.name],)
            ],
        )
        prfaas_bound = bounds[key]
        for c in offloading:
            if math.isfinite(per[c.name]["carried"]):
                continue  # the guard holds this link: what it cannot carry prefills locally
            d, ll = demand[c.name]
            gbps = fleet.usable_gbps(j.name, c.name) if j else 0.0
            lk = f"link:{j.name if j else 'none'}->{c.name}"
            bounds[lk] = safe_div(gbps * 1e9, d * float(kv_bytes(fleet.kv_mib, ll)) * 8.0)
            prfaas_bound = min(prfaas_bound, bounds[lk])
    elif offloading:
        prfaas_bound, _ = prfaas_lp(fleet, demand)
        bounds["prfaas"] = prfaas_bound

    broken = [k for k, v in bounds.items() if math.isnan(v)]
    if broken:
        raise ValueError(f"the model is undefined at this setting ({', '.join(broken)})")
    throughput = min(bounds.values(), default=INF)
    if not math.isfinite(throughput):
        raise ValueError("the model is unbounded: no traffic share, or zero output tokens")
    order = ["prfaas_compute", "prfaas", "link", "link_budget", "pd_prefill", "pd_decode"]
    tight = min(bounds.items(), key=lambda kv: (kv[1], order.index(kv[0].split(":")[0])))
    stage, _, at = tight[0].partition(":")

    results = []
    all_x: list[FloatArray] = []
    all_w: list[FloatArray] = []
    total_egress = 0.0
    for c in fleet.pd:
        v = per[c.name]
        lam_c = throughput * c.share
        # What the guard spills at Lambda_max is kept local (and counted refused).
        p = v["p"]
        theta_p = v["theta_p"]
        if v["curve"] is not None and p > 0 and lam_c > 0:
            carried = v["curve"].carried_at(0, lam_c * p)
            if carried < lam_c * p * (1 - 1e-6):
                p = carried / lam_c
                # The local prefill then serves the spilled offloads too: its throughput is
                # that of the local mix at Lambda_max.
                local_bound = bounds.get(f"pd_prefill:{c.name}", INF)
                theta_p = min(local_bound, throughput) * c.share * (1 - p)
        spilled = v["p"] - p
        egress = (
            lam_c * p * float(kv_bytes(fleet.kv_mib, v["l_long"])) * 8.0 / 1e9 if p > 0 else 0.0
        )
        total_egress += egress
        theta_prf = prfaas_bound * c.share * p if p > 0 and math.isfinite(prfaas_bound) else None
        # Queue-free TTFT: prefill time on whichever hardware the threshold sends each length
        # to (transfer is hidden by layer-wise pipelining, docs/paper.md section 7.5); a request
        # no link may ever carry (link_never_fits) is refused by the link and prefills locally.
        x, w = lengths_of(lengths, c.name).nodes() if with_ttft else (np.zeros(1), np.ones(1))
        links = linked_pools(fleet, c.name)
        local_t = prefill_seconds(c.prefill, x)
        if links and p > 0:
            remote = min(
                (j for _, j in links), key=lambda j: float(prefill_seconds(j.prefill, v["l_long"]))
            )
            fits = fit_limit_tokens(fleet, max(lk.budget for lk, _ in links), float(np.max(x)))
            away = (x > ts[c.name]) & (x <= fits)
            ttft = np.where(away, prefill_seconds(remote.prefill, x), local_t)
        else:
            ttft = local_t
        all_x.append(ttft)
        all_w.append(w * c.share)
        results.append(
            ClusterResult(
                name=c.name,
                share=c.share,
                threshold_tokens=float(ts[c.name]),
                offload_fraction=p,
                l_long=None if math.isnan(v["l_long"]) else v["l_long"],
                l_short=None if math.isnan(v["l_short"]) else v["l_short"],
                n_p=int(ns[c.name]),
                n_d=c.instances - int(ns[c.name]),
                theta_prfaas=theta_prf,
                theta_pd_p=theta_p,
                theta_pd_d=v["theta_d"],
                throughput_rps=lam_c,
                egress_gbps=egress,
                link_gbps=sum(fleet.link_gbps(j.name, c.name) for j in fleet.prfaas),
                ttft_mean_s=float(np.dot(ttft, w)),
                ttft_p90_s=weighted_quantile(ttft, w, 0.9),
                refused_fraction=v["refused"] + spilled,
            )
        )
    tx = np.concatenate(all_x)
    tw = np.concatenate(all_w)
    if tw.sum() <= 0:
        tw = np.ones_like(tx)
    return Evaluation(
        throughput_rps=throughput,
        bottleneck=stage,
        bottleneck_at=at,
        stage_bounds=bounds,
        clusters=tuple(results),
        n_prfaas=sum(j.instances for j in fleet.prfaas),
        egress_gbps=total_egress,
        ttft_mean_s=float(np.dot(tx, tw) / tw.sum()),
        ttft_p90_s=weighted_quantile(tx, tw, 0.9),
        load=load,
    )


def evaluation_settings(ev: Evaluation) -> tuple[dict[str, float], dict[str, int]]:
    """The setting an evaluation was made at: threshold and prefill instances per PD cluster."""
    return {c.name: c.threshold_tokens for c in ev.clusters}, {c.name: c.n_p for c in ev.clusters}


# --------------------------------------------------------------------------------------------
# Search


def _search(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    *,
    threshold_step: float,
    split_bounds: Mapping[str, tuple[int, int]] | None,
    load: float,
    refusal_target: float | None,
    output_scv: float,
    fixed: Mapping[str, tuple[float, int]] | None = None,
) -> tuple[dict[str, Grid], dict[str, float], dict[str, int]]:
    """The grids of every PD cluster and the best thresholds and splits on them (a cluster in
    ``fixed`` keeps its (threshold, n_p): its grid is that one cell)."""
    if not fleet.pd:
        raise ValueError("a fleet needs at least one pd cluster")
    _check_load(load)
    thresholds = fleet_threshold_grid(lengths, fleet, threshold_step)
    fixed = fixed or {}
    grids = {
        c.name: grid_build(
            fleet,
            c,
            lengths_of(lengths, c.name),
            output_tokens,
            np.asarray([fixed[c.name][0]]) if c.name in fixed else thresholds,
            (fixed[c.name][1],) * 2 if c.name in fixed else split_range(c, split_bounds),
            load,
            refusal_target,
        )
        for c in fleet.pd
    }
    active = [c for c in fleet.pd if c.share > 0]
    if not active:
        raise ValueError("no pd cluster receives traffic")
    if len(active) == 1:
        g = grids[active[0].name]
        k, m = grid_pick(g.throughput, g.want, g.thresholds, g.n_p)
        choice = {active[0].name: (float(g.thresholds[k]), int(g.n_p[m]))}
        if g.spill and g.p[k] > 0:
            # The grid reads the guard's curves at coarse thresholds: check its pick exactly
            # against the best cell that offloads nothing.
            choice = exact_best(
                g,
                active[0].name,
                choice,
                guard_rows(lengths_of(lengths, active[0].name), g.thresholds),
                lambda pick: _pick_value(
                    fleet, lengths, output_tokens, g, pick, load, refusal_target
                ),
            )
    else:
        choice = joint_search(
            fleet,
            grids,
            active,
            lengths=lengths,
            output_tokens=output_tokens,
            output_scv=output_scv,
            load=load,
        )
    for name, (t, n_p) in fixed.items():
        choice.setdefault(name, (float(t), int(n_p)))
    ts = {c.name: choice.get(c.name, (float(thresholds[-1]), 0))[0] for c in fleet.pd}
    ns = {c.name: choice.get(c.name, (0.0, split_range(c, split_bounds)[0]))[1] for c in fleet.pd}
    return grids, ts, ns


def _pick_value(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    g: Grid,
    pick: Mapping[str, tuple[float, int]],
    load: float,
    refusal_target: float | None,
) -> float:
    """Lambda_max of a single-cluster pick, evaluated exactly (0 where the model cannot)."""
    ts = {c.name: pick.get(c.name, (float(g.thresholds[-1]), 0))[0] for c in fleet.pd}
    ns = {c.name: pick.get(c.name, (0.0, 0))[1] for c in fleet.pd}
    try:
        return evaluate(
            fleet,
            lengths,
            output_tokens,
            ts,
            ns,
            with_ttft=False,
            load=load,
            refusal_target=refusal_target,
        ).throughput_rps
    except ValueError:
        return 0.0  # a cell the model cannot evaluate (e.g. no local traffic left to time)


def plan_fleet(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    *,
    threshold_step: float = 100,
    split_bounds: Mapping[str, tuple[int, int]] | None = None,
    load: float = DEFAULT_LOAD,
    refusal_target: float | None = DEFAULT_REFUSAL_TARGET,
    output_scv: float = 0.0,
    fixed: Mapping[str, tuple[float, int]] | None = None,
) -> Evaluation:
    """The best threshold and split of every PD cluster (``split_bounds`` limits a cluster's
    number of prefill instances to an inclusive range; a cluster in ``fixed`` keeps its
    (threshold, n_p)), evaluated. ``load``: the share of its capacity the fleet is planned to
    run at (see :func:`evaluate`)."""
    _, ts, ns = _search(
        fleet,
        lengths,
        output_tokens,
        threshold_step=threshold_step,
        split_bounds=split_bounds,
        load=load,
        refusal_target=refusal_target,
        output_scv=output_scv,
        fixed=fixed,
    )
    return evaluate(fleet, lengths, output_tokens, ts, ns, load=load, refusal_target=refusal_target)


def plan_for_ttft(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    slo_s: float,
    *,
    quantile: float = 0.9,
    threshold_step: float = 100,
    split_bounds: Mapping[str, tuple[int, int]] | None = None,
    load: float = DEFAULT_LOAD,
    refusal_target: float | None = DEFAULT_REFUSAL_TARGET,
    output_scv: float = 0.0,
    arrival_scv: float = 1.0,
    headroom: float = DEFAULT_SLO_HEADROOM,
    windows: Sequence[WorkloadWindow] = (),
) -> tuple[SloPlan, Evaluation]:
    """Goodput planning: the threshold and split of every PD cluster with the highest arrival
    rate whose predicted ``quantile`` TTFT is within ``slo_s``
    (:func:`scheduling.core.goodput.plan_for_slo`), and that setting's Lambda_max model.
    ``windows``: a trace's (:func:`plan`), each rate judged window by window."""
    grids, ts, ns = _search(
        fleet,
        lengths,
        output_tokens,
        threshold_step=threshold_step,
        split_bounds=split_bounds,
        load=load,
        refusal_target=refusal_target,
        output_scv=output_scv,
    )
    best = evaluate(fleet, lengths, output_tokens, ts, ns, load=load, refusal_target=refusal_target)
    slo = plan_for_slo(
        fleet,
        lengths,
        output_tokens,
        slo_s,
        grids=grids,
        start={c.name: (ts[c.name], ns[c.name]) for c in fleet.pd},
        # The fluid bound prices each stage at its mean; the queueing model may differ a
        # little either way, so the rates tried reach a little beyond it.
        capacity_rps=best.throughput_rps * 1.2,
        quantile=quantile,
        output_scv=output_scv,
        arrival_scv=arrival_scv,
        refusal_target=refusal_target,
        headroom=headroom,
        windows=windows,
    )
    chosen = evaluate(
        fleet,
        lengths,
        output_tokens,
        dict(slo.thresholds),
        dict(slo.splits),
        load=load,
        refusal_target=refusal_target,
    )
    return slo, chosen


def predict_at_load(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    best: Evaluation,
    load: float,
    output_scv: float,
    arrival_scv: float,
    windows: Sequence[WorkloadWindow],
) -> tuple[OperatingPoint, float | None]:
    """The prediction at ``load`` x the planned capacity (:func:`plan`), and with
    ``windows`` the rate the heaviest window sustains at the setting (``None`` without)."""
    ts, ns = evaluation_settings(best)
    if not windows:
        rate = load * best.throughput_rps
        return (
            operating_point(
                fleet,
                lengths,
                output_tokens,
                ts,
                ns,
                rate,
                output_scv=output_scv,
                arrival_scv=arrival_scv,
            ),
            None,
        )
    capacity = min(
        evaluate(fleet, w.lengths, w.output_tokens, ts, ns, with_ttft=False).throughput_rps
        / w.rate_factor
        for w in windows
    )
    return (
        operating_windows(fleet, windows, ts, ns, load * capacity, arrival_scv=arrival_scv),
        capacity,
    )


# --------------------------------------------------------------------------------------------
# Baselines and the whole plan


def plan(
    fleet: FleetSpec,
    lengths: LengthDistribution,
    output_tokens: float,
    *,
    threshold_step: float = 100,
    load: float = DEFAULT_LOAD,
    output_scv: float = 0.0,
    arrival_scv: float = 1.0,
    windows: Sequence[WorkloadWindow] = (),
) -> PlanResult:
    """The optimum and the baselines, and the optimum's queue-aware prediction at ``load``
    x its Lambda_max (``at_load``, :func:`scheduling.core.operating.operating_point`).

    ``windows``: the workload as consecutive stretches (a trace, ``lengths`` being all of
    it): the setting is planned for the whole, and the prediction is made at ``load`` x the
    rate its heaviest window sustains (``window_capacity_rps``), each window at its own rate
    and mix (:func:`scheduling.core.operating.operating_windows`).

    * homogeneous: every GPU of the fleet replaced by the PD accelerator, as whole instances
      (floor of GPUs / GPUs per PD instance), optimal split;
    * naive heterogeneous: every request prefills on PrfaaS, every PD instance decodes;
    * equal-cost homogeneous: as many whole PD-accelerator instances as the fleet's GPU-hour
      cost buys (floor: a fractional instance cannot serve), optimal split.
    """
    best = plan_fleet(fleet, lengths, output_tokens, threshold_step=threshold_step, load=load)
    at_load, window_capacity = predict_at_load(
        fleet, lengths, output_tokens, best, load, output_scv, arrival_scv, windows
    )
    ref = reference_pd(fleet)
    n_homog = fleet_gpus(fleet) // ref.gpus_per_instance
    n_equal = math.floor(fleet_cost(fleet) / (ref.gpus_per_instance * ref.gpu_hour_cost) + 1e-9)
    homog = plan_fleet(
        homogeneous_fleet(fleet, n_homog), lengths, output_tokens, threshold_step=threshold_step
    )
    equal = plan_fleet(
        homogeneous_fleet(fleet, n_equal), lengths, output_tokens, threshold_step=threshold_step
    )
    # The paper's naive baseline sends every request to PrfaaS; it has no local prefill for a
    # guard to spill to, so it is planned within a link that refuses at most 1%.
    naive = evaluate(fleet, lengths, output_tokens, -1.0, 0, refusal_target=NAIVE_REFUSAL_CAP)

    def gain(base: Evaluation) -> float | None:
        return best.throughput_rps / base.throughput_rps if base.throughput_rps > 0 else None

    return PlanResult(
        prfaas=best,
        homogeneous=homog,
        naive_heterogeneous=naive,
        equal_cost_homogeneous=equal,
        homogeneous_instances=n_homog,
        equal_cost_instances=n_equal,
        gains={
            "vs_homogeneous": gain(homog),
            "vs_naive_heterogeneous": gain(naive),
            "vs_equal_cost": gain(equal),
        },
        threshold_step=threshold_step,
        output_tokens=output_tokens,
        mean_input_tokens=lengths.mean,
        at_load=at_load,
        window_capacity_rps=window_capacity,
    )


def plan_scenario(
    scenario: Scenario, *, threshold_step: float = 100, load: float = DEFAULT_LOAD
) -> PlanResult:
    """Plan a scenario's fleet for its workload, with the baselines."""
    return plan_workload(
        fleet_from_scenario(scenario),
        workload_planned(scenario),
        threshold_step=threshold_step,
        load=load,
    )


def plan_workload(
    fleet: FleetSpec,
    workload: PlannedWorkload,
    *,
    threshold_step: float = 100,
    load: float = DEFAULT_LOAD,
) -> PlanResult:
    """:func:`plan` for a scenario's workload as the planner reads it."""
    return plan(
        fleet,
        workload.lengths,
        workload.output_tokens,
        threshold_step=threshold_step,
        load=load,
        output_scv=workload.output_scv,
        windows=workload.windows,
    )
