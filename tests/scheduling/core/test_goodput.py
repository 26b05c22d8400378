"""Planning for a TTFT target (goodput)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduling.core.goodput import slo_rate
from scheduling.core.performance import LengthDistribution
from scheduling.core.planner import FleetSpec, plan_fleet, plan_for_ttft
from scheduling.core.scenario import scenario_load
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import SimulationConfig, simulate

#: The case study's fleet, prompt lengths and output tokens (the ``case`` fixture, conftest).
Case = tuple[FleetSpec, LengthDistribution, float]


def test_the_goodput_plan_keeps_the_predicted_p90_within_the_target(case: Case) -> None:
    fleet, lengths, out = case
    slo, ev = plan_for_ttft(fleet, lengths, out, 10.0)
    assert slo.at_rate is not None and slo.at_rate.ttft_p90_s <= 10.0
    assert 0 < slo.rate_rps < ev.throughput_rps
    # Never worse than the Lambda_max plan's own setting under the same target.
    best = plan_fleet(fleet, lengths, out)
    own, _ = slo_rate(
        fleet,
        lengths,
        out,
        {c.name: c.threshold_tokens for c in best.clusters},
        {c.name: c.n_p for c in best.clusters},
        10.0,
        upper_rps=best.throughput_rps,
    )
    assert slo.rate_rps >= own * (1 - 1e-6)
    # A tighter target carries less traffic.
    tight, _ = plan_for_ttft(fleet, lengths, out, 6.0)
    assert tight.rate_rps < slo.rate_rps


@pytest.mark.slow
def test_the_simulator_confirms_the_goodput_plan(case: Case, scenarios_dir: Path) -> None:
    fleet, lengths, out = case
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    slo, ev = plan_for_ttft(fleet, lengths, out, 10.0)
    setting = fleet_setting(
        scenario,
        dict(slo.thresholds),
        {c.name: (c.n_p, c.n_d) for c in ev.clusters},
    )
    run = simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=slo.rate_rps, requests=6000, seed=3),
        fleet=setting,
    )
    assert run.ttft.p90 <= 10.0 and run.sustained_fraction >= 0.97
