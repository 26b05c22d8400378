"""One model of a cross-datacenter link, shared by the router (what it admits), the planner
(what it plans within) and the simulator (what it enforces).

Pure Python and numpy: no Django, no Redis. Units: bytes, seconds, Gbps = 10^9 bit/s.

**Admission** (the router's rule, :func:`link_admits`): an offload may use a link when the
link's egress utilisation is below 1 (a saturated link takes nothing more) and the bytes the
decision reserves fit the link's in-flight budget (reserved + new <= budget). A reservation
bigger than the whole budget is admitted only on an idle link (nothing reserved): it then holds
the link alone, and every other offload is refused until it lands (issue 28, item 2: on the
thin-link fleets this beats refusing it every time, docs/planner.md). The router (its
decision and the server's atomic reservation), the simulator (which routes through the router)
and the planner (:func:`link_never_fits`, :func:`link_refusal`) apply this one rule.

**Reservation lifetime**: bytes are reserved when the decision is taken (the server's atomic
Redis reservation, the simulator's dispatch) and released when the transfer ends (the KV has
landed at the decode side, one RTT after its last byte). A request queued for a PrfaaS prefill
therefore already holds its bytes: on a thin link the budget, not the line rate, is often the
binding limit.

**Defaults** (the router's): a link without a budget may hold
:data:`DEFAULT_LINK_BUDGET_SECONDS` of its line rate; a link without a target utilisation
uses :data:`DEFAULT_TARGET_UTILISATION`, the router's ``RouteGuards.scarce_utilisation`` default:
the egress share at which the router calls bandwidth scarce and its short-term controller
raises the threshold. The planner never plans a link's mean egress above its target.

**Refusals, as the planner predicts them**: offloads arrive as a Poisson stream of a mix of
request kinds (KV bytes, reservation life). Two things refuse one:

* the budget: the reserved bytes form a *stochastic knapsack* (Kaufman-Roberts recursion over
  the budget cut into :data:`BUDGET_UNITS` units, :mod:`scheduling.core.knapsack`). Its occupancy law is insensitive to the
  holding-time distribution, so only each kind's mean reservation life matters. A request
  whose KV alone exceeds the budget is one kind of reservation that takes the whole budget:
  the knapsack admits it only when nothing else is reserved, as the router does.
* saturation: while prefilling, a transfer streams at most ``kv / prefill`` (layer-wise
  pipelining) and at most the line rate, for ``max(prefill, kv / line)`` seconds; a moved
  prefix streams at the line rate; the link is saturated when the streams add up to it.

The operating point (:func:`link_outlook`) judges both on their *joint* law: each kind is
three classes that hold its budget units (not streaming, streaming its KV, streaming a moved
prefix), the knapsack recursion carries the streams' rate along, so an offload is refused
when there is no room *or* the line is saturated, neither double-counted (on a thin link one
transfer nearly fills both) nor missed (on a wider one few streams fit in the budget at once:
counted on their own they saturate the line three times as often as the simulator's, issue
28). It also says how full the budget is while the egress is abundant (the router then moves
prefixes) and while it is not. A grid of settings is screened more cheaply
(:func:`link_refusal`, :func:`link_admissible_rate`): each on its own law, the larger taken.
Transfers are assumed to share the link fairly (processor sharing): a transfer of ``kv``
bytes on a link at utilisation ``rho`` takes about ``kv / (line * (1 - rho))``
(:func:`transfer_excess_s`), of which only what exceeds its prefill shows in TTFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

from scheduling.core.knapsack import (
    class_block,
    class_loads,
    joint_law,
    occupancy_law,
    rooms,
    size_spread,
)

FloatArray = NDArray[np.float64]

#: A link whose budget is not given may hold this many seconds of its line rate in flight.
DEFAULT_LINK_BUDGET_SECONDS = 2.0
#: A link whose target utilisation is not given is planned to at most this egress share (the
#: router's default ``RouteGuards.scarce_utilisation``).
DEFAULT_TARGET_UTILISATION = 0.8
#: At or below this egress share a link's bandwidth is abundant again, and the router moves
#: cached prefixes over it (the router's ``RouteGuards.abundant_utilisation`` default).
DEFAULT_ABUNDANT_UTILISATION = 0.6
#: By default nothing caps the share of decisions a link refuses (``link_congested``): a
#: refused offload prefills locally, and the planner plans that (issue 28). An operator may cap
#: it per link (``max_refused_share``, within :data:`REFUSED_SHARE_BOUNDS`); then the planner
#: keeps the predicted share under the cap ...
DEFAULT_REFUSAL_TARGET: float | None = None
#: ... and never lets the link refuse more than this share of the offloads it is offered.
MAX_OFFLOAD_REFUSAL = 0.5
#: Bounds of a link's ``max_refused_share`` (a share of decisions, above 0).
REFUSED_SHARE_BOUNDS = (0.0, 1.0)
#: Resolution of the knapsack: the budget (and the line rate) cut into this many units.
BUDGET_UNITS = 64

GBPS = 1e9  # bit/s


def link_budget_bytes(gbps: float, budget_bytes: int | None = None) -> int:
    """The in-flight budget of a link: its own, else DEFAULT_LINK_BUDGET_SECONDS of its line
    rate (0 for a link that is down)."""
    if budget_bytes is not None:
        return int(budget_bytes)
    return int(max(0.0, gbps) * GBPS / 8 * DEFAULT_LINK_BUDGET_SECONDS)


def link_target_utilisation(target: float | None = None) -> float:
    """The egress share a link is planned to: its own, else the router's scarce guard."""
    if target is None:
        return DEFAULT_TARGET_UTILISATION
    if not (0.0 < target <= 1.0) or math.isnan(target):
        raise ValueError(f"target utilisation must be within (0, 1], got {target!r}")
    return float(target)


#: How a link is named wherever it is named (live state, plans, scenarios, logs, bindings).
LINK_ARROW = "->"


def link_key(source: str, target: str) -> str:
    """A link's one name: ``source->target`` (cluster names)."""
    return f"{source}{LINK_ARROW}{target}"


def link_parse(name: str) -> tuple[str, str] | None:
    """``source->target`` as (source, target); None for any other spelling."""
    source, arrow, target = name.strip().partition(LINK_ARROW)
    if not arrow or not source.strip() or not target.strip() or LINK_ARROW in target:
        return None
    if ">" in source or ">" in target:
        return None
    return source.strip(), target.strip()


@dataclass(frozen=True, slots=True)
class Link:
    """The Ethernet path from a PrfaaS cluster (``source``) to a PD cluster (``target``), one
    type for the router, the planner, the simulator and scenarios (0 Gbps = down).

    ``kv_budget_bytes``: the most KV bytes in flight on it at once (reserved when a decision is
    taken, released when the transfer ends); ``target_utilisation``: the mean egress share the
    planner may plan onto it, and the router's scarce threshold for it. ``None``: the
    defaults above (:attr:`budget`, :attr:`planned_utilisation` apply them).
    ``max_refused_share``: the operator's cap on the share of the PD cluster's decisions the
    link's guard may refuse, within (0, 1] (:func:`link_refused_cap`); ``None`` (default): no
    cap, refused offloads prefill locally and the planner plans them so.
    """

    source: str
    target: str
    gbps: float
    rtt_ms: float = 0.0
    kv_budget_bytes: int | None = None
    target_utilisation: float | None = None
    max_refused_share: float | None = None

    @property
    def key(self) -> str:
        return link_key(self.source, self.target)

    @property
    def pair(self) -> tuple[str, str]:
        return (self.source, self.target)

    @property
    def budget(self) -> int:
        """The in-flight budget in bytes, defaults applied."""
        return link_budget_bytes(self.gbps, self.kv_budget_bytes)

    @property
    def planned_utilisation(self) -> float:
        """The planned egress share, default applied."""
        return link_target_utilisation(self.target_utilisation)

    @property
    def usable_gbps(self) -> float:
        """What the planner may plan onto the link on average."""
        return max(0.0, self.gbps) * self.planned_utilisation


def link_refused_cap(value: float | None) -> float | None:
    """A link's operator cap on its refused share, checked (``None``: no cap)."""
    if value is None:
        return None
    lo, hi = REFUSED_SHARE_BOUNDS
    if not (lo < value <= hi) or math.isnan(value):
        raise ValueError(f"max_refused_share must be within ({lo:g}, {hi:g}], got {value!r}")
    return float(value)


def link_admits(utilisation: float, inflight_bytes: float, nbytes: float, budget: float) -> bool:
    """The router's admission rule for one reservation of ``nbytes`` on a link now carrying
    ``inflight_bytes`` reserved bytes at egress ``utilisation`` (0..1): within the budget, or,
    bigger than the budget, alone on an idle link (a link whose budget is 0 takes nothing)."""
    if not utilisation < 1.0:
        return False
    return inflight_bytes + nbytes <= budget or (inflight_bytes <= 0 and budget > 0)


def link_never_fits(kv_bytes: ArrayLike, budget: float) -> NDArray[np.bool_]:
    """Reservations the router refuses every time (:func:`link_admits` on an idle link): only
    on a link without a budget. One bigger than a positive budget waits for an idle link."""
    kv = np.asarray(kv_bytes, dtype=float)
    return np.asarray((kv > budget) & (budget <= 0))


def transfer_excess_s(
    kv_bytes: ArrayLike,
    prefill_s: ArrayLike,
    gbps: float,
    utilisation: float,
    budget: float | None = None,
) -> FloatArray:
    """Seconds a transfer outlasts its prefill (layer-wise pipelining hides the rest) on a link
    shared fairly at ``utilisation``; infinite on a link that is down or saturated. With the
    link's ``budget``: a reservation bigger than it is admitted only alone
    (:func:`link_admits`), so it streams at the full line (dense-kv-40gbps at its goodput
    rate: 80.5% of offers refused predicted at the shared rate, 74.1% alone, 73.2% simulated)."""
    x = np.asarray(kv_bytes, dtype=float)
    t = np.asarray(prefill_s, dtype=float)
    line = gbps * GBPS / 8
    if line <= 0:
        return np.where(x > 0, math.inf, 0.0)
    shared = line * max(0.0, 1.0 - utilisation)
    alone = (x > budget) if budget is not None and budget > 0 else np.zeros(x.shape, bool)
    with np.errstate(divide="ignore", over="ignore"):
        rate = np.where(alone, line, shared)
        out = np.where(
            rate > 0, x / np.where(rate > 0, rate, 1.0) - t, np.where(x > 0, math.inf, 0)
        )
    return np.asarray(np.maximum(0.0, out))


@dataclass(frozen=True)
class OffloadMix:
    """The offloads offered to one link, as kinds of request (rows share the kinds, one row per
    situation, e.g. per threshold): ``weights[k, i]`` the share of kind ``i`` in row ``k``
    (each row sums to 1, or to 0 when nothing is offered), ``kv_bytes[i]`` what it reserves,
    ``prefill_s[i]`` how long its KV streams, ``hold_s[i]`` how long its reservation lives after
    its prefill starts (prefill, the transfer's excess, one RTT).

    ``move_bytes[i]``, ``move_s[i]`` (None: no kind moves anything): a prefix the origin holds,
    moved into PrfaaS over the link before the prefill (the router does so when bandwidth is
    abundant): it is reserved with the KV, streams at the line rate and is released when it
    lands ``move_s`` later; the KV's reservation lives through the move too."""

    weights: FloatArray
    kv_bytes: FloatArray
    prefill_s: FloatArray
    hold_s: FloatArray
    move_bytes: FloatArray | None = None
    move_s: FloatArray | None = None


@dataclass(frozen=True)
class PoolCrowd:
    """The PrfaaS pool a link's offloads queue at, per row: its arrival rate from every link
    (req/s) and how many requests it holds (queued or prefilling), prefills and queues, as
    means and variances (:func:`scheduling.core.queueing.mgc_crowd`). A link's share of the
    pool's queue is what makes its reservations bunch up: when the queue grows, every request
    in it holds its bytes longer."""

    rate: FloatArray
    in_system_mean: FloatArray
    in_system_var: FloatArray
    busy_mean: FloatArray
    busy_var: FloatArray
    queue_mean: FloatArray
    queue_var: FloatArray

    def take(self, rows: NDArray[np.int_], repeat: int = 1) -> PoolCrowd:
        def pick(a: FloatArray) -> FloatArray:
            return np.repeat(np.asarray(a, dtype=float)[rows], repeat)

        return PoolCrowd(
            pick(self.rate),
            pick(self.in_system_mean),
            pick(self.in_system_var),
            pick(self.busy_mean),
            pick(self.busy_var),
            pick(self.queue_mean),
            pick(self.queue_var),
        )


def _dispersions(
    rate: FloatArray, pool: PoolCrowd | None, after_s: FloatArray, streaming_after_s: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Variance-to-mean ratios of a link's reservations and of its streams at offered
    ``rate`` per row (1 each without a pool: Poisson counts). ``after_s``: mean seconds a
    reservation lives after its prefill; ``streaming_after_s``: mean seconds it still streams.
    (:func:`scheduling.core.queueing.thinned_dispersion`, elementwise.)"""
    if pool is None:
        ones = np.ones(len(rate))
        return ones, ones
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(
            np.where(pool.rate > 0, rate / np.where(pool.rate > 0, pool.rate, 1.0), 1.0), 0, 1
        )

    def ratio(
        mean: FloatArray, var: FloatArray, independent: FloatArray, extra: FloatArray
    ) -> FloatArray:
        """The link's share of a crowd (``mean``, ``var``; each member the link's with
        probability ``share``), plus ``independent`` x share and ``extra``, Poisson."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            m = share * (mean + independent) + extra
            v = share * share * var + share * (1.0 - share) * mean + share * independent + extra
            out = np.where((m > 0) & np.isfinite(m), v / np.where(m > 0, m, 1.0), 1.0)
        return np.maximum(np.nan_to_num(out, nan=1.0, posinf=1.0), 1.0)

    # Reservations: only the queue bunches (when it grows, all in it hold their bytes
    # longer); prefills in progress end independently of each other, counted as Poisson.
    # Counting the pool's whole crowd as one bunch over-disperses a link that shares a
    # lightly queued pool (two-pd-clusters: 26% refused predicted, 30% simulated).
    held = ratio(pool.queue_mean, pool.queue_var, pool.busy_mean, rate * after_s)
    streams = ratio(pool.busy_mean, pool.busy_var, np.zeros_like(rate), rate * streaming_after_s)
    return held, streams


@dataclass(frozen=True)
class _Prepared:
    """A mix cut into the link's classes, per unit of offered rate. Each kind is three
    classes that hold its reservation's budget units: not streaming (queued, after its
    stream), streaming its KV, streaming a moved prefix (at the line rate)."""

    budget_weights: FloatArray  # rows x budget units: the mix's share in each
    budget_loads: FloatArray  # rows x budget units: erlangs per (req/s) offered
    stream_loads: FloatArray  # rows x rate units: concurrent streams per (req/s)
    budget_spread: FloatArray  # classes x budget units
    rate_spread: FloatArray  # classes x rate units
    loads: FloatArray  # rows x classes: mean number present per (req/s) offered
    spread: FloatArray  # kinds x budget units
    fits: NDArray[np.bool_]
    after_s: FloatArray  # rows: mean seconds a reservation lives after its prefill
    streaming_after_s: FloatArray  # rows: mean seconds a transfer streams after its prefill


def _prepare(
    mix: OffloadMix, wait_s: FloatArray, gbps: float, budget_bytes: float, units: int
) -> _Prepared:
    weights = np.atleast_2d(np.asarray(mix.weights, dtype=float))
    kv = np.asarray(mix.kv_bytes, dtype=float)
    zeros = np.zeros_like(kv)
    moved = zeros if mix.move_bytes is None else np.asarray(mix.move_bytes, dtype=float)
    move_s = zeros if mix.move_s is None else np.maximum(np.asarray(mix.move_s, dtype=float), 0)
    size = kv + moved
    line = gbps * GBPS / 8
    fits = ~link_never_fits(size, budget_bytes)
    w = np.where(fits[None, :], weights, 0.0)
    # A reservation bigger than the budget takes all of it (_spread clips it to the top
    # class): the knapsack then admits it only when nothing else is reserved, as the router.
    spread = size_spread(size / budget_bytes * units, units + 1)
    hold = np.asarray(mix.hold_s, dtype=float)
    # A kind that moves a prefix first holds kv + moved bytes for the move, then kv alone: as
    # one class of its admitted size, for the time that keeps its mean bytes held (Little).
    with np.errstate(divide="ignore", invalid="ignore"):
        kv_share = np.where(size > 0, kv / np.where(size > 0, size, 1.0), 1.0)
    life = wait_s[:, None] * kv_share[None, :] + (move_s + kv_share * hold)[None, :]
    # While prefilling, a transfer streams at most kv / prefill (and the line rate), for
    # max(prefill, kv / line) seconds; a moved prefix streams at the line rate.
    prefill = np.maximum(np.asarray(mix.prefill_s, dtype=float), 1e-9)
    stream = np.minimum(np.maximum(prefill, kv / line), life.max(axis=0))
    idle = np.maximum(life - stream[None, :] - move_s[None, :], 0.0)
    kinds = len(kv)
    no_rate = np.zeros((kinds, units + 1))
    no_rate[:, 0] = 1.0
    at_line = np.zeros((kinds, units + 1))
    at_line[:, units] = 1.0
    kv_rate = size_spread(kv / stream / line * units, units + 1)
    budget_spread = np.concatenate([spread, spread, spread])
    rate_spread = np.concatenate([no_rate, kv_rate, at_line])
    loads = np.concatenate([w * idle, w * stream[None, :], w * move_s[None, :]], axis=1)
    # The two marginals, for a grid's screening (link_refusal): the budget's knapsack, and
    # the streams as an M/G/inf population. A reservation bigger than the budget streams only
    # while it holds the budget alone: the budget refuses everything else then, so its
    # stream adds no refusal of its own.
    budget_loads = class_loads(spread, w * life)
    alone = (size > budget_bytes)[None, :]
    stream_loads = class_loads(kv_rate, np.where(alone, 0.0, w) * stream[None, :])
    stream_loads[:, units] += np.where(alone, 0.0, w) @ move_s
    share = np.where(w.sum(axis=1) > 0, w.sum(axis=1), 1.0)
    after = (w @ np.maximum(hold - prefill, 0.0)) / share
    streaming = (w @ np.maximum(stream - prefill, 0.0)) / share
    return _Prepared(
        w @ spread,
        budget_loads,
        stream_loads,
        budget_spread,
        rate_spread,
        loads,
        spread,
        fits,
        after,
        streaming,
    )


@dataclass(frozen=True)
class GuardOutlook:
    """What an offload finds on a link, per row: ``budget_block[k, i]`` the probability that
    a kind-``i`` reservation finds no room in the budget, ``saturated[k]`` that the link's
    egress is at its line rate, ``abundant[k]`` that it is at most ``abundant_at`` of it (the
    router then moves prefixes); ``refused[k, i]`` that the guard refuses a kind-``i`` offload
    (no room, or the line saturated: one joint law, so neither double-counted nor missed);
    ``refused_busy[k, i]`` the same for an offload that finds the egress above
    ``abundant_at``, ``refused_calm[k, i]`` for one that finds it at most that (the budget
    alone can refuse it then)."""

    budget_block: FloatArray
    saturated: FloatArray
    abundant: FloatArray
    fits: NDArray[np.bool_]
    refused: FloatArray
    refused_busy: FloatArray
    refused_calm: FloatArray

    def refusal(self) -> FloatArray:
        """Probability that the router refuses each kind (:func:`link_refusal`)."""
        return np.where(self.fits[None, :], self.refused, 1.0)


#: Rounds of the fixed point that thins a link's offered rate by what a saturated line refuses.
SATURATION_ROUNDS = 3


def _guard_law(lam: FloatArray, prep: _Prepared) -> FloatArray:
    """The joint law of a link's reservations and streams at offered rates ``lam`` (rows).

    The knapsack's truncation refuses what finds no room in the budget; what a saturated line
    refuses (room in the budget, none on the line) never joins either, so the offered rate is
    thinned by that share, found by a short fixed point (without it, a link that saturates
    often counts streams that were refused).

    Counts are Poisson here, though a PrfaaS queue makes the reservations of the offloads in
    it bunch (the screening's marginals count that, :func:`_dispersions`): on the joint law
    the bunching refused more than the simulator does (two-pd-clusters' pd-south: 28.2% of
    its offers predicted with it, 29.3% without, 29.7% simulated over four seeds)."""
    thin = np.ones(len(lam))
    share = np.maximum(prep.budget_weights.sum(axis=1), 1e-300)
    for _ in range(SATURATION_ROUNDS):
        law = joint_law(prep.budget_spread, prep.rate_spread, (lam * thin)[:, None] * prep.loads)
        fits = 1.0 - class_block(law.sum(axis=2))  # P(room) per size
        line_ok = rooms(law, slice(0, -1))  # P(room and the line below its rate) per size
        passed = (prep.budget_weights * line_ok).sum(axis=1) / share
        roomy = np.maximum((prep.budget_weights * fits).sum(axis=1) / share, 1e-300)
        thin = np.clip(passed / roomy, 0.0, 1.0)
    return law


def link_outlook(
    rate: ArrayLike,
    mix: OffloadMix,
    wait_s: ArrayLike,
    gbps: float,
    budget_bytes: float,
    *,
    units: int = BUDGET_UNITS,
    abundant_at: float = DEFAULT_ABUNDANT_UTILISATION,
) -> GuardOutlook:
    """The link's guard as the operating point predicts it, in parts (:class:`GuardOutlook`):
    ``rate[k]`` offloads per second arrive with the mix of row ``k``, each waiting
    ``wait_s[k]`` on average for its PrfaaS prefill, judged on the joint law of the budget
    taken and the line's rate (:func:`link_refusal` screens a grid on their marginals)."""
    weights = np.atleast_2d(np.asarray(mix.weights, dtype=float))
    rows = weights.shape[0]
    if gbps <= 0 or budget_bytes <= 0:
        ones = np.ones(rows)
        every = np.ones_like(weights)
        return GuardOutlook(
            every, ones, np.zeros(rows), np.zeros(weights.shape[1], bool), every, every, every
        )
    lam = np.broadcast_to(np.asarray(rate, dtype=float), (rows,))
    wait = np.broadcast_to(np.asarray(wait_s, dtype=float), (rows,)).astype(float)
    prep = _prepare(mix, wait, gbps, budget_bytes, units)
    law = _guard_law(lam, prep)
    calm_top = math.floor(abundant_at * units + 1e-9)
    by_rate = law.sum(axis=1)
    saturated = by_rate[:, units]
    abundant = by_rate[:, : calm_top + 1].sum(axis=1)
    budget_block = class_block(law.sum(axis=2)) @ prep.spread.T  # rows x kinds
    refused = 1.0 - rooms(law, slice(0, units)) @ prep.spread.T

    def given(p_state: FloatArray, room: FloatArray) -> FloatArray:
        """P(refused | the rate in a set of states of probability ``p_state``), from
        P(room and the rate in it); the unconditional refusal where the set is empty."""
        p = np.maximum(p_state, 1e-300)[:, None]
        return np.where(p_state[:, None] > 1e-12, np.clip((p - room) / p, 0.0, 1.0), refused)

    refused_busy = given(1.0 - abundant, rooms(law, slice(calm_top + 1, units)) @ prep.spread.T)
    refused_calm = given(abundant, rooms(law, slice(0, calm_top + 1)) @ prep.spread.T)
    return GuardOutlook(
        budget_block, saturated, abundant, prep.fits, refused, refused_busy, refused_calm
    )


def link_refusal(
    rate: ArrayLike,
    mix: OffloadMix,
    wait_s: ArrayLike,
    gbps: float,
    budget_bytes: float,
    *,
    pool: PoolCrowd | None = None,
    units: int = BUDGET_UNITS,
    admitted: ArrayLike = 1.0,
) -> FloatArray:
    """Probability that the router refuses an offload of each kind, per row, as a grid of
    settings screens it: ``rate[k]`` offloads per second arrive with the mix of row ``k``,
    each waiting ``wait_s[k]`` on average for its PrfaaS prefill before it starts, at the
    pool ``pool`` describes (None: reservations come and go independently, Poisson). Shape
    ``(rows, kinds)``. Kinds whose KV alone exceeds the budget take all of it: refused unless
    the link holds nothing else.

    The budget and saturation are judged on their own laws and the larger is taken (cheap
    over many rows); :func:`link_outlook` judges them on their joint law, for the operating
    point's prediction."""
    weights = np.atleast_2d(np.asarray(mix.weights, dtype=float))
    rows = weights.shape[0]
    if gbps <= 0 or budget_bytes <= 0:
        return np.ones_like(weights)
    lam = np.broadcast_to(np.asarray(rate, dtype=float), (rows,))
    wait = np.broadcast_to(np.asarray(wait_s, dtype=float), (rows,)).astype(float)
    prep = _prepare(mix, wait, gbps, budget_bytes, units)
    kept = np.broadcast_to(np.asarray(admitted, dtype=float), (rows,))
    block, saturated = _marginals(lam, prep, pool, kept)
    refused = np.maximum(block @ prep.spread.T, saturated[:, None])
    return np.where(prep.fits[None, :], refused, 1.0)


def _marginals(
    lam: FloatArray, prep: _Prepared, pool: PoolCrowd | None, kept: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Per row: the probability that a reservation of each size in budget units finds no
    room (rows x units), and that the line is saturated (the admitted offloads' streams,
    untruncated: an upper bound)."""
    held, streams = _dispersions(lam * kept, pool, prep.after_s, prep.streaming_after_s)
    law, _ = occupancy_law(lam[:, None] * prep.budget_loads, held)
    _, saturated = occupancy_law((lam * kept)[:, None] * prep.stream_loads, streams)
    return class_block(law), saturated


def link_mean_refusal(
    rate: ArrayLike,
    mix: OffloadMix,
    wait_s: ArrayLike,
    gbps: float,
    budget_bytes: float,
    *,
    pool: PoolCrowd | None = None,
) -> FloatArray:
    """The share of the offered offloads refused, per row (kinds that never fit included)."""
    weights = np.atleast_2d(np.asarray(mix.weights, dtype=float))
    refused = link_refusal(rate, mix, wait_s, gbps, budget_bytes, pool=pool)
    return np.asarray((weights * refused).sum(axis=1))


def link_admissible_rate(
    mix: OffloadMix,
    wait_s: ArrayLike,
    gbps: float,
    budget_bytes: float,
    refusal_target: ArrayLike,
    *,
    pool: PoolCrowd | None = None,
    points: int = 18,
    units: int = BUDGET_UNITS,
) -> FloatArray:
    """Per row, the largest offload rate (req/s) at which the share of offloads the link
    refuses stays within ``refusal_target`` (the mix must hold only kinds the link may carry,
    :func:`link_never_fits`: the others are a fixed share the caller accounts for). 0 when even
    a trickle is refused too often; infinite for an empty row."""
    weights = np.atleast_2d(np.asarray(mix.weights, dtype=float))
    rows = weights.shape[0]
    target = np.broadcast_to(np.asarray(refusal_target, dtype=float), (rows,))
    wait = np.broadcast_to(np.asarray(wait_s, dtype=float), (rows,)).astype(float)
    kv = np.asarray(mix.kv_bytes, dtype=float)
    mean_kv = weights @ kv
    out = np.full(rows, math.inf)
    live = (weights.sum(axis=1) > 0) & (mean_kv > 0)
    if gbps <= 0 or budget_bytes <= 0:
        return np.where(live, 0.0, math.inf)
    if not np.any(live):
        return out
    idx = np.flatnonzero(live)
    sub = OffloadMix(weights[idx], kv, mix.prefill_s, mix.hold_s)
    prep = _prepare(sub, wait[idx], gbps, budget_bytes, units)
    # Rates on a geometric grid up to the line rate's worth of these requests, all at once.
    top = gbps * GBPS / 8 / mean_kv[idx]
    grid = top[:, None] * np.geomspace(1e-5, 1.0, points)[None, :]  # live rows x points
    flat = grid.reshape(-1)
    repeated = replace(
        prep,
        budget_loads=np.repeat(prep.budget_loads, points, axis=0),
        stream_loads=np.repeat(prep.stream_loads, points, axis=0),
        after_s=np.repeat(prep.after_s, points),
        streaming_after_s=np.repeat(prep.streaming_after_s, points),
    )
    block, saturated = _marginals(
        flat, repeated, None if pool is None else pool.take(idx, points), np.ones(len(flat))
    )
    weights_of = np.repeat(prep.budget_weights, points, axis=0)
    share = np.repeat(prep.budget_weights.sum(axis=1), points)
    mean_block = (block * weights_of).sum(axis=1) / np.where(share > 0, share, 1.0)
    refused = np.maximum(mean_block, saturated).reshape(len(idx), points)
    for row, k in enumerate(idx):
        r = refused[row]
        ok = r <= target[k]
        if not ok[0]:
            out[k] = 0.0
            continue
        if ok.all():
            out[k] = grid[row, -1]
            continue
        j = int(np.argmin(ok)) - 1  # last rate within the target before the first beyond it
        # Interpolate log(refusal) against log(rate) between the bracketing grid points.
        lo_r, hi_r = max(r[j], 1e-300), max(r[j + 1], 1e-300)
        lo_x, hi_x = math.log(grid[row, j]), math.log(grid[row, j + 1])
        want = math.log(max(target[k], 1e-300))
        frac = (want - math.log(lo_r)) / (math.log(hi_r) - math.log(lo_r)) if hi_r > lo_r else 0
        out[k] = math.exp(lo_x + min(1.0, max(0.0, frac)) * (hi_x - lo_x))
    return out
