"""Thin links (issue 28): the planner plans the router's link guard. Offloads the link refuses
prefill locally, the refused share is a prediction, not a constraint (unless an operator caps
it), and the predictions hold in the simulator (small, seeded runs)."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from scheduling.core.goodput import SloPlan
from scheduling.core.planner import (
    Evaluation,
    FleetSpec,
    fleet_from_scenario,
    plan_for_ttft,
    workload_lengths,
    workload_output_scv,
)
from scheduling.core.rebalance_types import Setting, TrafficSummary
from scheduling.core.rebalancer import FleetPlanner
from scheduling.core.scenario import Scenario, ScenarioError, scenario_load, scenario_parse
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate

SLO_S = 15.0


@pytest.fixture(scope="module")
def thin(scenarios_dir: Path) -> Scenario:
    return scenario_load(scenarios_dir / "thin-link.yaml")


def _plan(scenario: Scenario, fleet: FleetSpec | None = None) -> tuple[SloPlan, Evaluation]:
    lengths, out = workload_lengths(scenario)
    return plan_for_ttft(
        fleet or fleet_from_scenario(scenario),
        lengths,
        out,
        SLO_S,
        threshold_step=1000,
        output_scv=workload_output_scv(scenario),
    )


def _simulate(scenario: Scenario, slo: SloPlan, requests: int) -> SimulationResult:
    fleet = fleet_from_scenario(scenario)
    splits = {c.name: (slo.splits[c.name], c.instances - slo.splits[c.name]) for c in fleet.pd}
    return simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=slo.rate_rps, requests=requests, seed=3),
        fleet=fleet_setting(scenario, dict(slo.thresholds), splits),
    )


def test_a_thin_link_is_offloaded_with_the_guard_refusing_part(thin: Scenario) -> None:
    slo, _ = _plan(thin)
    assert slo.at_rate is not None
    (cluster,) = slo.at_rate.clusters
    # It offloads (the old planner kept everything local on this link) and predicts what the
    # guard keeps local instead of refusing to plan it.
    assert cluster.offload_fraction > 0.05
    assert 0 < cluster.refused_fraction < 1
    assert 0 < cluster.offload_refused_fraction < 1


def test_the_thin_link_predictions_hold_in_the_simulator(thin: Scenario) -> None:
    slo, _ = _plan(thin)
    assert slo.at_rate is not None
    run = _simulate(thin, slo, 2000)
    decisions = sum(run.reasons.values())
    congested = run.reasons.get("link_congested", 0) / decisions
    assert run.sustained_fraction >= 0.97
    assert run.ttft.p90 <= SLO_S
    assert 0.67 <= run.ttft.p90 / slo.at_rate.ttft_p90_s <= 1.5
    assert abs(slo.at_rate.refused_fraction - congested) <= 0.05


def test_an_operator_cap_on_refusals_is_kept(thin: Scenario) -> None:
    fleet = fleet_from_scenario(thin)
    capped = replace(
        fleet, links=tuple(replace(link, max_refused_share=0.05) for link in fleet.links)
    )
    slo, _ = _plan(thin, capped)
    assert slo.at_rate is not None
    assert slo.at_rate.refused_fraction <= 0.05
    free, _ = _plan(thin)
    assert free.rate_rps >= slo.rate_rps


def test_a_cap_out_of_bounds_is_refused(thin: Scenario) -> None:
    fleet = fleet_from_scenario(thin)
    bad = replace(fleet, links=tuple(replace(link, max_refused_share=1.5) for link in fleet.links))
    with pytest.raises(ValueError, match="max_refused_share"):
        _plan(thin, bad)


def test_a_rebalancer_prediction_carries_the_predicted_refused_share(thin: Scenario) -> None:
    """The key the plan pages read (scheduling.rebalance.selectors.PREDICTED_REFUSAL_KEY)."""
    fleet = fleet_from_scenario(thin)
    (pd,) = fleet.pd
    rng = np.random.default_rng(5)
    tokens = np.clip(rng.lognormal(9.9, 1.0, 2000), 128, 131072).round()
    values, counts = np.unique(tokens, return_counts=True)
    window = TrafficSummary(
        start_s=0.0,
        end_s=2000.0,
        arrivals=2400,  # 1.2 req/s: below the capacity of the setting evaluated
        offloads=0,
        incremental_tokens=tuple(zip(values.tolist(), counts.astype(float).tolist(), strict=True)),
        output_tokens_mean=1024.0,
        cache_hit_tokens=0.0,
        prompt_tokens=float(tokens.sum()),
        samples=200,
        bucket_s=10.0,
        recorder_seen_at=2000.0,
    )
    planner = FleetPlanner(fleet, pd.name)
    prediction = planner.evaluate(window, Setting(threshold=12000.0, n_p=6, n_d=2))
    assert prediction.offload_refused_fraction is not None
    assert 0 < prediction.offload_refused_fraction < 1
    # scheduling.rebalance.selectors.PREDICTED_REFUSAL_KEY, as prediction_json stores it
    assert asdict(prediction)["offload_refused_fraction"] == prediction.offload_refused_fraction


def test_a_scenario_link_may_cap_its_refused_share(scenarios_dir: Path) -> None:
    link = {"source": "prfaas-h200", "target": "pd-h20", "gbps": 8, "rtt_ms": 20}
    data = {"version": 1, "name": "capped", "extends": "thin-link.yaml"}
    capped = scenario_parse(
        {**data, "links": [{**link, "max_refused_share": 0.2}]}, base_dir=scenarios_dir
    )
    assert [lk.max_refused_share for lk in fleet_from_scenario(capped).links] == [0.2]
    assert (
        fleet_from_scenario(scenario_load(scenarios_dir / "thin-link.yaml"))
        .links[0]
        .max_refused_share
        is None
    )
    with pytest.raises(ScenarioError, match="max_refused_share"):
        scenario_parse(
            {**data, "links": [{**link, "max_refused_share": 1.5}]}, base_dir=scenarios_dir
        )
