"""The configurations a simulation can run, each built from the planner's answer.

* ``homogeneous``: every instance of the fleet replaced by the PD accelerator, one PD cluster
  (named ``homogeneous``) taking all traffic, the planner's best split, no PrfaaS;
* ``naive``: every prefill on PrfaaS, every PD instance decodes (no threshold, no balancing);
* ``prfaas``: the planner's static threshold and split per PD cluster;
* ``prfaas-dual``: ``prfaas`` plus the short-term controller per request and the long-term
  re-planning on the simulated clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from scheduling.core.planner import Evaluation, PlanResult
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.routing import ClusterPlan, FleetPlan

POLICIES = ("homogeneous", "naive", "prfaas", "prfaas-dual")
HOMOGENEOUS_CLUSTER = "homogeneous"


class PolicyError(ValueError):
    """A configuration that cannot be built for this scenario."""


def _cache_gib(scenario: Scenario, cluster: str) -> float:
    spec = scenario.caches.get(cluster)
    return spec.gib_per_instance if spec is not None else 0.0


def _pd_cluster_plan(
    scenario: Scenario, name: str, accelerator: str, n_p: int, n_d: int, cache_from: str, site: str
) -> ClusterPlan:
    profile = scenario.profile_for(accelerator)
    if profile.decode is None:
        raise PolicyError(f"accelerator {accelerator} has no decode profile")
    return ClusterPlan(
        name=name,
        kind="pd",
        accelerator=accelerator,
        prefill_seconds=tuple(profile.prefill_seconds),
        n_prefill=n_p,
        n_decode=n_d,
        max_batch=profile.decode.max_batch,
        step_seconds=profile.decode.step_seconds,
        cache_gib_per_instance=_cache_gib(scenario, cache_from),
        site=site,
    )


def _splits(evaluation: Evaluation) -> dict[str, tuple[int, int, float]]:
    return {c.name: (c.n_p, c.n_d, c.threshold_tokens) for c in evaluation.clusters}


def fleet_plan(
    scenario: Scenario,
    policy: str,
    plan: PlanResult,
    *,
    threshold: float | None = None,
) -> FleetPlan:
    """The fleet, split and thresholds ``policy`` runs, from the planner's ``plan``.

    ``threshold`` overrides the planned threshold of every PD cluster (prfaas policies).
    """
    if policy not in POLICIES:
        raise PolicyError(f"unknown policy {policy!r} (use {', '.join(POLICIES)})")
    if policy == "homogeneous":
        ev = plan.homogeneous
        ((n_p, n_d, _),) = _splits(ev).values()
        reference = max(scenario.pd_clusters, key=lambda c: c.instances)
        cluster = _pd_cluster_plan(
            scenario,
            HOMOGENEOUS_CLUSTER,
            reference.accelerator,
            n_p,
            n_d,
            reference.name,
            reference.site,
        )
        return FleetPlan(policy, (cluster,), (), {}, ev.throughput_rps)
    ev = plan.naive_heterogeneous if policy == "naive" else plan.prfaas
    splits = _splits(ev)
    clusters: list[ClusterPlan] = []
    thresholds: dict[str, int] = {}
    for c in scenario.clusters:
        profile = scenario.profile_for(c.accelerator)
        if c.kind == "prfaas":
            clusters.append(
                ClusterPlan(
                    name=c.name,
                    kind="prfaas",
                    accelerator=c.accelerator,
                    prefill_seconds=tuple(profile.prefill_seconds),
                    n_prefill=c.prefill_instances,
                    cache_gib_per_instance=_cache_gib(scenario, c.name),
                    site=c.site,
                )
            )
            continue
        n_p, n_d, planned = splits.get(c.name, (c.prefill_instances, c.decode_instances, 0.0))
        if policy == "naive":
            n_p, n_d, planned = 0, c.instances, 0.0
        clusters.append(_pd_cluster_plan(scenario, c.name, c.accelerator, n_p, n_d, c.name, c.site))
        chosen = threshold if threshold is not None and policy != "naive" else planned
        thresholds[c.name] = max(0, round(chosen))
    links = scenario.links
    return FleetPlan(policy, tuple(clusters), links, thresholds, ev.throughput_rps)


def origin_map(plan: FleetPlan, origins: Mapping[str, float]) -> dict[str, str]:
    """Where each scenario origin's traffic arrives in this configuration."""
    if plan.policy == "homogeneous":
        return dict.fromkeys(origins, HOMOGENEOUS_CLUSTER)
    return {name: name for name in origins}


def fleet_setting(
    scenario: Scenario,
    thresholds: Mapping[str, float],
    splits: Mapping[str, tuple[int, int]],
    *,
    planned_capacity_rps: float | None = None,
) -> FleetPlan:
    """The scenario's fleet run with the given threshold and (prefill, decode) split of each
    PD cluster (a cluster missing from ``splits`` keeps the scenario's own; one missing from
    ``thresholds`` never offloads): a plan, a rebalancer's candidate, a what-if."""
    base = fleet_as_configured(scenario)
    clusters = tuple(
        replace(c, n_prefill=splits[c.name][0], n_decode=splits[c.name][1])
        if c.kind == "pd" and c.name in splits
        else c
        for c in base.clusters
    )
    chosen = {name: max(0, round(t)) for name, t in thresholds.items() if math.isfinite(t)}
    return replace(
        base, clusters=clusters, thresholds=chosen, planned_capacity_rps=planned_capacity_rps
    )


def fleet_as_configured(scenario: Scenario, *, threshold: float | None = None) -> FleetPlan:
    """The fleet exactly as the scenario lists it (its own split), with one static threshold
    for every PD cluster (``None``: never offload). For what-if runs and fidelity checks."""
    clusters: list[ClusterPlan] = []
    thresholds: dict[str, int] = {}
    for c in scenario.clusters:
        if c.kind == "prfaas":
            profile = scenario.profile_for(c.accelerator)
            clusters.append(
                ClusterPlan(
                    c.name,
                    "prfaas",
                    c.accelerator,
                    tuple(profile.prefill_seconds),
                    c.prefill_instances,
                    cache_gib_per_instance=_cache_gib(scenario, c.name),
                    site=c.site,
                )
            )
        else:
            clusters.append(
                _pd_cluster_plan(
                    scenario,
                    c.name,
                    c.accelerator,
                    c.prefill_instances,
                    c.decode_instances,
                    c.name,
                    c.site,
                )
            )
            if threshold is not None:
                thresholds[c.name] = max(0, round(threshold))
    links = scenario.links
    return FleetPlan("prfaas", tuple(clusters), links, thresholds, None)
