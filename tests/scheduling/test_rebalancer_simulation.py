"""The rebalancer's decision inside the simulator (``prfaas-dual``) on drifting traffic
(``drift.yaml``: prompts grow from mu 9.3 to 10.2 over three hours, then the load rises)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduling.performance import TruncatedLognormal
from scheduling.planner import fleet_from_scenario, plan_fleet, plan_scenario
from scheduling.scenario import scenario_load
from scheduling.simulator.run import SimulationConfig, simulate

pytestmark = pytest.mark.slow

# A TTFT target for goodput: about three times the paper's P90 TTFT of PrfaaS-PD (3.51 s).
TTFT_SLO_S = 10.0
SETTLED_S = 4 * 3600.0  # drift.yaml: one hour at mu 9.3, then a three-hour ramp
TICK_S = 600.0  # the simulator's default re-planning period


def test_prfaas_dual_beats_the_best_static_plan_of_the_first_hour_on_drift(scenarios_dir: Path):
    scenario = scenario_load(scenarios_dir / "drift.yaml")
    first_hour = plan_scenario(scenario)  # planned on the first phase: mu 9.3
    runs = {
        policy: simulate(
            scenario,
            SimulationConfig(policy=policy, duration_s=6 * 3600, seed=1, ttft_slo_s=TTFT_SLO_S),
            plan=first_hour,
        )
        for policy in ("prfaas", "prfaas-dual")
    }
    static, dual = runs["prfaas"], runs["prfaas-dual"]
    assert static.replans == () and dual.replans
    assert dual.goodput_rps >= 1.10 * static.goodput_rps, (dual.goodput_rps, static.goodput_rps)

    # The long-term loop ends where the planner puts the settled traffic (mu 10.2).
    settled = plan_fleet(
        fleet_from_scenario(scenario), TruncatedLognormal(10.2, 1.0, 128, 131072), 1024.0
    ).clusters[0]
    _, _, threshold, n_p, n_d = dual.replans[-1]
    assert (n_p, n_d) == (settled.n_p, settled.n_d)
    assert abs(threshold - settled.threshold_tokens) / settled.threshold_tokens < 0.2
    reached = [t for t, _, _, p, d in dual.replans if (p, d) == (settled.n_p, settled.n_d)]
    assert reached[0] <= SETTLED_S + 2 * TICK_S  # within two ticks after the ramp ends
