"""Planning for a TTFT target (goodput).

Pure Python and numpy: no Django. The paper plans for saturation (Lambda_max); an operator with
a TTFT SLO wants the setting that carries the most traffic while the predicted P90 (or another
quantile) TTFT stays within it. :func:`plan_for_slo` finds it (what more PrfaaS instances or
link capacity would gain is :mod:`scheduling.core.sizing`).

The SLO search. Start from the Lambda_max plan. Then, one PD cluster at a time (the others
fixed, two rounds), find the highest arrival rate at which some cell (threshold x split) of
that cluster keeps the fleet's share of requests within the target at or above the quantile,
its link within its target utilisation and its offloads admitted, all cells judged at once by
:class:`scheduling.core.cells.CellModel`; keep that cell. The answer is then confirmed, and its
rate found exactly, with the full operating point (:func:`scheduling.core.operating.
operating_point`: link refusals included). Thresholds are searched on the quantiles of each
cluster's lengths (and the Lambda_max plan's own), not on every 100 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.core.cells import PoolLoad, cell_model, pool_costed
from scheduling.core.fleet import FleetSpec, Lengths, PdPool, PrfaasPool, lengths_of
from scheduling.core.link import DEFAULT_REFUSAL_TARGET
from scheduling.core.offload import refusal_cap
from scheduling.core.operating import (
    OperatingPoint,
    WorkloadWindow,
    operating_point,
    operating_windows,
)
from scheduling.core.search import Grid, grid_pick

#: Coarse thresholds per cluster for the SLO search (quantiles of its lengths).
SLO_THRESHOLDS = 48
#: Rounds of the per-cluster search.
SLO_ROUNDS = 2
#: Bisection steps on the rate (relative precision ~ 2^-steps of the bracket).
RATE_STEPS = 22
#: The goodput rate keeps the predicted quantile within the target even when the traffic runs
#: this much above it: a rate measured over a few thousand requests is off by 1-2%, and the
#: queueing model by a few percent near saturation, where TTFT climbs fastest.
DEFAULT_SLO_HEADROOM = 0.04


@dataclass(frozen=True)
class SloPlan:
    """The setting with the most traffic whose predicted ``quantile`` TTFT is within
    ``slo_s``: ``rate_rps`` (goodput), the setting, and the prediction at that rate."""

    slo_s: float
    quantile: float
    rate_rps: float
    thresholds: Mapping[str, float]
    splits: Mapping[str, int]
    at_rate: OperatingPoint | None


def _admissible(fleet: FleetSpec, op: OperatingPoint, refusal_target: float | None) -> bool:
    """Stable, the links within their target utilisation, refusals within each PD cluster's
    cap (none by default: the guard's refusals prefill locally, counted in the TTFT)."""
    if not op.stable:
        return False
    for c in op.clusters:
        cap = refusal_cap(fleet, c.name, refusal_target)
        if cap is not None and c.refused_fraction > cap + 1e-12:
            return False
    targets = {(lk.source, lk.target): lk.planned_utilisation for lk in fleet.links}
    return all(lk.utilisation <= targets.get((lk.source, lk.target), 1.0) + 1e-9 for lk in op.links)


def slo_rate(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    thresholds: Mapping[str, float],
    splits: Mapping[str, int],
    slo_s: float,
    *,
    quantile: float = 0.9,
    upper_rps: float,
    output_scv: float = 0.0,
    arrival_scv: float = 1.0,
    refusal_target: float | None = DEFAULT_REFUSAL_TARGET,
    headroom: float = DEFAULT_SLO_HEADROOM,
    windows: Sequence[WorkloadWindow] = (),
) -> tuple[float, OperatingPoint | None]:
    """The highest rate (below ``upper_rps``) at which this setting's predicted ``quantile``
    TTFT is within ``slo_s`` and the fleet admissible even ``headroom`` above it, with the
    prediction at the rate itself (0, None when no rate is). ``windows``: the workload
    replayed window by window (a trace): predicted so (:func:`operating_windows`)."""

    def at(rate: float) -> OperatingPoint:
        if windows:
            return operating_windows(
                fleet,
                windows,
                thresholds,
                splits,
                rate,
                arrival_scv=arrival_scv,
                quantile=quantile,
            )
        return operating_point(
            fleet,
            lengths,
            output_tokens,
            thresholds,
            splits,
            rate,
            output_scv=output_scv,
            arrival_scv=arrival_scv,
            quantile=quantile,
        )

    def good(op: OperatingPoint) -> bool:
        return op.ttft_p90_s <= slo_s and _admissible(fleet, op, refusal_target)

    lo, hi = 0.0, upper_rps
    found = 0.0
    top = at(hi * (1 - 1e-9))
    if good(top):
        found = top.rate_rps
    else:
        for _ in range(RATE_STEPS):
            mid = (lo + hi) / 2
            if good(at(mid)):
                lo = found = mid
            else:
                hi = mid
            if hi - lo <= 1e-3 * hi:
                break
    if found <= 0:
        return 0.0, None
    rate = found / (1.0 + headroom)
    return rate, at(rate)


def _coarse(g: Grid, lengths: Lengths, name: str, keep: int) -> np.ndarray:
    """Indices of the grid thresholds the SLO search tries for one cluster."""
    dist = lengths_of(lengths, name)
    wanted = dist.quantile(np.linspace(0.0, 1.0, SLO_THRESHOLDS + 1))
    idx = np.searchsorted(g.thresholds, wanted, side="left")
    idx = np.concatenate([idx, [0, len(g.thresholds) - 1, keep]])
    return np.unique(np.clip(idx, 0, len(g.thresholds) - 1))


def plan_for_slo(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    slo_s: float,
    *,
    grids: Mapping[str, Grid],
    start: Mapping[str, tuple[float, int]],
    capacity_rps: float,
    quantile: float = 0.9,
    output_scv: float = 0.0,
    arrival_scv: float = 1.0,
    refusal_target: float | None = DEFAULT_REFUSAL_TARGET,
    headroom: float = DEFAULT_SLO_HEADROOM,
    windows: Sequence[WorkloadWindow] = (),
) -> SloPlan:
    """The setting and rate of highest goodput under ``slo_s`` (see the module). ``grids`` and
    ``start`` are the Lambda_max search's (:func:`scheduling.core.planner.plan_for_ttft` builds
    them); ``capacity_rps`` bounds the rates tried; ``windows``: a trace's, each setting's
    rate is then judged window by window (:func:`slo_rate`)."""
    if not (slo_s > 0 and math.isfinite(slo_s)):
        raise ValueError(f"the TTFT target must be a positive number of seconds, got {slo_s!r}")
    if not 0 < quantile < 1:
        raise ValueError(f"the quantile must be within (0, 1), got {quantile!r}")
    active = [c for c in fleet.pd if c.share > 0]
    pick: dict[str, tuple[int, int]] = {}
    for c in fleet.pd:
        g = grids[c.name]
        t, n = start[c.name]
        pick[c.name] = (int(np.argmin(np.abs(g.thresholds - t))), int(np.argmin(np.abs(g.n_p - n))))
    pool = pool_costed(fleet)
    shares = sum(c.share for c in active)

    def setting(p: Mapping[str, tuple[int, int]]) -> tuple[dict[str, float], dict[str, int]]:
        return (
            {c.name: float(grids[c.name].thresholds[p[c.name][0]]) for c in fleet.pd},
            {c.name: int(grids[c.name].n_p[p[c.name][1]]) for c in fleet.pd},
        )

    def exact(
        p: Mapping[str, tuple[int, int]], upper: float
    ) -> tuple[float, OperatingPoint | None]:
        ts, ns = setting(p)
        return slo_rate(
            fleet,
            lengths,
            output_tokens,
            ts,
            ns,
            slo_s,
            quantile=quantile,
            upper_rps=upper,
            output_scv=output_scv,
            arrival_scv=arrival_scv,
            refusal_target=refusal_target,
            headroom=headroom,
            windows=windows,
        )

    best_rate, best_op = exact(pick, capacity_rps)
    for _ in range(SLO_ROUNDS if len(active) > 1 else 1):
        changed = False
        for c in active:
            g = grids[c.name]
            rows = _coarse(g, lengths, c.name, pick[c.name][0])
            feasible = _cells_within(
                fleet,
                lengths,
                output_tokens,
                output_scv,
                arrival_scv,
                grids,
                pick,
                c,
                rows,
                slo_s,
                quantile,
                shares,
                pool,
            )
            lo, hi = best_rate * (1.0 + headroom), capacity_rps
            found: tuple[int, int] | None = None
            if feasible(lo) is None:
                continue
            for _ in range(RATE_STEPS):
                mid = (lo + hi) / 2
                cell = feasible(mid)
                if cell is None:
                    hi = mid
                else:
                    lo, found = mid, cell
                if hi - lo <= 1e-3 * hi:
                    break
            if found is None or (int(rows[found[0]]), found[1]) == pick[c.name]:
                continue
            trial = {**pick, c.name: (int(rows[found[0]]), found[1])}
            rate, op = exact(trial, capacity_rps)
            if rate > best_rate * (1 + 1e-6):
                pick, best_rate, best_op, changed = trial, rate, op, True
        if not changed:
            break
    ts, ns = setting(pick)
    return SloPlan(slo_s, quantile, best_rate, ts, ns, best_op)


def _cells_within(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    output_scv: float,
    arrival_scv: float,
    grids: Mapping[str, Grid],
    pick: Mapping[str, tuple[int, int]],
    c: PdPool,
    rows: np.ndarray,
    slo_s: float,
    quantile: float,
    shares: float,
    pool: PrfaasPool | None,
) -> Callable[[float], tuple[int, int] | None]:
    """For cluster ``c`` (the others at their picked cells): a function of the total rate
    giving the best cell (index into ``rows``, split) that meets the target there, or None."""
    g = grids[c.name]
    others = [o for o in fleet.pd if o.name != c.name and o.share > 0]

    def at(rate: float) -> tuple[int, int] | None:
        demand = PoolLoad()
        within_others = 0.0
        models = {}
        for o in others:
            go = grids[o.name]
            k, m = pick[o.name]
            mo = cell_model(
                fleet,
                o,
                pool,
                lengths_of(lengths, o.name),
                go.thresholds[[k]],
                go.n_p[[m]],
                rate * o.share,
                output_tokens=output_tokens,
                output_scv=output_scv,
                scv_arrival=arrival_scv,
            )
            models[o.name] = (mo, k, m)
            r, s1, s2 = (float(v[0]) for v in mo.demand)
            demand = PoolLoad(demand.rate + r, demand.s1 + s1, demand.s2 + s2)
        mine = cell_model(
            fleet,
            c,
            pool,
            lengths_of(lengths, c.name),
            g.thresholds[rows],
            g.n_p,
            rate * c.share,
            output_tokens=output_tokens,
            output_scv=output_scv,
            others=demand,
            scv_arrival=arrival_scv,
        )
        # The others meet the pool as this cluster's current cell leaves it.
        k_now = int(np.searchsorted(rows, pick[c.name][0]))
        k_now = min(k_now, len(rows) - 1)
        for o in others:
            mo, k, m = models[o.name]
            rest = PoolLoad(
                demand.rate - float(mo.demand[0][0]) + float(mine.demand[0][k_now]),
                demand.s1 - float(mo.demand[1][0]) + float(mine.demand[1][k_now]),
                demand.s2 - float(mo.demand[2][0]) + float(mine.demand[2][k_now]),
            )
            go = grids[o.name]
            again = cell_model(
                fleet,
                o,
                pool,
                lengths_of(lengths, o.name),
                go.thresholds[[k]],
                go.n_p[[m]],
                rate * o.share,
                output_tokens=output_tokens,
                output_scv=output_scv,
                others=rest,
                scv_arrival=arrival_scv,
            )
            within_others += o.share * float(again.within(slo_s)[0, 0])
        within = (c.share * mine.within(slo_s) + within_others) / shares
        ok = within >= quantile
        ok &= g.link_ok(rate)[rows][:, None]
        # Offloads admitted at this rate (the grid's limit is on Lambda at the planned load).
        ok &= (g.bound_admit[rows] * g.load >= rate)[:, None]
        if not ok.any():
            return None
        score = np.where(ok, within, -np.inf)
        return grid_pick(score, g.want[rows], g.thresholds[rows], g.n_p)

    return at
