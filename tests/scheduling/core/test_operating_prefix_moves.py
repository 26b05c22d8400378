"""Prefix hits in the operating point (scheduling.core.operating): an offload whose origin
holds part of its prompt moves that prefix into PrfaaS over the link when the link's egress is
abundant, and PrfaaS prefills the whole prompt when it is not, as the router does
(scheduling.core.routing.candidates.prfaas_evaluate); the simulator, routing through the
router, agrees."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from scheduling.core.operating import OperatingPoint, operating_point
from scheduling.core.planner import plan_scenario
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.scenario_fleet import fleet_from_scenario, workload_lengths
from scheduling.core.simulator.run import SimulationConfig, simulate


@pytest.fixture
def hits(scenarios_dir: Path) -> Scenario:
    """A 25 Gbps link, 4x the paper's KV per token, 30% of every prompt cached at its origin."""
    return scenario_load(scenarios_dir / "thin-link-25g-4x.yaml")


def predict(scenario: Scenario, prefix_hit: float, rate: float) -> OperatingPoint:
    fleet = replace(fleet_from_scenario(scenario), prefix_hit=prefix_hit)
    lengths, output = workload_lengths(scenario)
    thresholds = {c.name: 20_000.0 for c in fleet.pd}
    splits = {c.name: 6 for c in fleet.pd}
    return operating_point(fleet, lengths, output, thresholds, splits, rate)


def test_the_fleet_knows_the_share_of_each_prompt_cached_at_its_origin(hits: Scenario) -> None:
    fleet = fleet_from_scenario(hits)

    assert fleet.prefix_hit == pytest.approx(0.3)
    # 7,000 uncached tokens of a prompt 30% cached: 3,000 cached ones.
    assert float(fleet.prefix_tokens(7_000.0)) == pytest.approx(3_000.0)


def test_moving_prefixes_costs_link_bytes_budget_and_ttft(hits: Scenario) -> None:
    none = predict(hits, 0.0, 1.5)
    moving = predict(hits, 0.3, 1.5)

    # The same uncached lengths and threshold: the same offers, but every carried offload
    # also sends its prefix, and the bigger reservations are refused more often.
    assert moving.links[0].offered_rps == pytest.approx(none.links[0].offered_rps)
    assert moving.links[0].refusal > none.links[0].refusal
    carried_none = none.links[0].offered_rps * (1 - none.links[0].refusal)
    carried_moving = moving.links[0].offered_rps * (1 - moving.links[0].refusal)
    assert moving.links[0].egress_gbps / carried_moving > none.links[0].egress_gbps / carried_none
    assert moving.ttft_mean_s > none.ttft_mean_s


def test_the_simulator_moves_prefixes_and_agrees_with_the_prediction(hits: Scenario) -> None:
    plan = plan_scenario(hits)
    at = plan.at_load
    assert at is not None
    result = simulate(
        hits,
        SimulationConfig(policy="prfaas", rate_per_s=at.rate_rps, requests=6000, seed=3),
        plan=plan,
        keep_requests=True,
    )
    offloaded = [r for r in result.per_request if r.route == "prfaas"]
    decisions = sum(result.reasons.values())

    # At 80% of capacity the link's egress is mostly abundant: the offloads move prefixes.
    assert sum(r.cache_transfer_bytes > 0 for r in offloaded) >= 0.9 * len(offloaded)
    assert abs(result.reasons["link_congested"] / decisions - at.refused_fraction) <= 0.05
    assert 0.67 <= result.ttft.p90 / at.ttft_p90_s <= 1.5
