"""The rebalancer's tick, Django side: plan a PD cluster jointly with the PD clusters that share
its PrfaaS clusters, and simulate a proposal on the recent traffic before it is shown.

Called from :func:`scheduling.rebalance.tick.rebalance_tick` (which passes what it read of the traffic
store and the policy as callables, so this module reads the inventory only):

* :func:`planner_joint` is the tick's planner port: :class:`scheduling.core.joint_planner.
  JointPlanner` over the inventory (PrfaaS clusters count only their active instances), with
  the peers' windows and deployed settings;
* :func:`proposal_check` runs :func:`scheduling.core.simulator.verify.candidate_verify` on a
  proposal (this cluster's candidate, the peers as they run) and turns a proposal the
  simulation does not confirm into a hold (``simulation_rejected``, or
  ``simulation_incomplete`` when the bounded simulation ran out of time), keeping the
  predictions; the simulated figures go to the tick and the plan either way.

Settings: ``REBALANCE_SIMULATION_REQUESTS`` (requests per run) and
``REBALANCE_SIMULATION_WALL_S`` (wall-clock budget of one verification).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.db.models import Count

from clusters.models import Cluster, ClusterKind, Instance, InstanceRole, InstanceState
from clusters.topology import topology_scenario
from scheduling.core import rebalancer
from scheduling.core.fleet import FleetSpec
from scheduling.core.joint_planner import JointPlanner, Peer, peers_of
from scheduling.core.planner import fleet_from_scenario
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.verify import Limits, Traffic, Verdict, candidate_verify

WindowOf = Callable[[Cluster], rebalancer.TrafficSummary]
ThresholdOf = Callable[[Cluster], float]


def _active_prfaas() -> dict[str, int]:
    return dict(
        Instance.objects.filter(cluster__kind=ClusterKind.PRFAAS, state=InstanceState.ACTIVE)
        .values("cluster__name")
        .annotate(n=Count("id"))
        .values_list("cluster__name", "n")
    )


def inventory_scenario() -> Scenario:
    """The inventory as a scenario, PrfaaS clusters counting only their active instances."""
    scenario = topology_scenario()
    active = _active_prfaas()
    return replace(
        scenario,
        clusters=tuple(
            replace(c, prefill_instances=int(active.get(c.name, 0))) if c.kind == "prfaas" else c
            for c in scenario.clusters
        ),
    )


def inventory_fleet() -> FleetSpec:
    """The inventory as the planner sees it (active PrfaaS instances only)."""
    return fleet_from_scenario(inventory_scenario())


def _setting_of(cluster: Cluster, threshold: float) -> rebalancer.Setting:
    roles = dict(
        Instance.objects.filter(cluster=cluster, state=InstanceState.ACTIVE)
        .values("role")
        .annotate(n=Count("id"))
        .values_list("role", "n")
    )
    return rebalancer.Setting(
        threshold=threshold,
        n_p=int(roles.get(InstanceRole.PREFILL, 0)),
        n_d=int(roles.get(InstanceRole.DECODE, 0)),
    )


def _peers(fleet: FleetSpec, cluster: Cluster, context: Mapping[str, Any]) -> list[Peer]:
    window_of: WindowOf | None = context.get("window_of")
    threshold_of: ThresholdOf | None = context.get("threshold_of")
    if window_of is None or threshold_of is None:
        return []
    out = []
    for name in peers_of(fleet, cluster.name):
        peer = Cluster.objects.filter(name=name, kind=ClusterKind.PD).first()
        if peer is None:
            continue
        out.append(Peer(name, window_of(peer), _setting_of(peer, threshold_of(peer))))
    return out


def planner_joint(cluster: Cluster, context: Mapping[str, Any]) -> rebalancer.PlannerPort:
    """The tick's planner port: this PD cluster planned with its peers (see the module)."""
    fleet = inventory_fleet()
    return JointPlanner(fleet, cluster.name, _peers(fleet, cluster, context))


def _traffic(window: rebalancer.TrafficSummary | None) -> Traffic | None:
    if window is None or not window.incremental_tokens or window.arrival_rate <= 0:
        return None
    return Traffic(
        rate_rps=window.arrival_rate,
        lengths=tuple(window.incremental_tokens),
        output_tokens=float(window.output_tokens_mean or 1.0),
    )


def simulation_limits() -> Limits:
    return Limits(
        max_requests=int(settings.REBALANCE_SIMULATION_REQUESTS),
        max_wall_s=float(settings.REBALANCE_SIMULATION_WALL_S),
    )


def proposal_check(
    cluster: Cluster,
    decision: rebalancer.RebalanceDecision,
    context: Mapping[str, Any],
    *,
    limits: Limits | None = None,
) -> tuple[rebalancer.RebalanceDecision, dict[str, Any] | None]:
    """Simulate a proposal against the current setting; a proposal the simulation does not
    confirm becomes a hold. Returns the decision to record and the simulated figures."""
    if decision.action != "propose" or decision.current is None or decision.proposed is None:
        return decision, None
    window: rebalancer.TrafficSummary = context["window"]
    own = _traffic(window)
    if own is None:
        return decision, None
    scenario = inventory_scenario()
    fleet = fleet_from_scenario(scenario)
    cur, new = decision.current.setting, decision.proposed.setting
    traffic = {cluster.name: own}
    current = {cluster.name: (cur.threshold, cur.n_p, cur.n_d)}
    candidate = {cluster.name: (new.threshold, new.n_p, new.n_d)}
    for peer in _peers(fleet, cluster, context):
        seen = _traffic(peer.window)
        if seen is not None:
            traffic[peer.name] = seen
        s = peer.setting
        current[peer.name] = candidate[peer.name] = (s.threshold, s.n_p, s.n_d)
    # The current setting's capacity for the fleet at this mix of traffic.
    total = sum(t.rate_rps for t in traffic.values())
    capacity = decision.current.capacity_rps * total / own.rate_rps
    verdict = candidate_verify(
        scenario,
        traffic,
        current,
        candidate,
        capacity_rps=capacity,
        limits=limits or simulation_limits(),
    )
    figures = verdict.to_dict()
    if verdict.confirmed:
        return decision, figures
    return _held(decision, verdict), figures


def _held(decision: rebalancer.RebalanceDecision, verdict: Verdict) -> rebalancer.RebalanceDecision:
    reason = (
        rebalancer.HOLD_SIMULATION_INCOMPLETE
        if verdict.confirmed is None
        else rebalancer.HOLD_SIMULATION_REJECTED
    )
    return replace(
        decision,
        action="hold",
        reason=reason,
        detail=f"predicted gain {decision.gain or 0.0:.1%}, but {verdict.detail}",
        role_changes=(),
    )
