"""What the router does with a PD cluster's requests at each threshold, as the planner's
search needs it: which requests are offloaded, which the link refuses, and how fast offloads
may arrive before the link refuses too many (:mod:`scheduling.core.link`).

Pure Python and numpy: no Django. Arrays run over a grid of thresholds.

For a threshold t, the requests above t want PrfaaS. The router refuses, every time, only
those no linked link may ever carry (``refused``: always ``link_congested``, so they prefill
locally; since issue 28 only on links without a budget, :func:`scheduling.core.link.link_never_fits`:
one whose KV alone exceeds the budget is admitted alone on an idle link); the others are
offloaded (``offload``) unless the link is full when they arrive; then they prefill locally
too. Only when an operator caps the refused share
(``max_refused_share`` on a link, :func:`refusal_cap`; no cap by default) is the offload rate
limited: ``admit_rate`` is, per threshold, the
largest rate of arrivals at the cluster (req/s) at which the share of offloads refused stays
within ``(refusal_target - refused) / offload`` (capped at
:data:`~scheduling.core.link.MAX_OFFLOAD_REFUSAL`), i.e. the decisions the link refuses stay
within ``refusal_target``. It is evaluated at the operating load ``load`` (the planner plans a
fleet to run at that share of its capacity): offloads wait for a PrfaaS prefill as at an M/G/c
station at utilisation ``load`` (an upper bound: the pool is at most that busy at that load)
and stream on a link at ``load`` times its target utilisation.

The admission limit is computed on a coarse set of thresholds (quantiles of the lengths) and
read at every threshold of the grid as the smaller of its two neighbours'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from scheduling.core.fleet import FleetSpec, PdPool, PrfaasPool
from scheduling.core.link import (
    MAX_OFFLOAD_REFUSAL,
    Link,
    OffloadMix,
    PoolCrowd,
    link_admissible_rate,
    link_never_fits,
    link_refusal,
    link_refused_cap,
    transfer_excess_s,
)
from scheduling.core.performance import (
    FloatArray,
    LengthDistribution,
    Table,
    kv_bytes,
    prefill_seconds,
)
from scheduling.core.queueing import mgc_crowd, mgc_wait

#: Offered rates per threshold at which the link guard's carried rate is computed.
GUARD_POINTS = 20
#: The cap on refused decisions for a PD cluster of a fleet with several PrfaaS pools.
SEVERAL_POOLS_REFUSAL_CAP = 0.01
#: Thresholds (quantiles of the lengths) at which the admission limit is computed.
ADMISSION_POINTS = 49
#: Length nodes the admission model works on (the distribution's own nodes, merged).
ADMISSION_NODES = 384


@dataclass(frozen=True)
class OffloadSplit:
    """Per threshold: shares of a cluster's requests offloaded and always refused, the mean
    lengths of the offloaded and of the locally prefilled ones, and the admission limit."""

    thresholds: FloatArray
    want: FloatArray  # P(L > t)
    offload: FloatArray  # P(t < L, a linked link may carry it: link_never_fits)
    refused: FloatArray  # P(t < L, no linked link ever carries it): always refused
    l_offload: FloatArray  # E[L | offloaded] (nan where nothing is)
    l_local: FloatArray  # E[L | prefilled locally] (nan where nothing is)
    admit_rate: FloatArray  # arrivals at the cluster (req/s) the links admit, see the module


def linked_pools(fleet: FleetSpec, cluster: str) -> list[tuple[Link, PrfaasPool]]:
    """The live links into ``cluster`` with the PrfaaS pool behind each (links down, or to a
    pool without instances, carry nothing)."""
    pools = {p.name: p for p in fleet.prfaas}
    out = []
    for link in fleet.links:
        pool = pools.get(link.source)
        if link.target == cluster and link.gbps > 0 and pool is not None and pool.instances > 0:
            out.append((link, pool))
    return out


def refusal_cap(fleet: FleetSpec, cluster: str, override: float | None = None) -> float | None:
    """The cap on the share of ``cluster``'s decisions its links may refuse: ``override`` when
    given, else the tightest of its links' ``max_refused_share`` (``None``: no cap, the
    default; refused offloads prefill locally and the planner plans them so)."""
    if override is not None:
        return link_refused_cap(override)
    caps = [
        link_refused_cap(link.max_refused_share)
        for link, _ in linked_pools(fleet, cluster)
        if link.max_refused_share is not None
    ]
    cap = min((c for c in caps if c is not None), default=None)
    if cap is None and len([p for p in fleet.prfaas if p.instances > 0]) > 1:
        # Several PrfaaS pools are routed by an LP within their links' line rates; the guard's
        # spill to local prefill is not modelled there, so their refusals stay capped.
        return SEVERAL_POOLS_REFUSAL_CAP
    return cap


def fit_limit_tokens(fleet: FleetSpec, budget: float, hi: float) -> float:
    """The longest prompt (tokens) a link of ``budget`` bytes may carry (the router's rule,
    :func:`scheduling.core.link.link_never_fits`: one bigger than the budget alone on an idle
    link, so ``inf`` on any link with a budget; 0 on one without)."""
    return _fit_limit(fleet.kv_mib, float(budget), float(hi))


@lru_cache(maxsize=256)
def _fit_limit(kv_mib: Table, budget: float, hi: float) -> float:
    grid = np.geomspace(1.0, max(hi, 2.0), 4097)
    over = link_never_fits(kv_bytes(kv_mib, grid), budget)
    if not over.any():
        return math.inf
    first = int(np.argmax(over))
    if first == 0:
        return 0.0
    lo_x, hi_x = grid[first - 1], grid[first]
    lo_y, hi_y = (float(v) for v in kv_bytes(kv_mib, [lo_x, hi_x]))
    share = (budget - lo_y) / (hi_y - lo_y) if hi_y > lo_y else 0.0
    return float(lo_x + share * (hi_x - lo_x))


def coarse_nodes(
    lengths: LengthDistribution, count: int = ADMISSION_NODES
) -> tuple[FloatArray, FloatArray]:
    """The distribution's quadrature nodes merged into at most ``count`` (weighted means of
    consecutive nodes), for models that need many evaluations."""
    x, w = lengths.nodes()
    order = np.argsort(x, kind="stable")
    x, w = np.asarray(x, dtype=float)[order], np.asarray(w, dtype=float)[order]
    if len(x) <= count:
        return x, w
    starts = np.array([g[0] for g in np.array_split(np.arange(len(x)), count)])
    ws = np.add.reduceat(w, starts)
    xw = np.add.reduceat(x * w, starts)
    xs = np.where(ws > 0, xw / np.where(ws > 0, ws, 1.0), x[starts])
    return xs, ws


def _tail_between(
    lengths: LengthDistribution, lo: FloatArray, hi: float
) -> tuple[FloatArray, FloatArray]:
    """P(lo < L <= hi) and E[L; lo < L <= hi], elementwise over ``lo``."""
    top = np.maximum(lo, hi)
    mass = np.maximum(lengths.tail(lo) - lengths.tail(top), 0.0)
    part = np.maximum(lengths.partial_mean_above(lo) - lengths.partial_mean_above(top), 0.0)
    return np.asarray(mass), np.asarray(part)


def offload_split(
    fleet: FleetSpec,
    cluster: PdPool,
    lengths: LengthDistribution,
    thresholds: FloatArray,
    *,
    load: float,
    refusal_target: float | None = None,
    exact: bool = False,
) -> OffloadSplit:
    """The router's treatment of ``cluster``'s requests at every threshold (see the module).

    ``refusal_target``: the cap on refused decisions (:func:`refusal_cap`); without one (the
    default) ``admit_rate`` is infinite: the link guard refuses what does not fit and the
    refused offloads prefill locally. ``exact``: compute the admission limit at every
    threshold given (for a few), instead of on the coarse set of quantiles.
    """
    cap = refusal_cap(fleet, cluster.name, refusal_target)
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    want = np.asarray(lengths.tail(t), dtype=float)
    want = np.where(want <= 1e-12, 0.0, np.where(want >= 1 - 1e-12, 1.0, want))
    mean = lengths.mean
    links = linked_pools(fleet, cluster.name)
    lo, hi = lengths.support
    if links:
        fits_up_to = fit_limit_tokens(fleet, max(link.budget for link, _ in links), hi)
        offload, part = _tail_between(lengths, t, fits_up_to)
        offload = np.where(want <= 0, 0.0, np.minimum(offload, want))
        refused = np.maximum(want - offload, 0.0)
    else:
        offload = np.zeros_like(t)
        part = np.zeros_like(t)
        refused = np.zeros_like(t)
    eps = 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        l_off = np.where(offload > eps, part / np.where(offload > eps, offload, 1.0), np.nan)
        rest = 1.0 - offload
        l_loc = np.where(rest > eps, (mean - part) / np.where(rest > eps, rest, 1.0), np.nan)
    l_off = np.clip(l_off, np.maximum(t, lo), hi)
    l_loc = np.clip(l_loc, lo, hi)
    admit = np.full_like(t, math.inf)
    if links and cap is not None:
        admit = _admission(fleet, links, lengths, t, offload, refused, load, cap, exact)
    return OffloadSplit(t, want, offload, refused, l_off, l_loc, admit)


def guard_rows(lengths: LengthDistribution, thresholds: FloatArray) -> FloatArray:
    """The coarse thresholds (quantiles of the lengths, and the grid's ends) at which a grid's
    guard curves are computed; each grid threshold reads the next one up."""
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    rows = lengths.quantile(np.linspace(0.0, 1.0, ADMISSION_POINTS))
    return np.unique(np.concatenate([[t[0]], np.asarray(rows, dtype=float), [t[-1]]]))


@dataclass(frozen=True)
class GuardCurve:
    """Per row (threshold): offloads/s offered to a PD cluster's links on a grid of rates
    (``offered``, rows x points, ascending) and what the links carry of them (``carried``);
    the guard keeps the rest local."""

    offered: FloatArray
    carried: FloatArray

    def carried_at(self, row: int, rate: float) -> float:
        """Offloads/s carried when ``rate`` are offered (beyond the grid: its last value)."""
        return float(np.interp(rate, self.offered[row], self.carried[row]))


def guard_curve(
    fleet: FleetSpec,
    cluster: PdPool,
    lengths: LengthDistribution,
    thresholds: FloatArray,
    *,
    points: int = GUARD_POINTS,
) -> GuardCurve:
    """Per threshold, what the links into ``cluster`` carry of the offloads offered to them
    at rates up to twice what their target share of the line rate carries on average: the
    guard's refusals (:func:`scheduling.core.link.link_refusal`: budget knapsack, saturation,
    reservations held for the prefill, the transfer's excess on an idle link and one RTT;
    no PrfaaS queue), and never more than that target share. Several links share a cluster's
    offloads in proportion to their pools' instances."""
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    rows = len(t)
    links = linked_pools(fleet, cluster.name)
    if not links:
        zero = np.zeros((rows, points))
        return GuardCurve(zero, zero)
    x, w = coarse_nodes(lengths)
    kv = kv_bytes(fleet.kv_mib, x)
    budget = max(link.budget for link, _ in links)
    offered_w = w[None, :] * ((x[None, :] > t[:, None]) & ~link_never_fits(kv, budget)[None, :])
    share = offered_w.sum(axis=1)
    live = share > 0
    safe = np.where(live, share, 1.0)
    mean_kv = np.maximum((offered_w @ kv) / safe, 1.0)
    line = sum(link.usable_gbps for link, _ in links) * 1e9 / 8 / mean_kv
    grid = np.where(live, 2.0 * line, 0.0)[:, None] * np.geomspace(1e-3, 1.0, points)[None, :]
    carried = np.zeros((rows, points))
    total = sum(j.instances for _, j in links)
    for link, pool in links:
        wl = offered_w * ~link_never_fits(kv, link.budget)[None, :]
        sl = wl.sum(axis=1)
        mix = wl / np.where(sl > 0, sl, 1.0)[:, None]
        service = prefill_seconds(pool.prefill, x)
        hold = service + transfer_excess_s(kv, service, link.gbps, 0.0) + link.rtt_ms / 1000.0
        rate = (grid * (pool.instances / total) * (sl / safe)[:, None]).reshape(-1)
        mixes = np.repeat(mix, points, axis=0)
        # Every offered offload counted as streaming (an upper bound on the streams): the
        # curve ignores the PrfaaS queue and the link's utilisation, which hold reservations
        # longer, and the bound keeps the capacity plan from counting on them.
        offers = OffloadMix(mixes, kv, service, hold)
        refused = link_refusal(rate, offers, 0.0, link.gbps, link.budget)
        mean = (mixes * refused).sum(axis=1)
        carried += (rate * (1.0 - mean)).reshape(rows, points)
    return GuardCurve(grid, np.minimum(carried, line[:, None]))


def spill_bound(
    plain: FloatArray,
    n_p: FloatArray,
    share: float,
    p: FloatArray,
    t_short: FloatArray,
    t_long: FloatArray,
    curve: GuardCurve,
    rows: NDArray[np.int_],
) -> FloatArray:
    """The PD-P bound on Lambda (K x M) when the guard spills to local prefill what the links
    do not carry: the largest Lambda with s Lambda (1 - p) T(l_short) + (o - C(o)) T(l_long)
    within n_p, o = s p Lambda offered and C(o) carried (``curve`` row ``rows[k]`` for
    threshold k). ``plain``: the bound when the links carry everything."""
    out = np.array(plain, dtype=float, copy=True)
    n = np.asarray(n_p, dtype=float)
    for k in range(len(p)):
        if p[k] <= 0 or share <= 0 or not np.any(curve.offered[rows[k]] > 0):
            continue
        # From the origin: below the grid's first rate the links refuse (almost) nothing.
        o = np.concatenate([[0.0], curve.offered[rows[k]]])
        c = np.concatenate([[0.0], curve.carried[rows[k]]])
        lam = o / (share * p[k])
        per = share * ((1 - p[k]) * t_short[k] + p[k] * t_long[k])
        if not (per > 0 and math.isfinite(per)):
            continue
        local = np.maximum.accumulate(lam * per - c * t_long[k])
        beyond = (n + c[-1] * t_long[k]) / per
        within = np.interp(n, local, lam)
        spilled = np.where(n >= local[-1], beyond, within)
        out[k] = np.where(np.isnan(spilled), out[k], np.minimum(out[k], spilled))
    return out


def prfaas_at(
    pool: PrfaasPool, service_s: FloatArray, weights: FloatArray, load: float
) -> tuple[FloatArray, PoolCrowd]:
    """``pool`` running at utilisation ``load`` with the service law of each row of offload
    ``weights``: the mean wait per row, and the crowd it holds."""
    total = weights.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    mean = (weights @ service_s) / safe
    second = (weights @ (service_s * service_s)) / safe
    rows = len(total)
    wait = np.zeros(rows)
    cols = np.zeros((7, rows))
    for k in range(rows):
        if total[k] <= 0 or mean[k] <= 0:
            continue
        scv = max(0.0, second[k] / (mean[k] * mean[k]) - 1.0)
        rate = load * pool.instances / mean[k]
        wait[k] = mgc_wait(rate, float(mean[k]), scv, pool.instances).mean_s
        crowd = mgc_crowd(rate, float(mean[k]), scv, pool.instances)
        cols[:, k] = (
            rate,
            crowd.in_system_mean,
            crowd.in_system_var,
            crowd.busy_mean,
            crowd.busy_var,
            crowd.queue_mean,
            crowd.queue_var,
        )
    return wait, PoolCrowd(*cols)


def _admission(
    fleet: FleetSpec,
    links: list[tuple[Link, PrfaasPool]],
    lengths: LengthDistribution,
    t: FloatArray,
    offload: FloatArray,
    refused: FloatArray,
    load: float,
    refusal_target: float,
    exact: bool,
) -> FloatArray:
    if not 0 < load < 1:
        raise ValueError(f"the operating load must be within (0, 1), got {load!r}")
    if exact or len(t) <= 4:
        rows = t
    else:
        rows = np.unique(lengths.quantile(np.linspace(0.0, 1.0, ADMISSION_POINTS)))
        rows = np.unique(np.concatenate([[t[0]], rows, [t[-1]]]))
    x, w = coarse_nodes(lengths)
    kv = kv_bytes(fleet.kv_mib, x)
    row_off = np.interp(rows, t, offload) if not exact else offload
    row_ref = np.interp(rows, t, refused) if not exact else refused
    with np.errstate(divide="ignore", invalid="ignore"):
        allowed = np.where(
            row_off > 0, (refusal_target - row_ref) / np.where(row_off > 0, row_off, 1.0), 0.0
        )
    allowed = np.clip(allowed, 0.0, MAX_OFFLOAD_REFUSAL)
    # Arrivals at the cluster (req/s) each link admits, summed over the cluster's links.
    per_arrival = np.zeros(len(rows))
    for link, pool in links:
        fits = ~link_never_fits(kv, link.budget)
        mask = (x[None, :] > rows[:, None]) & fits[None, :]
        weights = w[None, :] * mask
        share = weights.sum(axis=1)
        mix_w = weights / np.where(share > 0, share, 1.0)[:, None]
        service = prefill_seconds(pool.prefill, x)
        excess = transfer_excess_s(
            kv, service, link.gbps, load * link.planned_utilisation, link.budget
        )
        mix = OffloadMix(mix_w, kv, service, service + excess + link.rtt_ms / 1000.0)
        wait, crowd = prfaas_at(pool, service, weights, load)
        rate = link_admissible_rate(mix, wait, link.gbps, link.budget, allowed, pool=crowd)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_arrival += np.where(share > 0, rate / np.where(share > 0, share, 1.0), math.inf)
    per_arrival = np.where((row_off > 0) & (allowed <= 0), 0.0, per_arrival)
    if exact or len(t) <= 4:
        return per_arrival
    # Each grid threshold takes the smaller of the limits at the coarse points around it.
    pos = np.searchsorted(rows, t, side="left")
    left = per_arrival[np.clip(pos - 1, 0, len(rows) - 1)]
    right = per_arrival[np.clip(pos, 0, len(rows) - 1)]
    on_point = rows[np.clip(pos, 0, len(rows) - 1)] == t
    return np.where(on_point, right, np.minimum(left, right))
