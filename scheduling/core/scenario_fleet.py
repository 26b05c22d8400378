"""A scenario as the planner's fleet: the pools, links and traffic shares a scenario describes,
and its workload as the planner's length distributions.
Pure Python: no Django import here.
"""

from __future__ import annotations

from scheduling.core.fleet import FleetSpec, PdPool, PrfaasPool
from scheduling.core.performance import LengthDistribution, Table, length_distribution
from scheduling.core.queueing import moments
from scheduling.core.scenario import Scenario, ScenarioError, workload_length_distributions


def fleet_from_scenario(scenario: Scenario) -> FleetSpec:
    """The fleet a scenario describes, with each PD cluster's traffic share."""
    origins = scenario.workload.origins if scenario.workload is not None else {}

    def cost(acc: str) -> float:
        return scenario.accelerator(acc).gpu_hour_cost

    prfaas = []
    pd = []
    for c in scenario.clusters:
        prof = scenario.profile_for(c.accelerator)
        table = Table.from_points(prof.prefill_seconds)
        if c.kind == "prfaas":
            prfaas.append(
                PrfaasPool(
                    c.name, c.prefill_instances, table, prof.gpus_per_instance, cost(c.accelerator)
                )
            )
        else:
            assert prof.decode is not None  # the reader guarantees it for pd clusters
            share = origins.get(c.name, 1.0 if len(scenario.pd_clusters) == 1 else 0.0)
            pd.append(
                PdPool(
                    c.name,
                    c.instances,
                    table,
                    prof.decode.max_batch,
                    prof.decode.step_seconds,
                    share,
                    prof.gpus_per_instance,
                    cost(c.accelerator),
                )
            )
    workload = scenario.workload
    # A trace's lengths are planned whole (its prefixes are hashed blocks, not a share).
    hit = workload.prefix_hit_fraction if workload is not None and workload.trace is None else 0
    return FleetSpec(
        Table.from_points(scenario.model.kv_cache_mib),
        tuple(prfaas),
        tuple(pd),
        scenario.links,
        prefix_hit=min(float(hit or 0.0), 1.0),
    )


def workload_lengths(scenario: Scenario) -> tuple[LengthDistribution, float]:
    """The uncached input-length distribution and the mean output length of a scenario's
    workload (a prefix-hit fraction h shrinks every length to (1 - h) of it)."""
    if scenario.workload is None:
        raise ScenarioError("workload", "required key is missing (the planner needs the traffic)")
    inp, out = workload_length_distributions(scenario.workload, bin_tokens=16)
    hit = scenario.workload.prefix_hit_fraction or 0.0
    if hit >= 1.0:
        raise ScenarioError(
            "workload.prefix_hit_fraction", "every token cached leaves nothing to plan"
        )
    return length_distribution(inp, scale=1.0 - hit), length_distribution(out).mean


def workload_output_scv(scenario: Scenario) -> float:
    """Squared coefficient of variation of the output lengths (decode times vary with them)."""
    if scenario.workload is None:
        return 0.0
    _, out = workload_length_distributions(scenario.workload, bin_tokens=16)
    x, w = length_distribution(out).nodes()
    return moments(x, w)[1]
