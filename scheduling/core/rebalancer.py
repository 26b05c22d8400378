"""The long-timescale rebalancer's decision: hold, or propose a new threshold and P/D split.

Pure: no Django, plain frozen dataclasses in and out. The Celery tick (``scheduling.rebalance``)
and the simulator's ``prfaas-dual`` policy call :func:`rebalance_decide` with the same inputs
and get the same answer, so a plan can be judged on a simulated clock before it touches a fleet.

PrfaaS section 3.4.3 (long term): from observed traffic, re-solve the throughput model for the
best threshold t and prefill/decode split of a PD cluster, then convert instances between roles.
The paper gives no period, hysteresis or step size; the guards below are ours.

RebalanceGuards and their defaults (:class:`RebalanceGuards`):

* ``dead_band`` 0.05: no plan unless the predicted capacity gain is at least 5%.
* ``max_change_fraction`` 0.10 / ``min_changes`` 1: at most max(1, 10% of the cluster) role
  changes per plan; a larger move is made one bounded step at a time, the threshold being
  re-optimised for the intermediate split.
* ``cooldown_s`` 300: no plan within this long after the last apply finished.
* ``min_window_requests`` 100, ``min_window_coverage`` 0.5: hold ``window_too_small`` or
  ``missing_metrics`` on thin windows; ``max_staleness_s`` 120: hold ``stale_metrics`` when the
  traffic recorder or an instance's telemetry is older; NaN or negative numbers hold
  ``invalid_metrics``; warming instances hold ``instances_warming_up``.
* Zero arrivals in a window whose recorder is alive and fresh is real: hold ``no_traffic``.
* Anti-flapping beyond the dead band: a change must be seen on ``persist_ticks`` (2)
  consecutive ticks in the same direction before it is proposed (unless the gain reaches
  ``urgent_gain``, 0.25); and a change that reverses the direction of the last change of the
  split, or of the threshold, within ``reversal_window_s`` (3600) is held ``reversal_limited``;
  after that a reversal still needs ``reversal_gain`` (0.10, twice the dead band).
* Role floors and ceilings: ``min_prefill``/``min_decode`` 1, ``max_prefill``/``max_decode``
  unbounded.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from scheduling.core.kinds import InstanceRole
from scheduling.core.operating import operating_point
from scheduling.core.performance import DiscreteLengths
from scheduling.core.planner import Evaluation, FleetSpec, plan_fleet
from scheduling.core.planner import evaluate as planner_evaluate
from scheduling.core.rebalance_types import (
    HOLD_ALREADY_OPTIMAL,
    HOLD_AWAITING_PERSISTENCE,
    HOLD_COOLDOWN,
    HOLD_DEAD_BAND,
    HOLD_INFEASIBLE,
    HOLD_INVALID_METRICS,
    HOLD_MISSING_METRICS,
    HOLD_NO_ELIGIBLE_INSTANCE,
    HOLD_NO_TRAFFIC,
    HOLD_REASONS,
    HOLD_REVERSAL_LIMITED,
    HOLD_SIMULATION_INCOMPLETE,
    HOLD_SIMULATION_REJECTED,
    HOLD_STALE_METRICS,
    HOLD_WARMING_UP,
    HOLD_WINDOW_TOO_SMALL,
    PENDING_REASONS,
    Change,
    History,
    InstanceStateName,
    InstanceView,
    Pending,
    PlannerPort,
    Prediction,
    RebalanceDecision,
    RebalanceGuards,
    RebalanceInput,
    RoleChange,
    Setting,
    TrafficSummary,
)

# The types are re-exported: callers import the rebalancer's vocabulary from here.
__all__ = [
    "HOLD_ALREADY_OPTIMAL",
    "HOLD_AWAITING_PERSISTENCE",
    "HOLD_COOLDOWN",
    "HOLD_DEAD_BAND",
    "HOLD_INFEASIBLE",
    "HOLD_INVALID_METRICS",
    "HOLD_MISSING_METRICS",
    "HOLD_NO_ELIGIBLE_INSTANCE",
    "HOLD_NO_TRAFFIC",
    "HOLD_REASONS",
    "HOLD_REVERSAL_LIMITED",
    "HOLD_SIMULATION_INCOMPLETE",
    "HOLD_SIMULATION_REJECTED",
    "HOLD_STALE_METRICS",
    "HOLD_WARMING_UP",
    "HOLD_WINDOW_TOO_SMALL",
    "PENDING_REASONS",
    "Change",
    "FleetPlanner",
    "History",
    "InstanceStateName",
    "InstanceView",
    "Pending",
    "PlannerPort",
    "Prediction",
    "RebalanceDecision",
    "RebalanceGuards",
    "RebalanceInput",
    "RoleChange",
    "Setting",
    "TrafficSummary",
    "choose_role_changes",
    "current_setting",
    "fleet_for_cluster",
    "fleet_problem",
    "histogram_points",
    "history_after",
    "history_record_change",
    "rebalance_decide",
    "reversals_per_hour",
    "split_bounds",
    "threshold_move",
    "window_from_lengths",
    "window_problem",
]


def _hold(reason: str, detail: str = "", **kw: object) -> RebalanceDecision:
    return RebalanceDecision(action="hold", reason=reason, detail=detail, **kw)  # type: ignore[arg-type]


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) and v >= 0 for v in values)


def window_problem(
    window: TrafficSummary | None, now: float, guards: RebalanceGuards
) -> RebalanceDecision | None:
    """A hold when the traffic window cannot be trusted, else None. Zero traffic is trusted."""
    if window is None:
        return _hold(HOLD_MISSING_METRICS, "no traffic window recorded for this cluster")
    numbers = (
        window.start_s,
        window.end_s,
        float(window.arrivals),
        float(window.offloads),
        window.cache_hit_tokens,
        window.prompt_tokens,
        float(window.samples),
        window.bucket_s,
    )
    points_ok = all(_finite(t, w) for t, w in window.incremental_tokens)
    if (
        not _finite(*numbers)
        or not points_ok
        or (window.output_tokens_mean is not None and not _finite(window.output_tokens_mean))
    ):
        return _hold(
            HOLD_INVALID_METRICS, "the traffic window holds NaN, infinite or negative values"
        )
    if window.end_s <= window.start_s or window.offloads > window.arrivals:
        return _hold(HOLD_INVALID_METRICS, "the traffic window is inconsistent")
    if window.recorder_seen_at is None or window.samples == 0:
        return _hold(HOLD_MISSING_METRICS, "the traffic recorder has written nothing in the window")
    age = now - window.recorder_seen_at
    if not math.isfinite(age) or age > guards.max_staleness_s:
        return _hold(HOLD_STALE_METRICS, f"the traffic recorder was last seen {age:.0f} s ago")
    if window.coverage < guards.min_window_coverage:
        return _hold(
            HOLD_MISSING_METRICS,
            f"the recorder covered {window.coverage:.0%} of the window "
            f"(needs {guards.min_window_coverage:.0%})",
        )
    if window.arrivals == 0:
        return _hold(HOLD_NO_TRAFFIC, "no requests arrived in a fresh, complete window")
    if window.arrivals < guards.min_window_requests:
        return _hold(
            HOLD_WINDOW_TOO_SMALL,
            f"{window.arrivals} requests in the window (needs {guards.min_window_requests})",
        )
    if not window.incremental_tokens or sum(w for _, w in window.incremental_tokens) <= 0:
        return _hold(HOLD_MISSING_METRICS, "requests arrived but no length histogram was recorded")
    if window.output_tokens_mean is None or window.output_tokens_mean <= 0:
        return _hold(HOLD_MISSING_METRICS, "no output lengths were recorded")
    return None


def fleet_problem(
    instances: Sequence[InstanceView], now: float, guards: RebalanceGuards
) -> RebalanceDecision | None:
    """A hold when the fleet is mid-change or its telemetry cannot be trusted, else None."""
    live = [i for i in instances if i.state == "active"]
    if not live:
        return _hold(HOLD_MISSING_METRICS, "the cluster has no active instance")
    warming = sorted(i.name for i in live if i.warming_up)
    if warming:
        return _hold(HOLD_WARMING_UP, f"warming up: {', '.join(warming)}")
    for inst in live:
        if inst.seen_at is None or inst.load is None:
            return _hold(HOLD_MISSING_METRICS, f"no telemetry from {inst.name}")
        if not _finite(inst.load, inst.seen_at):
            return _hold(HOLD_INVALID_METRICS, f"telemetry of {inst.name} holds NaN or negatives")
        if now - inst.seen_at > guards.max_staleness_s:
            return _hold(
                HOLD_STALE_METRICS,
                f"telemetry of {inst.name} is {now - inst.seen_at:.0f} s old",
            )
    return None


def current_setting(instances: Sequence[InstanceView], threshold: float) -> Setting:
    """The split the cluster runs now: active instances by role (draining or down don't count)."""
    n_p = sum(1 for i in instances if i.state == "active" and i.role == "prefill")
    n_d = sum(1 for i in instances if i.state == "active" and i.role == "decode")
    return Setting(threshold=threshold, n_p=n_p, n_d=n_d)


def split_bounds(n_total: int, guards: RebalanceGuards) -> tuple[int, int]:
    """Allowed n_p range under the role floors and ceilings (may be empty: lo > hi)."""
    lo = max(
        guards.min_prefill,
        n_total - (guards.max_decode if guards.max_decode is not None else n_total),
    )
    hi = min(
        guards.max_prefill if guards.max_prefill is not None else n_total,
        n_total - guards.min_decode,
    )
    return lo, hi


def choose_role_changes(
    instances: Sequence[InstanceView], from_role: InstanceRole, to_role: InstanceRole, count: int
) -> tuple[RoleChange, ...]:
    """Pick ``count`` active instances of ``from_role`` to flip, idle and least loaded first.

    Draining, down and warming instances are never chosen. Ties break on the name so that the
    same inputs always give the same diff. Where the role's controller removes the highest
    ordinal first (instances with an ``ordinal``), only the ``count`` highest that are not down
    can go, and none of them when one of those is draining or warming (the caller holds).
    """

    def eligible(i: InstanceView) -> bool:
        return i.state == "active" and not i.warming_up

    # A down instance's pod is gone (or going): the controller has nothing of it to remove.
    of_role = [i for i in instances if i.role == from_role and i.state != "down"]
    if any(i.ordinal is not None for i in of_role):
        last = sorted(of_role, key=lambda i: (-1 if i.ordinal is None else i.ordinal, i.name))
        chosen = last[::-1][:count]
        if not all(eligible(i) for i in chosen):
            return ()
        return tuple(RoleChange(i.name, from_role, to_role) for i in chosen)
    candidates = [i for i in of_role if eligible(i)]
    candidates.sort(key=lambda i: (i.load if i.load is not None else math.inf, i.name))
    return tuple(RoleChange(i.name, from_role, to_role) for i in candidates[:count])


def threshold_move(split_dir: int, thr_dir: int) -> int:
    """The threshold's own direction for anti-flapping: when the split changes, the threshold
    is re-solved for the new split, so its direction follows the split and is not a move of
    its own (counting it would call every split change after a threshold change a reversal)."""
    return thr_dir if split_dir == 0 else 0


def reversals_per_hour(ticks: Iterable[tuple[float, RebalanceDecision]]) -> dict[int, int]:
    """Flapping, measured: plans that reverse the last change of the split or of the
    threshold (its own moves only, see :func:`threshold_move`), counted per clock hour."""
    out: dict[int, int] = {}
    last = {"split": 0, "threshold": 0}
    for now, d in ticks:
        if d.action != "propose":
            continue
        moves = (
            ("split", d.split_direction),
            ("threshold", threshold_move(d.split_direction, d.threshold_direction)),
        )
        if any(direction and last[name] == -direction for name, direction in moves):
            hour = int((now - 1) // 3600)
            out[hour] = out.get(hour, 0) + 1
        for name, direction in moves:
            if direction:
                last[name] = direction
    return out


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _threshold_direction(old: float, new: float, tolerance: float) -> int:
    base = max(abs(old), 1.0)
    if abs(new - old) <= tolerance * base:
        return 0
    return _sign(new - old)


def rebalance_decide(inp: RebalanceInput, planner: PlannerPort) -> RebalanceDecision:
    """Decide one tick for one PD cluster: a hold with its reason, or a proposal.

    The proposal carries the new threshold and split, the instances to flip, the predictions
    of the current and proposed settings and of the unconstrained optimum (``target``), and the
    predicted capacity gain.
    """
    guards = inp.guards
    problem = window_problem(inp.window, inp.now, guards) or fleet_problem(
        inp.instances, inp.now, guards
    )
    if problem is not None:
        return problem
    window = inp.window
    assert window is not None

    current = current_setting(inp.instances, inp.threshold)
    n_total = current.n_p + current.n_d
    lo, hi = split_bounds(n_total, guards)
    if lo > hi:
        return _hold(HOLD_INFEASIBLE, f"no split of {n_total} instances meets the role bounds")

    current_pred = planner.evaluate(window, current)
    target = planner.best(window, n_total, (lo, hi))

    # Bounded step toward the optimum; the threshold is re-solved for the intermediate split.
    step = guards.max_changes(n_total)
    n_p = current.n_p + max(-step, min(step, target.setting.n_p - current.n_p))
    n_p = max(lo, min(hi, n_p))
    proposed = target if n_p == target.setting.n_p else planner.best(window, n_total, (n_p, n_p))

    split_dir = _sign(proposed.setting.n_p - current.n_p)
    thr_dir = _threshold_direction(
        current.threshold, proposed.setting.threshold, guards.threshold_tolerance
    )
    gain = _gain(current_pred.capacity_rps, proposed.capacity_rps)
    common: dict[str, object] = {
        "current": current_pred,
        "proposed": proposed,
        "target": target,
        "gain": gain,
        "split_direction": split_dir,
        "threshold_direction": thr_dir,
    }
    if split_dir == 0 and thr_dir == 0:
        return _hold(HOLD_ALREADY_OPTIMAL, "the current setting is the planner's answer", **common)
    if gain < guards.dead_band:
        return _hold(
            HOLD_DEAD_BAND,
            f"predicted gain {gain:.1%} is inside the dead band ({guards.dead_band:.0%})",
            **common,
        )
    if guards.cooldown_s > 0 and inp.history.last_applied_at is not None:
        since = inp.now - inp.history.last_applied_at
        if since < guards.cooldown_s:
            return _hold(
                HOLD_COOLDOWN,
                f"last apply {since:.0f} s ago (cool-down {guards.cooldown_s:.0f} s)",
                **common,
            )
    thr_move = threshold_move(split_dir, thr_dir)
    reversal = _reversal(inp.history, inp.now, split_dir, thr_move, gain, guards)
    if reversal:
        return _hold(HOLD_REVERSAL_LIMITED, reversal, **common)
    if gain < guards.urgent_gain and _persisted(inp.history, split_dir, thr_move) + 1 < (
        guards.persist_ticks
    ):
        return _hold(
            HOLD_AWAITING_PERSISTENCE,
            f"gain {gain:.1%} must persist for {guards.persist_ticks} ticks",
            **common,
        )

    changes: tuple[RoleChange, ...] = ()
    if split_dir > 0:
        changes = choose_role_changes(
            inp.instances,
            InstanceRole.DECODE,
            InstanceRole.PREFILL,
            proposed.setting.n_p - current.n_p,
        )
    elif split_dir < 0:
        changes = choose_role_changes(
            inp.instances,
            InstanceRole.PREFILL,
            InstanceRole.DECODE,
            current.n_p - proposed.setting.n_p,
        )
    if len(changes) != abs(proposed.setting.n_p - current.n_p):
        return _hold(HOLD_NO_ELIGIBLE_INSTANCE, "not enough active instances to flip", **common)
    return RebalanceDecision(
        action="propose",
        reason="gain",
        detail=f"predicted capacity gain {gain:.1%}",
        role_changes=changes,
        current=current_pred,
        proposed=proposed,
        target=target,
        gain=gain,
        split_direction=split_dir,
        threshold_direction=thr_dir,
    )


def _gain(current: float, proposed: float) -> float:
    if current <= 0:
        return math.inf if proposed > 0 else 0.0
    return proposed / current - 1.0


def _reversal(
    history: History, now: float, split_dir: int, thr_dir: int, gain: float, guards: RebalanceGuards
) -> str:
    reverses = [
        name
        for name, change, direction in (
            ("split", history.last_split_change, split_dir),
            ("threshold", history.last_threshold_change, thr_dir),
        )
        if change is not None and direction != 0 and direction == -change.direction
    ]
    if (
        reverses
        and history.last_reversal_at is not None
        and now - history.last_reversal_at < guards.reversal_window_s
    ):
        return (
            f"the {reverses[0]} would reverse again {now - history.last_reversal_at:.0f} s after "
            f"the last reversal (at most one per {guards.reversal_window_s:.0f} s)"
        )
    for name, change, direction in (
        ("split", history.last_split_change, split_dir),
        ("threshold", history.last_threshold_change, thr_dir),
    ):
        if (
            change is not None
            and direction != 0
            and direction == -change.direction
            and (now - change.at < guards.reversal_window_s or gain < guards.reversal_gain)
        ):
            return (
                f"the {name} moved the other way {now - change.at:.0f} s ago "
                f"(a reversal needs {guards.reversal_window_s:.0f} s and a gain of "
                f"{guards.reversal_gain:.0%})"
            )
    return ""


def _persisted(history: History, split_dir: int, thr_dir: int) -> int:
    """How many consecutive earlier ticks saw a candidate going the same way."""
    pending = history.pending
    if pending is None:
        return 0
    if pending.split_direction == split_dir and pending.threshold_direction == thr_dir:
        return pending.count
    return 0


def history_record_change(history: History, at: float, split_dir: int, thr_dir: int) -> History:
    """The history once a change going ``split_dir`` / ``thr_dir`` was applied at ``at``."""
    thr_dir = threshold_move(split_dir, thr_dir)
    reversed_ = any(
        change is not None and direction != 0 and direction == -change.direction
        for change, direction in (
            (history.last_split_change, split_dir),
            (history.last_threshold_change, thr_dir),
        )
    )
    return History(
        last_applied_at=at,
        last_split_change=Change(at, split_dir) if split_dir else history.last_split_change,
        last_threshold_change=(Change(at, thr_dir) if thr_dir else history.last_threshold_change),
        pending=None,
        last_reversal_at=at if reversed_ else history.last_reversal_at,
    )


def history_after(
    history: History, decision: RebalanceDecision, now: float, applied: bool
) -> History:
    """The history for the next tick, given this tick's decision and whether it was applied.

    Holds that saw a real candidate (dead band excluded) keep it pending so that persistence
    can count it; any other hold clears it. An applied proposal records its directions.
    """
    if decision.action == "propose":
        if not applied:
            return history
        return history_record_change(
            history, now, decision.split_direction, decision.threshold_direction
        )
    if decision.reason in PENDING_REASONS:
        thr_move = threshold_move(decision.split_direction, decision.threshold_direction)
        seen = _persisted(history, decision.split_direction, thr_move)
        return replace(
            history,
            pending=Pending(
                at=now,
                split_direction=decision.split_direction,
                threshold_direction=thr_move,
                count=seen + 1,
            ),
        )
    return replace(history, pending=None)


# ---------------------------------------------------------------------------------------------
# The planner, as the rebalancer uses it


def fleet_for_cluster(fleet: FleetSpec, cluster: str, instances: int) -> FleetSpec:
    """The part of ``fleet`` one PD cluster's plan is about: that cluster (with ``instances``
    usable instances and all the traffic it observed) and the PrfaaS clusters linked to it.

    Each tick plans one PD cluster on its own window, so a PrfaaS cluster shared with other
    PD clusters is counted whole here; the other clusters' next ticks see its load through
    their own windows.
    """
    pool = replace(fleet.pd_pool(cluster), instances=instances, share=1.0)
    links = tuple(link for link in fleet.links if link.target == cluster)
    linked = {link.source for link in links}
    prfaas = tuple(p for p in fleet.prfaas if p.name in linked)
    return FleetSpec(kv_mib=fleet.kv_mib, prfaas=prfaas, pd=(pool,), links=links)


class FleetPlanner:
    """:class:`PlannerPort` over :mod:`scheduling.core.planner`: the window's histogram becomes an
    empirical length distribution; capacity is the planner's Lambda_max, and throughput and
    egress are predicted at the observed arrival rate (capped by capacity)."""

    def __init__(
        self,
        fleet: FleetSpec,
        cluster: str,
        *,
        threshold_step: float = 100,
        at_rate: bool = True,
    ) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.threshold_step = threshold_step
        # Whether predictions carry the queue-aware figures at the observed rate (the plan
        # page shows them; the simulator's long-term loop does not need them).
        self.at_rate = at_rate
        self._lengths_key: tuple[tuple[float, float], ...] | None = None
        self._lengths: DiscreteLengths | None = None

    def lengths(self, window: TrafficSummary) -> DiscreteLengths:
        if self._lengths is None or self._lengths_key != window.incremental_tokens:
            self._lengths = DiscreteLengths.from_points(window.incremental_tokens)
            self._lengths_key = window.incremental_tokens
        return self._lengths

    def _prediction(
        self, window: TrafficSummary, ev: Evaluation, fleet: FleetSpec | None = None
    ) -> Prediction:
        c = ev.cluster(self.cluster)
        capacity = ev.throughput_rps
        rate = window.arrival_rate
        load = min(rate, capacity) / capacity if capacity > 0 else 0.0
        at = None
        if (
            self.at_rate
            and fleet is not None
            and window.output_tokens_mean is not None
            and 0 < rate < capacity
        ):
            at = operating_point(
                fleet,
                self.lengths(window),
                window.output_tokens_mean,
                {self.cluster: c.threshold_tokens},
                {self.cluster: c.n_p},
                rate,
            )
        return Prediction(
            setting=Setting(threshold=float(c.threshold_tokens), n_p=c.n_p, n_d=c.n_d),
            capacity_rps=capacity,
            throughput_rps=min(rate, capacity),
            offload_fraction=c.offload_fraction,
            ttft_mean_s=c.ttft_mean_s,
            ttft_p90_s=c.ttft_p90_s,
            egress_gbps=c.egress_gbps * load,
            bottleneck=ev.bottleneck,
            at_rate_ttft_mean_s=_finite_or_none(at.ttft_mean_s) if at else None,
            at_rate_ttft_p90_s=_finite_or_none(at.ttft_p90_s) if at else None,
            at_rate_link_utilisation=at.link_utilisation if at else None,
            offload_refused_fraction=(
                at.cluster(self.cluster).offload_refused_fraction if at else None
            ),
        )

    def evaluate(self, window: TrafficSummary, setting: Setting) -> Prediction:
        fleet = fleet_for_cluster(self.fleet, self.cluster, setting.n_p + setting.n_d)
        assert window.output_tokens_mean is not None
        ev = planner_evaluate(
            fleet,
            self.lengths(window),
            window.output_tokens_mean,
            {self.cluster: setting.threshold},
            {self.cluster: setting.n_p},
        )
        return self._prediction(window, ev, fleet)

    def best(self, window: TrafficSummary, n_total: int, n_p_range: tuple[int, int]) -> Prediction:
        fleet = fleet_for_cluster(self.fleet, self.cluster, n_total)
        assert window.output_tokens_mean is not None
        ev = plan_fleet(
            fleet,
            self.lengths(window),
            window.output_tokens_mean,
            threshold_step=self.threshold_step,
            split_bounds={self.cluster: n_p_range},
        )
        return self._prediction(window, ev, fleet)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def histogram_points(
    bin_edges: Sequence[float], counts: Sequence[float]
) -> tuple[tuple[float, float], ...]:
    """``(tokens, count)`` points of a length histogram: each non-empty bin at its middle (the
    open last bin at its lower edge), the form :class:`TrafficSummary` carries."""
    points = []
    for i, count in enumerate(counts):
        if count <= 0:
            continue
        lo = float(bin_edges[i])
        tokens = (lo + float(bin_edges[i + 1])) / 2 if i + 1 < len(bin_edges) else lo
        points.append((max(tokens, 1.0), float(count)))
    return tuple(points)


def window_from_lengths(
    lengths: Sequence[float],
    *,
    start_s: float,
    end_s: float,
    bin_edges: Sequence[float],
    output_tokens_mean: float | None,
    offloads: int = 0,
    cache_hit_tokens: float = 0.0,
    recorder_seen_at: float | None = None,
    bucket_s: float = 60.0,
) -> TrafficSummary:
    """A complete window from individual incremental lengths, binned like the traffic store
    (used by the simulator's long-term loop and by tests)."""
    counts = [0] * len(bin_edges)
    for tokens in lengths:
        i = max(0, bisect.bisect_right(bin_edges, tokens) - 1)
        counts[i] += 1
    return TrafficSummary(
        start_s=start_s,
        end_s=end_s,
        arrivals=len(lengths),
        offloads=offloads,
        incremental_tokens=histogram_points(bin_edges, counts),
        output_tokens_mean=output_tokens_mean,
        cache_hit_tokens=cache_hit_tokens,
        prompt_tokens=cache_hit_tokens + float(sum(lengths)),
        samples=max(1, math.ceil((end_s - start_s) / bucket_s)),
        bucket_s=bucket_s,
        recorder_seen_at=end_s if recorder_seen_at is None else recorder_seen_at,
    )


# Log-spaced length bins (4 per doubling) for windows built outside the traffic store; the
# traffic store's own edges (``scheduling.traffic.BIN_EDGES``) are the same shape.
DEFAULT_BIN_EDGES: tuple[int, ...] = (0, *(round(2 ** (k / 4)) for k in range(24, 85)))
