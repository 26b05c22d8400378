"""The rebalancer's planner port for a PD cluster that shares PrfaaS clusters with others:
it plans that cluster jointly with its peers, each with its own observed traffic and its
deployed setting, instead of alone with the whole PrfaaS cluster.

Pure: no Django. :class:`JointPlanner` implements :class:`scheduling.core.rebalancer.PlannerPort`.
The fleet it plans is the cluster, its peers (the PD clusters linked to any PrfaaS cluster the
cluster is linked to) and those PrfaaS clusters and links; each PD cluster's share of the
traffic is its observed arrival rate's share, and its lengths are its own window's. The peers
keep their deployed threshold and split (their own ticks move them), so the PrfaaS compute,
links and budgets they use are taken before this cluster's candidates are judged: a plan never
counts on PrfaaS capacity a peer is using. Capacity is this cluster's share of the fleet's
Lambda_max; the queue-aware figures are at the observed rates of all of them.

Limits: one mean output length for all (the rate-weighted mean of the windows'), as the planner
takes one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduling.core.fleet import FleetSpec
from scheduling.core.operating import operating_point
from scheduling.core.performance import DiscreteLengths, LengthDistribution
from scheduling.core.planner import Evaluation, plan_fleet
from scheduling.core.planner import evaluate as planner_evaluate
from scheduling.core.rebalancer import FleetPlanner, Prediction, Setting, TrafficSummary


@dataclass(frozen=True)
class Peer:
    """Another PD cluster sharing the planned one's PrfaaS clusters: what it observed and the
    setting it runs."""

    name: str
    window: TrafficSummary | None
    setting: Setting


def peers_of(fleet: FleetSpec, cluster: str) -> tuple[str, ...]:
    """The PD clusters linked to a PrfaaS cluster that ``cluster`` is linked to."""
    sources = {link.source for link in fleet.links if link.target == cluster}
    return tuple(
        sorted(
            {
                link.target
                for link in fleet.links
                if link.source in sources and link.target != cluster
            }
        )
    )


def _rate(window: TrafficSummary | None) -> float:
    return window.arrival_rate if window is not None else 0.0


def joint_fleet(
    fleet: FleetSpec, cluster: str, instances: int, rates: dict[str, float]
) -> FleetSpec:
    """The cluster (with ``instances``) and its peers, shares from ``rates``, the PrfaaS
    clusters linked to any of them and their links."""
    names = {cluster, *rates}
    total = sum(rates.values())
    pd = tuple(
        replace(
            p,
            instances=instances if p.name == cluster else p.instances,
            share=(rates.get(p.name, 0.0) / total) if total > 0 else float(p.name == cluster),
        )
        for p in fleet.pd
        if p.name in names
    )
    links = tuple(link for link in fleet.links if link.target in names)
    sources = {link.source for link in links}
    prfaas = tuple(p for p in fleet.prfaas if p.name in sources)
    return FleetSpec(kv_mib=fleet.kv_mib, prfaas=prfaas, pd=pd, links=links)


class JointPlanner:
    """:class:`scheduling.core.rebalancer.PlannerPort` planning one PD cluster with its peers."""

    def __init__(
        self,
        fleet: FleetSpec,
        cluster: str,
        peers: Sequence[Peer],
        *,
        threshold_step: float = 100,
    ) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.peers = tuple(peers)
        self.threshold_step = threshold_step
        self._alone = FleetPlanner(fleet, cluster, threshold_step=threshold_step)
        self._peer_lengths = {
            p.name: DiscreteLengths.from_points(p.window.incremental_tokens)
            for p in self.peers
            if p.window is not None and p.window.incremental_tokens
        }

    def _inputs(
        self, window: TrafficSummary
    ) -> tuple[dict[str, float], dict[str, LengthDistribution], float]:
        rates = {self.cluster: window.arrival_rate}
        lengths: dict[str, LengthDistribution] = {self.cluster: self._alone.lengths(window)}
        outputs = [(window.arrival_rate, window.output_tokens_mean or 0.0)]
        for p in self.peers:
            if p.name in self._peer_lengths:
                rates[p.name] = _rate(p.window)
                lengths[p.name] = self._peer_lengths[p.name]
                assert p.window is not None
                outputs.append((rates[p.name], p.window.output_tokens_mean or 0.0))
            else:
                rates[p.name] = 0.0
                lengths[p.name] = lengths[self.cluster]
        weight = sum(r for r, o in outputs if o > 0)
        output = (
            sum(r * o for r, o in outputs if o > 0) / weight
            if weight > 0
            else float(window.output_tokens_mean or 0.0)
        )
        return rates, lengths, output

    def _settings(self, setting: Setting) -> tuple[dict[str, float], dict[str, int]]:
        ts = {self.cluster: setting.threshold}
        ns = {self.cluster: setting.n_p}
        for p in self.peers:
            ts[p.name] = p.setting.threshold
            ns[p.name] = p.setting.n_p
        return ts, ns

    def _prediction(
        self,
        window: TrafficSummary,
        ev: Evaluation,
        fleet: FleetSpec,
        lengths: dict[str, LengthDistribution],
        output: float,
        rates: dict[str, float],
    ) -> Prediction:
        c = ev.cluster(self.cluster)
        share = fleet.pd_pool(self.cluster).share
        capacity = ev.throughput_rps * share
        rate = window.arrival_rate
        total = sum(rates.values())
        load = min(rate, capacity) / capacity if capacity > 0 else 0.0
        at = None
        if 0 < total < ev.throughput_rps:
            at = operating_point(
                fleet,
                lengths,
                output,
                {x.name: x.threshold_tokens for x in ev.clusters},
                {x.name: x.n_p for x in ev.clusters},
                total,
            ).cluster(self.cluster)
        return Prediction(
            setting=Setting(threshold=float(c.threshold_tokens), n_p=c.n_p, n_d=c.n_d),
            capacity_rps=capacity,
            throughput_rps=min(rate, capacity),
            offload_fraction=c.offload_fraction,
            ttft_mean_s=c.ttft_mean_s,
            ttft_p90_s=c.ttft_p90_s,
            egress_gbps=c.egress_gbps * load,
            bottleneck=ev.bottleneck,
            at_rate_ttft_mean_s=_finite(at.ttft_mean_s) if at else None,
            at_rate_ttft_p90_s=_finite(at.ttft_p90_s) if at else None,
        )

    def evaluate(self, window: TrafficSummary, setting: Setting) -> Prediction:
        if not self.peers:
            return self._alone.evaluate(window, setting)
        rates, lengths, output = self._inputs(window)
        fleet = joint_fleet(self.fleet, self.cluster, setting.n_p + setting.n_d, rates)
        ts, ns = self._settings(setting)
        ev = planner_evaluate(fleet, lengths, output, ts, ns)
        return self._prediction(window, ev, fleet, lengths, output, rates)

    def best(self, window: TrafficSummary, n_total: int, n_p_range: tuple[int, int]) -> Prediction:
        if not self.peers:
            return self._alone.best(window, n_total, n_p_range)
        rates, lengths, output = self._inputs(window)
        fleet = joint_fleet(self.fleet, self.cluster, n_total, rates)
        fixed = {p.name: (p.setting.threshold, p.setting.n_p) for p in self.peers}
        ev = plan_fleet(
            fleet,
            lengths,
            output,
            threshold_step=self.threshold_step,
            split_bounds={self.cluster: n_p_range},
            fixed=fixed,
        )
        return self._prediction(window, ev, fleet, lengths, output, rates)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
