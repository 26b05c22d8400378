"""The planner's search over thresholds and prefill/decode splits (paper section 3.4.2),
generalised to several PD clusters sharing PrfaaS clusters and links.

Pure Python and numpy (scipy for one LP): no Django. ``scheduling.core.planner`` evaluates and
reports; this module finds the setting.

One PD cluster: exhaustive over the threshold grid x the integer split, vectorised, the exact
argmax (:func:`grid_pick`). Several PD clusters: the feasible set shrinks as Lambda grows, so
Lambda_max is found by bisection; at each Lambda every PD cluster independently picks, among
its (t, split) cells whose local bounds, link and admission allow Lambda, the one that costs
PrfaaS the fewest compute-seconds per second; with one PrfaaS cluster this choice is exact (the
clusters couple only through that sum). With several PrfaaS clusters the cost is measured on the
fastest linked one and the LP checks the result: a heuristic, but every answer is evaluated
exactly.

Then the joint plan is refined (:func:`joint_refine`): Lambda_max is what the fleet sustains,
but a PD cluster that is not the bottleneck has many cells that sustain it; planned alone it
would take the one that maximises its own capacity, which it never reaches, and the fewest
PrfaaS seconds leave it needlessly queued. Each such cluster in turn (others fixed) takes the
cell with the lowest predicted mean TTFT at the planned load x Lambda_max (M/G/c waits at its
PD-P, the shared PrfaaS pool and its decode slots, :mod:`scheduling.core.queueing`), among the
cells that still sustain Lambda_max with the PrfaaS compute that is left: the plan never
assigns more PrfaaS capacity than exists, and never lowers Lambda_max.

Ties (equal Lambda) go to the smaller offload fraction, then the smaller threshold, then fewer
prefill instances: keep traffic local when offloading buys nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import linprog

from scheduling.core.cells import CellModel, PoolLoad, cell_model, pool_costed
from scheduling.core.fleet import FleetSpec, Lengths, PdPool, PrfaasPool, lengths_of
from scheduling.core.offload import guard_curve, guard_rows, offload_split, refusal_cap, spill_bound
from scheduling.core.performance import (
    FloatArray,
    LengthDistribution,
    decode_rate_per_instance,
    kv_bytes,
    prefill_seconds,
)

INF = math.inf

#: Rounds of the joint refinement (each PD cluster re-chooses once per round).
REFINE_ROUNDS = 2


def safe_div(num: float, den: float) -> float:
    if den <= 0:
        return INF if num > 0 or (den == 0 and num == 0) else 0.0
    return num / den


def usable_links(fleet: FleetSpec, c: PdPool) -> list[tuple[PrfaasPool, float]]:
    """Each PrfaaS pool with the egress the planner may plan from it to ``c``."""
    return [(j, fleet.usable_gbps(j.name, c.name)) for j in fleet.prfaas]


def prfaas_lp(
    fleet: FleetSpec, demand: Mapping[str, tuple[float, float]]
) -> tuple[float, dict[tuple[str, str], float]]:
    """Largest Lambda whose offloaded traffic can be routed: ``demand[c] = (s_c p_c, l_long)``.
    Returns Lambda and the flows (req/s per unit... at that Lambda) per (prfaas, pd) pair."""
    names = [c for c, (d, _) in demand.items() if d > 0]
    if not names:
        return INF, {}
    pairs = [
        (j, c)
        for c in names
        for j in fleet.prfaas
        if fleet.link_gbps(j.name, c) > 0 and j.instances > 0
    ]
    n = 1 + len(pairs)
    cost = np.zeros(n)
    cost[0] = -1.0
    a_eq = np.zeros((len(names), n))
    for row, c in enumerate(names):
        a_eq[row, 0] = -demand[c][0]
        for k, (_, cc) in enumerate(pairs):
            if cc == c:
                a_eq[row, 1 + k] = 1.0
    a_ub = np.zeros((len(fleet.prfaas), n))
    b_ub = np.zeros(len(fleet.prfaas))
    for row, j in enumerate(fleet.prfaas):
        b_ub[row] = j.instances
        for k, (jj, c) in enumerate(pairs):
            if jj is j:
                a_ub[row, 1 + k] = float(prefill_seconds(j.prefill, demand[c][1]))
    bounds: list[tuple[float, float | None]] = [(0.0, 1e12)]
    for j, c in pairs:
        bits = float(kv_bytes(fleet.kv_mib, demand[c][1])) * 8.0
        bounds.append((0.0, safe_div(fleet.usable_gbps(j.name, c) * 1e9, bits)))
    res = linprog(
        cost,
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a_eq,
        b_eq=np.zeros(len(names)),
        bounds=bounds,
        method="highs",
    )
    if res.status != 0:
        return 0.0, {}
    lam = float(res.x[0])
    return (INF if lam >= 1e11 else lam), {
        (j.name, c): float(res.x[1 + k]) for k, (j, c) in enumerate(pairs)
    }


def threshold_grid(lengths: LengthDistribution, step: float = 100) -> FloatArray:
    """Thresholds ``step`` apart covering the support, from one below the shortest length
    (offload everything) to one at or above the longest (offload nothing)."""
    if step <= 0:
        raise ValueError("threshold step must be positive")
    lo, hi = lengths.support
    start = step * math.floor(lo / step)
    if start >= lo:
        start -= step
    end = step * math.ceil(hi / step)
    return np.asarray(start + step * np.arange(round((end - start) / step) + 1), dtype=float)


def fleet_threshold_grid(lengths: Lengths, fleet: FleetSpec, step: float) -> FloatArray:
    """One threshold grid covering every PD cluster's lengths."""
    grids = [threshold_grid(lengths_of(lengths, c.name), step) for c in fleet.pd]
    return np.unique(np.concatenate(grids)) if len(grids) > 1 else grids[0]


@dataclass(frozen=True)
class Grid:
    """Per-cluster arrays over thresholds (K) and prefill counts (M)."""

    thresholds: FloatArray  # K
    p: FloatArray  # K: share offloaded (admitted by the links)
    want: FloatArray  # K: share above the threshold (offloaded, or refused by the links)
    n_p: FloatArray  # M
    bound_prfaas: FloatArray  # K: this cluster alone on the PrfaaS stage
    bound_admit: FloatArray  # K: the links' admission at the planned load (0: never admissible)
    bound_pd_p: FloatArray  # K x M
    bound_pd_d: FloatArray  # M
    work: FloatArray  # K: PrfaaS compute-seconds per unit Lambda (fastest linked PrfaaS)
    egress: FloatArray  # K: Gbps per unit Lambda
    link_total: float  # Gbps the planner may plan onto the cluster's links
    l_long: FloatArray  # K (nan where nothing is offloaded)
    load: float  # the planned load the admission bound is judged at
    #: no cap on refusals: the link guard keeps the link within its capacity (what it cannot
    #: carry prefills locally, in ``bound_pd_p``), so the egress needs no check of its own
    spill: bool = False

    def link_ok(self, lam: float) -> NDArray[np.bool_]:
        """K: thresholds whose links carry their offloads at ``lam``."""
        if self.spill:
            return np.ones(len(self.p), dtype=bool)
        return np.asarray((self.egress * lam <= self.link_total + 1e-12) | (self.p <= 0))

    @property
    def local(self) -> FloatArray:
        return np.minimum(self.bound_pd_p, self.bound_pd_d[None, :])

    @property
    def remote(self) -> FloatArray:
        return np.minimum(self.bound_prfaas, self.bound_admit)

    @property
    def throughput(self) -> FloatArray:
        return np.minimum(self.local, self.remote[:, None])


def grid_build(
    fleet: FleetSpec,
    c: PdPool,
    lengths: LengthDistribution,
    output_tokens: float,
    thresholds: FloatArray,
    n_range: tuple[int, int],
    load: float,
    refusal_target: float | None,
) -> Grid:
    sp = offload_split(fleet, c, lengths, thresholds, load=load, refusal_target=refusal_target)
    cap = refusal_cap(fleet, c.name, refusal_target)
    p = sp.offload
    s = c.share
    long_ok = np.nan_to_num(sp.l_offload, nan=lengths.support[1])
    short_ok = np.nan_to_num(sp.l_local, nan=lengths.support[0])
    n = np.arange(n_range[0], n_range[1] + 1, dtype=float)
    rate = decode_rate_per_instance(c.max_batch, c.step_seconds, output_tokens)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_short = prefill_seconds(c.prefill, short_ok)
        local_load = (1 - p) * s * t_short  # PD-P seconds per unit Lambda
        pdp = np.where(local_load[:, None] > 0, n[None, :] / local_load[:, None], INF)
        pdd = (c.instances - n) * rate / s if s > 0 else np.full(n.shape, INF)
        capacity = np.zeros_like(p)
        compute = np.zeros_like(p)
        carried = np.zeros_like(p)  # offloads/s the links carry when compute does not bind
        work = np.full_like(p, INF)
        link_total = 0.0
        for j, gbps in usable_links(fleet, c):
            if j.instances <= 0 or gbps <= 0:
                continue
            t_long = prefill_seconds(j.prefill, long_ok)
            line = gbps * 1e9 / (kv_bytes(fleet.kv_mib, long_ok) * 8.0)
            capacity += np.minimum(j.instances / t_long, line)
            compute += j.instances / t_long
            carried += line
            work = np.minimum(work, s * p * t_long)
            link_total += gbps
        demand = s * p
        if cap is None:
            # The link guard: offloads beyond what the links carry prefill locally (at the
            # PD cluster's own prefill time of the offloaded lengths), so a thin link caps the
            # offloaded rate instead of Lambda. PrfaaS compute still bounds Lambda (Eq. 3)
            # where it binds before the links do.
            coarse = guard_rows(lengths, thresholds)
            curve = guard_curve(fleet, c, lengths, coarse)
            # Each threshold takes the smaller bound of the coarse curves on either side.
            above = np.clip(np.searchsorted(coarse, thresholds), 0, len(coarse) - 1)
            below = np.clip(np.searchsorted(coarse, thresholds, side="right") - 1, 0, None)
            peak = curve.carried.max(axis=1)
            most = np.minimum(carried, np.maximum(peak[above], peak[below]))
            spills = most < compute
            prf = np.where((demand > 0) & ~spills, compute / np.where(demand > 0, demand, 1.0), INF)
            t_local = prefill_seconds(c.prefill, long_ok)
            pdp = np.minimum(
                spill_bound(pdp, n, s, p, t_short, t_local, curve, above),
                spill_bound(pdp, n, s, p, t_short, t_local, curve, below),
            )
            admit = np.full_like(p, INF)
        else:
            prf = np.where(demand > 0, capacity / np.where(demand > 0, demand, 1.0), INF)
            admit = np.where(demand > 0, sp.admit_rate / (load * np.where(s > 0, s, 1.0)), INF)
            admit = np.where(sp.refused > cap, 0.0, admit)
        work = np.where(demand > 0, work, 0.0)
        egress = demand * kv_bytes(fleet.kv_mib, long_ok) * 8.0 / 1e9
    return Grid(
        thresholds,
        p,
        sp.want,
        n,
        prf,
        admit,
        pdp,
        pdd,
        work,
        egress,
        link_total,
        sp.l_offload,
        load,
        spill=cap is None,
    )


def compute_bound(instances: int, flows: list[tuple[float, float, float]]) -> float:
    """Largest Lambda with sum_c min(d_c Lambda, carried_c) T_c within ``instances`` (each
    flow: offloads per unit Lambda d_c, PrfaaS seconds T_c, what its links carry)."""
    full = sum(d * t for d, t, a in flows if not math.isfinite(a))
    capped = sorted((a / d, d, t, a) for d, t, a in flows if math.isfinite(a) and d > 0)
    slope = full + sum(d * t for _, d, t, _ in capped)
    used = 0.0  # compute of the flows already at their link's limit
    start = 0.0
    for knee, d, t, a in capped:
        if slope > 0 and (instances - used) / slope <= knee:
            return max(start, (instances - used) / slope)
        used += a * t
        slope -= d * t
        start = knee
    if used > instances:
        return start
    return safe_div(instances - used, slope) if slope > 0 else INF


def exact_best(
    g: Grid,
    name: str,
    choice: dict[str, tuple[float, int]],
    coarse: FloatArray,
    value: Callable[[dict[str, tuple[float, int]]], float],
) -> dict[str, tuple[float, int]]:
    """The grid's spill bounds read the guard's curves at ``coarse`` thresholds; by ``value``
    (Lambda_max evaluated exactly), the best of ``choice``, the best cell that offloads
    nothing and the best split at each coarse threshold (ties to the earlier: ``choice``,
    then fewer offloads)."""
    ks = np.unique(np.clip(np.searchsorted(g.thresholds, coarse), 0, len(g.thresholds) - 1))
    local = np.flatnonzero(g.p <= 0)
    order = [int(local[-1])] if local.size else []
    order += [int(k) for k in ks[::-1] if g.p[k] > 0]
    candidates = [choice]
    for k in order:
        m = int(np.argmax(np.round(g.throughput[k], 12)))
        candidates.append({name: (float(g.thresholds[k]), int(g.n_p[m]))})
    best, best_value = choice, -1.0
    for pick in candidates:
        v = value(pick)
        if v > best_value * (1 + 1e-9):
            best, best_value = pick, v
    return best


def grid_pick(lam: FloatArray, p: FloatArray, t: FloatArray, n: FloatArray) -> tuple[int, int]:
    """Argmax of Lambda over a K x M grid with the documented tie-break."""
    k_idx, m_idx = np.meshgrid(np.arange(lam.shape[0]), np.arange(lam.shape[1]), indexing="ij")
    lam_r = np.round(lam, 12)
    keys = (n[m_idx].ravel(), t[k_idx].ravel(), p[k_idx].ravel(), -lam_r.ravel())
    best = int(np.lexsort(keys)[0])
    return int(k_idx.ravel()[best]), int(m_idx.ravel()[best])


def split_range(c: PdPool, split_bounds: Mapping[str, tuple[int, int]] | None) -> tuple[int, int]:
    lo, hi = 0, c.instances
    if split_bounds and c.name in split_bounds:
        lo, hi = split_bounds[c.name]
        lo, hi = max(0, int(lo)), min(c.instances, int(hi))
        if lo > hi:
            raise ValueError(f"{c.name}: empty range of prefill instances")
    return lo, hi


def _choose(
    fleet: FleetSpec, grids: Mapping[str, Grid], active: list[PdPool], lam: float
) -> dict[str, tuple[int, int]] | None:
    """For each cluster the cell allowing ``lam`` that costs PrfaaS least, or None."""
    out = {}
    for c in active:
        g = grids[c.name]
        local = g.local
        ok = (local >= lam) & g.link_ok(lam)[:, None]
        ok &= (g.remote >= lam)[:, None]
        rows = np.flatnonzero(ok.any(axis=1))
        if rows.size == 0:
            return None
        # Fewest PrfaaS compute-seconds, then fewer offloads, then the smaller threshold.
        k = int(rows[np.lexsort((g.thresholds[rows], g.want[rows], g.work[rows]))[0]])
        cols = np.flatnonzero(ok[k])
        m = int(cols[np.lexsort((g.n_p[cols], -np.round(local[k, cols], 12)))[0]])
        out[c.name] = (k, m)
    return out


def _feasible(
    fleet: FleetSpec, grids: Mapping[str, Grid], active: list[PdPool], lam: float
) -> dict[str, tuple[int, int]] | None:
    pick = _choose(fleet, grids, active, lam)
    if pick is None:
        return None
    if len(fleet.prfaas) <= 1:
        cap = fleet.prfaas[0].instances if fleet.prfaas else 0
        work = sum(
            float(grids[c.name].work[k]) for c, (k, _) in zip(active, pick.values(), strict=True)
        )
        return pick if work * lam <= cap + 1e-9 else None
    demand = {}
    for c in active:
        g = grids[c.name]
        k, _ = pick[c.name]
        demand[c.name] = (c.share * float(g.p[k]), float(g.l_long[k]))
    lam_max, _ = prfaas_lp(fleet, demand)
    return pick if lam_max >= lam * (1 - 1e-9) else None


def _bisect_pick(
    fleet: FleetSpec, grids: dict[str, Grid], active: list[PdPool]
) -> tuple[float, dict[str, tuple[int, int]]]:
    """The largest Lambda every cluster sustains at once, and the cells that do."""
    hi = min(float(np.max(grids[c.name].local)) for c in active)
    lo = 0.0
    best = _feasible(fleet, grids, active, 0.0)
    if best is None:
        raise ValueError("no feasible setting")
    if math.isfinite(hi) and _feasible(fleet, grids, active, hi) is not None:
        lo = hi
    else:
        for _ in range(80):
            mid = (lo + hi) / 2
            if mid <= lo or mid >= hi:
                break
            pick = _feasible(fleet, grids, active, mid)
            if pick is None:
                hi = mid
            else:
                lo = mid
    best = _feasible(fleet, grids, active, lo) or best
    return lo, best


def joint_search(
    fleet: FleetSpec,
    grids: dict[str, Grid],
    active: list[PdPool],
    *,
    lengths: Lengths,
    output_tokens: float,
    output_scv: float,
    load: float,
) -> dict[str, tuple[float, int]]:
    """Lambda_max of several PD clusters by bisection, then the refined cells (see module)."""
    lam, pick = _bisect_pick(fleet, grids, active)
    pick = joint_refine(
        fleet,
        grids,
        active,
        pick,
        lam,
        lengths=lengths,
        output_tokens=output_tokens,
        output_scv=output_scv,
        load=load,
    )
    return {
        c.name: (float(grids[c.name].thresholds[k]), int(grids[c.name].n_p[m]))
        for c, (k, m) in ((c, pick[c.name]) for c in active)
    }


def _supports(fleet: FleetSpec, g: Grid, lam: float) -> np.ndarray:
    """Cells (K x M) of a cluster that sustain ``lam`` on their own (local, link, admission)."""
    ok = (g.local >= lam) & g.link_ok(lam)[:, None]
    return np.asarray(ok & (g.remote >= lam)[:, None])


def joint_refine(
    fleet: FleetSpec,
    grids: Mapping[str, Grid],
    active: list[PdPool],
    pick: dict[str, tuple[int, int]],
    lam: float,
    *,
    lengths: Lengths,
    output_tokens: float,
    output_scv: float,
    load: float,
) -> dict[str, tuple[int, int]]:
    """Each PD cluster's cell with the lowest predicted mean TTFT at ``load`` x ``lam`` among
    those that sustain ``lam`` within the PrfaaS compute the others leave (see module).

    Several PrfaaS pools are costed as one (their instances together, the fastest one's
    prefill times, as the search's work measure) and the result is checked by the LP; a
    cluster whose new cell the LP refuses keeps its old one."""
    live = [p for p in fleet.prfaas if p.instances > 0]
    pool = pool_costed(fleet)
    if pool is None or len(active) < 2 or not (lam > 0 and math.isfinite(lam)):
        return pick
    out = dict(pick)
    demand: dict[str, tuple[FloatArray, FloatArray, FloatArray]] = {}

    def model(c: PdPool, others: PoolLoad) -> CellModel:
        g = grids[c.name]
        return cell_model(
            fleet,
            c,
            pool,
            lengths_of(lengths, c.name),
            g.thresholds,
            g.n_p,
            load * lam * c.share,
            output_tokens=output_tokens,
            output_scv=output_scv,
            others=others,
        )

    for _ in range(REFINE_ROUNDS):
        for c in active:
            g = grids[c.name]
            others = [o for o in active if o.name != c.name]
            # What the other clusters' chosen cells ask of the pool, at capacity and at load.
            work = sum(float(grids[o.name].work[out[o.name][0]]) for o in others)
            load_of_others = PoolLoad()
            for o in others:
                if o.name not in demand:
                    demand[o.name] = model(o, PoolLoad()).demand
                k = out[o.name][0]
                rate_o, s1_o, s2_o = (float(v[k]) for v in demand[o.name])
                load_of_others = PoolLoad(
                    load_of_others.rate + rate_o, load_of_others.s1 + s1_o, load_of_others.s2 + s2_o
                )
            mine = model(c, load_of_others)
            demand[c.name] = mine.demand
            ttft = mine.mean_ttft()
            ok = _supports(fleet, g, lam)
            ok &= ((work + g.work) * lam <= pool.instances + 1e-9)[:, None]
            ok &= np.isfinite(ttft)
            if not ok.any():
                continue
            cost = np.where(ok, ttft, INF)
            best = float(cost.min())
            k0, m0 = out[c.name]
            if not best < cost[k0, m0] - 1e-9:
                continue  # the current cell is as good: keep it (stable under rounds)
            chosen = grid_pick(-cost, g.want, g.thresholds, g.n_p)
            if len(live) > 1 and not _routable(fleet, grids, active, {**out, c.name: chosen}, lam):
                continue
            out[c.name] = chosen
    return out


def _routable(
    fleet: FleetSpec,
    grids: Mapping[str, Grid],
    active: list[PdPool],
    pick: Mapping[str, tuple[int, int]],
    lam: float,
) -> bool:
    """Whether the PrfaaS pools and links can carry these cells' offloads at ``lam`` (LP)."""
    demand = {
        c.name: (c.share * float(grids[c.name].p[k]), float(grids[c.name].l_long[k]))
        for c in active
        for k, _ in (pick[c.name],)
    }
    lam_max, _ = prfaas_lp(fleet, demand)
    return lam_max >= lam * (1 - 1e-9)
