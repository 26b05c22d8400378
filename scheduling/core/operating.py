"""The fleet at an operating point: queue-aware prediction of TTFT (mean, P90), station
utilisations and waits, link utilisation and refusals, for a setting and an arrival rate.

Pure Python and numpy: no Django. The model of each piece:

* a PD cluster's local prefill (PD-P) and each PrfaaS pool are M/G/c stations
  (:func:`scheduling.core.queueing.mgc_wait`, Allen-Cunneen) fed by Poisson arrivals (a
  threshold split of a Poisson stream is Poisson); service = the prefill-time law of the
  lengths each receives;
* each link admits or refuses offloads as :func:`scheduling.core.link.link_refusal` says (budget
  knapsack, saturation), refused ones prefill locally (a fixed point, iterated);
* a transfer outlasts its prefill by :func:`scheduling.core.link.transfer_excess_s` at the
  link's utilisation, and the KV lands one RTT after its last byte;
* decode admission of a PD cluster is one M/G/c station whose servers are its batch slots
  (n_d x max_batch), service = output tokens x step time: the router balances decode
  instances by their load, which counts the requests already routed there;
* a request's TTFT = its prefill wait + prefill + (offloaded: transfer excess + RTT) + its
  decode wait, the waits independent (:mod:`scheduling.core.queueing`).

* a prefix cached at the origin (``FleetSpec.prefix_hit``, lengths being the uncached rest)
  is moved into PrfaaS before an offload's prefill when the link's egress is abundant (its
  bytes reserved with the KV and streamed at the line rate first), and prefilled again with
  the rest at PrfaaS when it is not, as the router decides; the share of each is the
  probability that an offload finds the egress at most the router's abundant share
  (:func:`scheduling.core.link.link_outlook`).

Limits: the M/G/c shape is an approximation (see :mod:`scheduling.core.queueing`); a trace's
hashed prefixes are not modelled (its lengths are planned whole); bursty arrivals can be given
as their squared coefficient of variation ``arrival_scv`` (1 = Poisson) and enter the prefill
stations' waits only; with several PrfaaS pools linked to one PD cluster, its offloads are
split between them in proportion to their instances.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduling.core.fleet import FleetSpec, Lengths, PrfaasPool, lengths_of
from scheduling.core.link import (
    Link,
    OffloadMix,
    link_key,
    link_never_fits,
    link_outlook,
    transfer_excess_s,
)
from scheduling.core.offload import coarse_nodes, linked_pools
from scheduling.core.performance import FloatArray, kv_bytes, prefill_seconds
from scheduling.core.queueing import (
    NO_WAIT,
    TtftPart,
    Wait,
    mgc_wait,
    moments,
    ttft_mean,
    ttft_quantile,
    wait_transient,
)

GBPS = 1e9
#: Rounds of the refusal fixed point (refusals shift load to local prefill and back).
FIXED_POINT_ROUNDS = 6


@dataclass(frozen=True)
class StationAt:
    """One queueing station at the operating point (``kind``: pd_prefill, prfaas, decode)."""

    kind: str
    name: str
    rate_rps: float
    utilisation: float
    wait_mean_s: float
    wait_probability: float


@dataclass(frozen=True)
class LinkAt:
    """One link at the operating point: mean egress and its share of the line rate, the
    offloads offered to it and the share it refuses (budget full or saturated), and the mean
    bytes reserved on it."""

    source: str
    target: str
    gbps: float
    egress_gbps: float
    utilisation: float
    offered_rps: float
    refusal: float
    reserved_mean_bytes: float
    budget_bytes: int

    @property
    def key(self) -> str:
        return link_key(self.source, self.target)


@dataclass(frozen=True)
class ClusterAt:
    """One PD cluster at the operating point: its arrivals, the share offloaded (carried by a
    link) and the share of its decisions the links refuse, and its TTFT."""

    name: str
    rate_rps: float
    offload_fraction: float
    refused_fraction: float
    ttft_mean_s: float
    ttft_p90_s: float
    #: share of the offloads offered to the cluster's links (above its threshold) that their
    #: guard keeps local: prefilled on the cluster, at local TTFT
    offload_refused_fraction: float = 0.0


@dataclass(frozen=True)
class OperatingPoint:
    """The fleet at ``rate_rps`` total arrivals under one setting."""

    rate_rps: float
    ttft_mean_s: float
    ttft_p90_s: float
    link_utilisation: float  # the busiest link's mean egress share
    refused_fraction: float  # share of all decisions refused by a link (link_congested)
    stable: bool  # every station below utilisation 1
    clusters: tuple[ClusterAt, ...]
    links: tuple[LinkAt, ...]
    stations: tuple[StationAt, ...]

    def cluster(self, name: str) -> ClusterAt:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass
class _Route:
    """Offloads of one PD cluster over one link (mutable scratch of the fixed point).

    With a cached prefix at the origin (``FleetSpec.prefix_hit``) an offload goes one of two
    ways (:func:`scheduling.core.routing.candidates.prfaas_evaluate`): on a link whose egress
    is abundant the prefix is moved into PrfaaS first and PrfaaS prefills the rest ("moved");
    otherwise PrfaaS prefills the whole prompt ("plain"). Without one, every offload is plain
    and both ways are the same."""

    link: Link
    pool: PrfaasPool
    share: FloatArray  # per node: share of the cluster's wanting requests sent this way
    fits: FloatArray  # per node: 1 where the KV fits this link's budget
    refusal: FloatArray  # per node, current estimate
    service: FloatArray  # per node: PrfaaS prefill seconds, plain
    service_moved: FloatArray  # per node: PrfaaS prefill seconds after a move
    move_bytes: FloatArray  # per node: the prefix's bytes (0 without a cached prefix)
    excess: FloatArray  # per node: the transfer's excess over its prefill, plain
    excess_moved: FloatArray
    move_s: FloatArray  # per node: seconds until a moved prefix has landed
    moved: FloatArray  # per node: share of the carried offloads that move their prefix
    abundant: float = 1.0  # probability that an offload finds the link's egress abundant
    offered_rps: float = 0.0
    utilisation: float = 0.0

    @property
    def moves(self) -> bool:
        return bool(np.any(self.move_bytes > 0))

    def ways(self, carried: FloatArray) -> tuple[_Way, ...]:
        """How the ``carried`` offloads go: plain, and moved when there is a prefix."""
        rtt = self.link.rtt_ms / 1000.0
        none = np.zeros_like(carried)
        plain = _Way(carried * (1.0 - self.moved), none, self.service, self.excess + rtt, none)
        if not self.moves:
            return (plain,)
        moved = _Way(
            carried * self.moved,
            self.move_s,
            self.service_moved,
            self.excess_moved + rtt,
            self.move_bytes,
        )
        return plain, moved


@dataclass(frozen=True)
class _Way:
    """Offloads of a route that go one way, per node: their weights, the seconds before their
    PrfaaS prefill can queue (a prefix moving), the prefill, the seconds after it (the
    transfer's excess and one RTT), and the prefix bytes moved."""

    weights: FloatArray
    before_s: FloatArray
    service: FloatArray
    after_s: FloatArray
    moved_bytes: FloatArray


def _route_update(r: _Route, offered: FloatArray, kv: FloatArray, wait_s: float) -> float:
    """One round of the fixed point for route ``r`` offered ``offered`` req/s per node: its
    utilisation, transfer and move times, refusals and share moved (damped); returns how
    much its refusals moved."""
    r.offered_rps = float(offered.sum())
    line = r.link.gbps * GBPS / 8
    carried = offered * (1.0 - r.refusal)
    sent = float(np.dot(carried, kv + r.moved * r.move_bytes))
    r.utilisation = min(1.0, sent / line) if line > 0 else 1.0
    budget = r.link.budget
    r.excess = transfer_excess_s(kv, r.service, r.link.gbps, r.utilisation, budget)
    r.excess_moved = transfer_excess_s(kv, r.service_moved, r.link.gbps, r.utilisation, budget)
    rtt = r.link.rtt_ms / 1000.0
    free = line * (1.0 - r.utilisation)
    with np.errstate(divide="ignore"):
        r.move_s = np.where(r.move_bytes > 0, r.move_bytes / free + rtt if free > 0 else 1e9, 0.0)
    if r.offered_rps <= 0:
        return 0.0
    share = offered / r.offered_rps
    plain_hold = r.service + np.minimum(r.excess, 1e9) + rtt
    n = len(kv)
    a = r.abundant if r.moves else 0.0
    mix = OffloadMix(share[None, :], kv, r.service, plain_hold)
    if r.moves:
        # Each node as two kinds: plain (the link busy) and moved (its egress abundant).
        none = np.zeros(n)
        mix = OffloadMix(
            np.concatenate([share * (1.0 - a), share * a])[None, :],
            np.concatenate([kv, kv]),
            np.concatenate([r.service, r.service_moved]),
            np.concatenate([plain_hold, r.service_moved + np.minimum(r.excess_moved, 1e9) + rtt]),
            move_bytes=np.concatenate([none, r.move_bytes]),
            move_s=np.concatenate([none, np.minimum(r.move_s, 1e9)]),
        )
    out = link_outlook(r.offered_rps, mix, wait_s, r.link.gbps, r.link.budget)
    if r.moves:
        # A move happens only on an abundant link, never saturated: its budget alone refuses
        # it, as full as it is while the egress is abundant. The others find the link busy
        # (its egress above the abundant share).
        moving = out.refused_calm[0, n:]
        new = a * moving + (1.0 - a) * out.refused_busy[0, :n]
    else:
        moving = out.budget_block[0, :n]
        new = out.refused[0, :n]
    with np.errstate(divide="ignore", invalid="ignore"):
        new_moved = np.where(new < 1.0, a * (1.0 - moving) / (1.0 - new), 0.0)
    if r.moves:
        r.abundant = 0.5 * r.abundant + 0.5 * float(out.abundant[0])
    new = np.where(r.fits > 0, new, 1.0)
    updated = 0.5 * r.refusal + 0.5 * new
    change = float(np.max(np.abs(updated - r.refusal), initial=0.0))
    r.refusal = updated
    r.moved = np.clip(0.5 * r.moved + 0.5 * new_moved, 0.0, 1.0)
    return change


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def operating_point(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    thresholds: Mapping[str, float],
    splits: Mapping[str, int],
    rate_rps: float,
    *,
    output_scv: float = 0.0,
    arrival_scv: float = 1.0,
    quantile: float = 0.9,
) -> OperatingPoint:
    """Predict the fleet at ``rate_rps`` total arrivals (shared out by each PD cluster's
    ``share``) with ``thresholds`` and ``splits`` (prefill instances) per PD cluster."""
    return _operating(
        fleet,
        lengths,
        output_tokens,
        thresholds,
        splits,
        rate_rps,
        output_scv=output_scv,
        arrival_scv=arrival_scv,
        quantile=quantile,
    )[0]


@dataclass(frozen=True)
class WorkloadWindow:
    """One stretch of a workload that changes over time (a trace, cut in consecutive
    windows): ``share`` of its requests, arriving at ``rate_factor`` x the workload's mean
    rate, with their own uncached lengths and outputs; ``requests``: how many there are (the
    window's length in time at a given rate), 0 for a window that lasts (its queues settle)."""

    share: float
    rate_factor: float
    lengths: Lengths
    output_tokens: float
    output_scv: float = 0.0
    requests: int = 0


def operating_windows(
    fleet: FleetSpec,
    windows: Sequence[WorkloadWindow],
    thresholds: Mapping[str, float],
    splits: Mapping[str, int],
    rate_rps: float,
    *,
    arrival_scv: float = 1.0,
    quantile: float = 0.9,
) -> OperatingPoint:
    """Predict a workload replayed window after window at ``rate_rps`` mean arrivals: each
    window at its own rate and mix, the TTFTs of all windows pooled by their share of the
    requests. A window of ``requests`` lasts ``requests / (rate x rate_factor)`` seconds:
    its stations' waits are their mean over that stretch, started from the backlog the window
    before left (the first from an empty fleet), not their steady state
    (:func:`scheduling.core.queueing.wait_transient`): near saturation a queue takes far
    longer to build than a window lasts (mooncake-synthetic's first window, its PrfaaS pool at
    98%: a 15.6 s steady wait predicted, 2.5 s simulated over its 80 s). The links, clusters
    and stations reported are those of the busiest window (the highest station utilisation),
    with steady waits."""
    points: list[OperatingPoint] = []
    parts: list[TtftPart] = []
    backlog: dict[tuple[str, str], float] = {}
    for w in windows:
        rate = rate_rps * w.rate_factor
        duration = w.requests / rate if w.requests > 0 and rate > 0 else 0.0
        point, window_parts, waits = _operating(
            fleet,
            w.lengths,
            w.output_tokens,
            thresholds,
            splits,
            rate,
            output_scv=w.output_scv,
            arrival_scv=arrival_scv,
            quantile=quantile,
        )
        points.append(point)
        # The parts hold their stations' Wait objects: each is swapped for its transient.
        lived: dict[int, Wait] = {}
        for key, wait in waits.items():
            lived[id(wait)], backlog[key] = wait_transient(wait, duration, backlog.get(key, 0.0))
        parts.extend(
            TtftPart(
                p.weights * w.share,
                p.fixed_s,
                lived.get(id(p.prefill_wait), p.prefill_wait),
                lived.get(id(p.decode_wait), p.decode_wait),
            )
            for p in window_parts
        )
    if not points:
        raise ValueError("a workload needs at least one window")
    busiest = max(points, key=lambda op: max((s.utilisation for s in op.stations), default=0.0))
    total = sum(w.share for w in windows)
    return OperatingPoint(
        rate_rps=rate_rps,
        ttft_mean_s=ttft_mean(parts),
        ttft_p90_s=ttft_quantile(parts, quantile),
        link_utilisation=max(op.link_utilisation for op in points),
        refused_fraction=sum(
            w.share * op.refused_fraction for w, op in zip(windows, points, strict=True)
        )
        / total,
        stable=all(op.stable for op in points),
        clusters=busiest.clusters,
        links=busiest.links,
        stations=busiest.stations,
    )


def _operating(
    fleet: FleetSpec,
    lengths: Lengths,
    output_tokens: float,
    thresholds: Mapping[str, float],
    splits: Mapping[str, int],
    rate_rps: float,
    *,
    output_scv: float,
    arrival_scv: float,
    quantile: float,
) -> tuple[OperatingPoint, list[TtftPart], dict[tuple[str, str], Wait]]:
    """:func:`operating_point`, the TTFT mixture it was read from, and each station's wait
    (keyed by kind and name, as :class:`StationAt`; the mixture's parts hold these objects)."""
    if not (rate_rps >= 0 and math.isfinite(rate_rps)):
        raise ValueError(f"the rate must be a finite number >= 0, got {rate_rps!r}")
    nodes: dict[str, tuple[FloatArray, FloatArray]] = {}
    routes: dict[str, list[_Route]] = {}
    for c in fleet.pd:
        x, w = coarse_nodes(lengths_of(lengths, c.name))
        nodes[c.name] = (x, w)
        kv = kv_bytes(fleet.kv_mib, x)
        linked = linked_pools(fleet, c.name)
        total = sum(j.instances for _, j in linked)
        prefix = fleet.prefix_tokens(x)
        moving = kv_bytes(fleet.kv_mib, x + prefix) - kv
        routes[c.name] = [
            _Route(
                link,
                j,
                np.full(len(x), j.instances / total),
                (~link_never_fits(kv, link.budget)).astype(float),
                np.zeros(len(x)),
                prefill_seconds(j.prefill, x + prefix),
                prefill_seconds(j.prefill, x),
                np.where(prefix > 0, moving, 0.0) if link.gbps > 0 else np.zeros(len(x)),
                np.zeros(len(x)),
                np.zeros(len(x)),
                np.zeros(len(x)),
                np.zeros(len(x)),
            )
            for link, j in linked
        ]
    kv_of = {name: kv_bytes(fleet.kv_mib, x) for name, (x, _) in nodes.items()}
    prfaas_wait: dict[str, Wait] = {p.name: NO_WAIT for p in fleet.prfaas}
    prfaas_rate: dict[str, float] = {p.name: 0.0 for p in fleet.prfaas}

    def wanting(name: str) -> FloatArray:
        x, w = nodes[name]
        return np.where(x > thresholds[name], w, 0.0)

    for _ in range(FIXED_POINT_ROUNDS):
        moved = 0.0
        # PrfaaS pools: the offloads every cluster's links carry now.
        load: dict[str, tuple[list[FloatArray], list[FloatArray]]] = {
            p.name: ([], []) for p in fleet.prfaas
        }
        for c in fleet.pd:
            lam = rate_rps * c.share
            for r in routes[c.name]:
                carried = lam * wanting(c.name) * r.share * r.fits * (1.0 - r.refusal)
                for way in r.ways(carried):
                    load[r.pool.name][0].append(way.service)
                    load[r.pool.name][1].append(way.weights)
        for pool in fleet.prfaas:
            services, weight = load[pool.name]
            if not weight:
                continue
            s = np.concatenate(services)
            lam_w = np.concatenate(weight)
            mean, scv = moments(s, lam_w)
            prfaas_rate[pool.name] = float(lam_w.sum())
            prfaas_wait[pool.name] = mgc_wait(
                prfaas_rate[pool.name], mean, scv, pool.instances, scv_arrival=arrival_scv
            )
        # Links: what each is offered, how busy it is, what it refuses.
        for c in fleet.pd:
            for r in routes[c.name]:
                wait = prfaas_wait[r.pool.name]
                settled = _route_update(
                    r,
                    rate_rps * c.share * wanting(c.name) * r.share * r.fits,
                    kv_of[c.name],
                    wait.mean_s if wait.stable else 1e9,
                )
                moved = max(moved, settled)
        if moved < 1e-4:
            break  # the refusals have settled (at once when the links refuse nothing)

    stations: list[StationAt] = []
    clusters: list[ClusterAt] = []
    link_rows: list[LinkAt] = []
    parts_all: list[TtftPart] = []
    for pool in fleet.prfaas:
        wait = prfaas_wait[pool.name]
        stations.append(
            StationAt(
                "prfaas",
                pool.name,
                prfaas_rate[pool.name],
                wait.rho,
                wait.mean_s,
                wait.p_wait,
            )
        )
    refused_total = 0.0
    station_waits: dict[tuple[str, str], Wait] = {}
    for c in fleet.pd:
        lam = rate_rps * c.share
        x, w = nodes[c.name]
        want = wanting(c.name)
        away = np.zeros(len(x))
        refused = np.zeros(len(x))
        for r in routes[c.name]:
            away += want * r.share * r.fits * (1.0 - r.refusal)
            refused += want * r.share * (1.0 - r.fits * (1.0 - r.refusal))
        # No link at all: kept local as prfaas_unavailable, not refused by a link.
        refused_here = float(refused.sum()) if routes[c.name] else 0.0
        local_w = w - away
        n_p = int(splits[c.name])
        n_d = c.instances - n_p
        local_s = prefill_seconds(c.prefill, x)
        mean, scv = moments(local_s, local_w)
        local_wait = mgc_wait(lam * float(local_w.sum()), mean, scv, n_p, scv_arrival=arrival_scv)
        decode_s = output_tokens * c.step_seconds
        decode_wait = mgc_wait(lam, decode_s, output_scv, n_d * c.max_batch)
        station_waits[("pd_prefill", c.name)] = local_wait
        station_waits[("decode", c.name)] = decode_wait
        stations.append(
            StationAt(
                "pd_prefill",
                c.name,
                lam * float(local_w.sum()),
                local_wait.rho,
                local_wait.mean_s,
                local_wait.p_wait,
            )
        )
        stations.append(
            StationAt(
                "decode", c.name, lam, decode_wait.rho, decode_wait.mean_s, decode_wait.p_wait
            )
        )
        parts = [TtftPart(local_w, local_s, local_wait, decode_wait)]
        for r in routes[c.name]:
            weights = want * r.share * r.fits * (1.0 - r.refusal)
            kv = kv_of[c.name]
            reserved = 0.0
            for way in r.ways(weights):
                fixed = way.before_s + way.service + way.after_s
                parts.append(TtftPart(way.weights, fixed, prfaas_wait[r.pool.name], decode_wait))
                hold = np.minimum(prfaas_wait[r.pool.name].mean_s + fixed, 1e9)
                bytes_s = kv * hold + way.moved_bytes * np.minimum(way.before_s, 1e9)
                reserved += float(np.dot(lam * way.weights, bytes_s))
            carried = lam * weights
            link_rows.append(
                LinkAt(
                    r.link.source,
                    r.link.target,
                    r.link.gbps,
                    float(np.dot(carried, kv + r.moved * r.move_bytes)) * 8 / GBPS,
                    r.utilisation,
                    r.offered_rps,
                    float(
                        np.dot(want * r.share * r.fits, r.refusal)
                        / max(float(np.dot(want * r.share, r.fits)), 1e-300)
                    ),
                    reserved,
                    r.link.budget,
                )
            )
        mean_c = ttft_mean(parts)
        p90_c = ttft_quantile(parts, quantile)
        offered_share = float(want.sum())
        clusters.append(
            ClusterAt(
                c.name,
                lam,
                float(away.sum()),
                refused_here,
                mean_c,
                p90_c,
                refused_here / offered_share if offered_share > 0 else 0.0,
            )
        )
        refused_total += c.share * refused_here
        parts_all.extend(
            TtftPart(p.weights * c.share, p.fixed_s, p.prefill_wait, p.decode_wait) for p in parts
        )
    shares = sum(c.share for c in fleet.pd)
    point = OperatingPoint(
        rate_rps=rate_rps,
        ttft_mean_s=ttft_mean(parts_all),
        ttft_p90_s=ttft_quantile(parts_all, quantile),
        link_utilisation=max((lk.utilisation for lk in link_rows), default=0.0),
        refused_fraction=refused_total / shares if shares > 0 else 0.0,
        stable=all(s.utilisation < 1.0 for s in stations if s.rate_rps > 0),
        clusters=tuple(clusters),
        links=tuple(link_rows),
        stations=tuple(stations),
    )
    waits = {("prfaas", name): wait for name, wait in prfaas_wait.items()}
    waits.update(station_waits)
    return point, parts_all, waits


def operating_point_to_dict(op: OperatingPoint) -> dict[str, Any]:
    """JSON-ready (infinite values as null): the four headline figures first."""
    return {
        "rate_rps": op.rate_rps,
        "ttft_mean_s": _finite(op.ttft_mean_s),
        "ttft_p90_s": _finite(op.ttft_p90_s),
        "link_utilisation": op.link_utilisation,
        "link_congested_fraction": op.refused_fraction,
        "stable": op.stable,
        "clusters": {
            c.name: {
                "rate_rps": c.rate_rps,
                "offload_fraction": c.offload_fraction,
                "link_congested_fraction": c.refused_fraction,
                "offload_refused_fraction": c.offload_refused_fraction,
                "ttft_mean_s": _finite(c.ttft_mean_s),
                "ttft_p90_s": _finite(c.ttft_p90_s),
            }
            for c in op.clusters
        },
        "links": {
            lk.key: {
                "gbps": lk.gbps,
                "egress_gbps": lk.egress_gbps,
                "utilisation": lk.utilisation,
                "offered_rps": lk.offered_rps,
                "refusal": lk.refusal,
                "reserved_mean_bytes": lk.reserved_mean_bytes,
                "budget_bytes": lk.budget_bytes,
            }
            for lk in op.links
        },
        "stations": [
            {
                "kind": s.kind,
                "name": s.name,
                "rate_rps": s.rate_rps,
                "utilisation": _finite(s.utilisation),
                "wait_mean_s": _finite(s.wait_mean_s),
                "wait_probability": s.wait_probability,
            }
            for s in op.stations
        ],
    }
