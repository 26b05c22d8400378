"""The paper's case study reproduced by simulation (acceptance 1-3).

Tolerances: the simulator runs real queues with the full length distribution, while the
planner's Lambda_max uses mean lengths (T(E[L]) instead of E[T(L)]), so capacities land a
few percent under the planner; 10% is the issue's bound. Queue-free TTFT over 4,000 requests
has a standard error of about 1.5% of the mean, well inside 10%.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.planner import PlanResult
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.capacity import CapacityResult, capacity_search
from scheduling.core.simulator.run import SimulationConfig, simulate

PROBE_REQUESTS = 8000


@pytest.fixture(scope="module")
def capacities(case_study: Scenario, case_study_plan: PlanResult) -> dict[str, CapacityResult]:
    return {
        policy: capacity_search(
            case_study,
            SimulationConfig(policy=policy, requests=PROBE_REQUESTS, seed=1),
            plan=case_study_plan,
            iterations=6,
        )
        for policy in ("prfaas", "homogeneous", "naive")
    }


@pytest.mark.slow
def test_prfaas_sustains_far_more_than_both_baselines(
    capacities: dict[str, CapacityResult],
) -> None:
    prfaas = capacities["prfaas"].capacity_rps
    assert prfaas / capacities["homogeneous"].capacity_rps >= 1.40
    assert prfaas / capacities["naive"].capacity_rps >= 1.18


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["prfaas", "homogeneous", "naive"])
def test_each_capacity_is_within_ten_percent_of_the_planners_lambda_max(
    capacities: dict[str, CapacityResult], policy: str
) -> None:
    found = capacities[policy]
    assert found.planned_capacity_rps is not None
    # Issue 28: the naive fleet, with no local prefill, refuses what its link's budget cannot
    # hold (a loss system); it is held to the share it completes, as the others are.
    assert found.capacity_rps == pytest.approx(found.planned_capacity_rps, rel=0.10)
    # The search brackets the answer: a sustained probe at it, a failing one just above.
    above = [p for p in found.probes if p.rate_rps > found.capacity_rps]
    assert above and not any(p.sustained for p in above if p.rate_rps <= found.capacity_rps * 1.05)


@pytest.mark.slow
def test_queue_free_ttft_matches_the_papers_table_6(
    case_study: Scenario, case_study_plan: PlanResult
) -> None:
    config = SimulationConfig(rate_per_s=0.01, requests=4000, seed=3)
    prfaas = simulate(case_study, config, plan=case_study_plan)
    homogeneous = simulate(case_study, replace(config, policy="homogeneous"), plan=case_study_plan)
    assert prfaas.ttft.mean == pytest.approx(2.22, rel=0.10)
    assert prfaas.ttft.p90 == pytest.approx(3.51, rel=0.10)
    assert homogeneous.ttft.p90 == pytest.approx(9.73, rel=0.10)


@pytest.mark.slow
def test_at_80_percent_of_homogeneous_capacity_prfaas_halves_the_p90_ttft(
    case_study: Scenario, case_study_plan: PlanResult, capacities: dict[str, CapacityResult]
) -> None:
    rate = 0.8 * capacities["homogeneous"].capacity_rps
    runs = {
        policy: simulate(
            case_study,
            SimulationConfig(policy=policy, rate_per_s=rate, requests=6000, seed=4),
            plan=case_study_plan,
        )
        for policy in ("prfaas", "homogeneous")
    }
    assert runs["prfaas"].ttft.p90 <= 0.5 * runs["homogeneous"].ttft.p90
