"""Live state of the fleet and the short-term congestion controller.

:class:`LiveState` is one snapshot of what is happening now (instance loads, link loads, the
control state of each PD cluster). The controller raises a PD cluster's effective threshold
while its links or its PrfaaS queues are congested and lets it decay back with hysteresis
(:func:`control_update`, a pure state transition the caller ticks). Every ``*_at``/``now`` is
seconds on one clock chosen by the caller.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduling.core.link import link_admits
from scheduling.core.routing.types import LinkReservation, RouteGuards, Topology

# --------------------------------------------------------------------------------------
# Live state: what is happening now (one snapshot per request or per batch)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """Latest load of one instance.

    ``queue_depth``: requests waiting for prefill; ``queued_prefill_tokens``: their uncached
    tokens; ``queued_prefill_s``: their prefill seconds if the reporter knows them (otherwise
    derived as ``depth * T(tokens / depth)`` on the instance's hardware). ``running``,
    ``waiting``: requests in the engine (decode load); ``kv_usage``: KV memory used (0..1).
    ``state``: overrides the inventory state when set (e.g. health checks saw it down).
    """

    queue_depth: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_s: float | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    updated_at: float | None = None
    state: str | None = None


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """Latest load of one link: recent egress rate and KV bytes reserved in flight."""

    egress_gbps: float = 0.0
    inflight_bytes: int = 0
    updated_at: float | None = None


@dataclass(frozen=True, slots=True)
class ControlState:
    """Short-term control state of one PD cluster (its links and PrfaaS queues).

    ``threshold_factor`` (>= 1) multiplies the policy's ``t`` into the effective threshold, so
    a new policy version needs no rebasing. ``congested_since``: start of the current
    congestion, ``None`` when not congested. ``scarce``: hysteresis latch of the bandwidth
    mode used while utilisation sits between the abundant and scarce guards.
    ``cause``: ``link`` or ``backlog``, what raised the threshold last.
    """

    threshold_factor: float = 1.0
    congested_since: float | None = None
    updated_at: float | None = None
    scarce: bool = False
    cause: str | None = None

    def effective_threshold(self, base_threshold: float) -> float:
        # Never below the policy's t: control only ever raises it.
        factor = self.threshold_factor
        return base_threshold * factor if factor > 1.0 else base_threshold


@dataclass(frozen=True, slots=True)
class ControlSignals:
    """Inputs of :func:`control_update`: worst egress utilisation (0..1) of the links into
    the PD cluster, and worst queued prefill seconds per instance of its PrfaaS clusters."""

    egress_utilisation: float
    prfaas_backlog_s: float


@dataclass(frozen=True, slots=True)
class LiveState:
    """One snapshot of the fleet's live state.

    ``instances``/``links``: latest loads by instance name and by ``(source, target)``;
    missing entries count as idle. ``control``: ControlState per PD cluster (missing: not
    congested). ``stale``: the caller knows the state is missing or unreliable (Redis down,
    client without live state). ``telemetry_at``: time of the newest telemetry the snapshot
    reflects; older than ``guards.stale_after_s`` also makes it stale.

    ``derived``: what decisions compute from the loads alone (each cluster's active pools),
    kept for the next decision against the same loads (a process deciding with one polled
    state for many requests builds them once). A memo only, never compared or serialised;
    :func:`dataclasses.replace` carries it over, so a replaced state must keep ``instances``
    (replace ``now``, ``control``; build a new state for new loads). The loads' mappings are
    not to be changed in place.
    """

    now: float = 0.0
    instances: Mapping[str, InstanceLoad] = field(default_factory=dict)
    links: Mapping[tuple[str, str], LinkLoad] = field(default_factory=dict)
    control: Mapping[str, ControlState] = field(default_factory=dict)
    stale: bool = False
    telemetry_at: float | None = None
    derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


# --------------------------------------------------------------------------------------
# Control: effective threshold with hysteresis
# --------------------------------------------------------------------------------------


def prefill_pool(topology: Topology, live: LiveState, cluster: str) -> list[list[Any]]:
    """Active prefill instances of ``cluster`` as ``[instance, backlog_s]`` entries.

    Backlog: ``queued_prefill_s`` when reported, else ``depth * T(tokens / depth)`` on the
    cluster's hardware. This loop runs for every instance of the origin on every request,
    so the table lookup is inlined (reporters that send ``queued_prefill_s`` skip it).
    """
    loads = live.instances
    pool: list[list[Any]] = []
    curve = topology.prefill_curve.get(cluster)
    if curve is None:
        return pool
    xs, ys, slopes = curve._xs, curve._ys, curve._slopes
    last = len(slopes) - 1
    append = pool.append
    for name, inst, active in topology.prefill_rows.get(cluster, ()):
        load = loads.get(name)
        if load is None:
            if active:
                append([inst, 0.0])
            continue
        state = load.state
        if (state != "active") if state is not None else not active:
            continue
        q = load.queued_prefill_s
        if q is None:
            tokens = load.queued_prefill_tokens
            if tokens > 0:
                depth = load.queue_depth
                if depth < 1:
                    depth = 1
                x = tokens / depth
                i = bisect_right(xs, x) - 1
                if i < 0:
                    i = 0
                elif i > last:
                    i = last
                q = depth * (ys[i] + slopes[i] * (x - xs[i]))
                if q < 0.0:
                    q = 0.0
            else:
                q = 0.0
        elif q < 0.0:
            q = 0.0
        append([inst, q])
    return pool


def control_initial(now: float | None = None) -> ControlState:
    """The state of a PD cluster with no congestion history."""
    return ControlState(updated_at=now)


def control_update(
    state: ControlState, signals: ControlSignals, guards: RouteGuards, now: float
) -> ControlState:
    """Advance one PD cluster's control state to ``now`` given fresh congestion signals.

    Congested (utilisation >= scarce guard or backlog >= backlog guard): the threshold factor
    jumps to ``threshold_raise_factor`` on entry and doubles every
    ``threshold_rise_doubling_s`` while congestion lasts, capped at ``threshold_max_factor``.
    Clear (utilisation <= abundant guard and backlog <= clear guard): the excess over 1
    decays with ``threshold_decay_half_life_s``. In between, the factor holds (hysteresis).
    Time-based, so the result does not depend on how often it is called.
    """
    dt = 0.0 if state.updated_at is None else max(0.0, now - state.updated_at)
    link_hot = signals.egress_utilisation >= guards.scarce_utilisation
    backlog_hot = signals.prfaas_backlog_s >= guards.prfaas_backlog_s
    clear = (
        signals.egress_utilisation <= guards.abundant_utilisation
        and signals.prfaas_backlog_s <= guards.prfaas_backlog_clear_s
    )
    factor = state.threshold_factor
    if link_hot or backlog_hot:
        cause = "backlog" if backlog_hot and not link_hot else "link"
        if state.congested_since is None:
            factor = max(factor, guards.threshold_raise_factor)
            since: float | None = now
        else:
            factor = max(factor, guards.threshold_raise_factor) * 2.0 ** (
                dt / guards.threshold_rise_doubling_s
            )
            since = state.congested_since
        factor = min(factor, guards.threshold_max_factor)
        return ControlState(factor, since, now, True, cause)
    if clear:
        excess = (factor - 1.0) * 0.5 ** (dt / guards.threshold_decay_half_life_s)
        if excess < 1e-3:
            excess = 0.0
        return ControlState(1.0 + excess, None, now, False, state.cause if excess else None)
    # Between the guards: keep the factor and the latch, congestion episode over or not.
    return ControlState(factor, state.congested_since, now, state.scarce, state.cause)


def control_signals(pd_cluster: str, topology: Topology, live: LiveState) -> ControlSignals:
    """The congestion signals of one PD cluster from a live snapshot (what the server's tick
    and the simulator feed :func:`control_update`)."""
    util = 0.0
    backlog = 0.0
    for link in topology.links_into.get(pd_cluster, ()):
        load = live.links.get(link.pair)
        if load is not None:
            util = max(util, load.egress_gbps / link.gbps)
        pool = prefill_pool(topology, live, link.source)
        if pool:
            backlog = max(backlog, sum(e[1] for e in pool) / len(pool))
    return ControlSignals(egress_utilisation=util, prfaas_backlog_s=backlog)


def live_is_stale(live: LiveState, guards: RouteGuards) -> bool:
    """True when the snapshot must not be trusted (flagged, or older than the guard)."""
    if live.stale:
        return True
    return live.telemetry_at is not None and live.now - live.telemetry_at > guards.stale_after_s


def reservation_fits(reservation: LinkReservation, topology: Topology, live: LiveState) -> bool:
    """Whether ``reservation`` fits the link's in-flight budget given the live in-flight
    bytes (the pure twin of the server's atomic Redis reservation)."""
    link = topology.link_by_pair.get((reservation.source, reservation.target))
    if link is None:
        return False
    load = live.links.get(link.pair)
    inflight = load.inflight_bytes if load is not None else 0
    return link_admits(0.0, inflight, reservation.bytes, link.budget)
