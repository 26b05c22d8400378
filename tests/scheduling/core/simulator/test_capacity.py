"""What the capacity search calls sustained (issue 28, item 6).

The case study's naive fleet prefills everything at PrfaaS and has no local prefill to fall
back on: when the link's in-flight budget is full the router refuses the request
(``no_capacity``). It is a loss system: its backlog never trends, it loses a steady share of its
load. Runs of 100,000 requests (docs/simulator.md) keep 98% of 2.4 req/s and 96% of 2.5 req/s
(the planner's Lambda_max is 2.50), so a rate well under that is sustained although a few
requests are refused, and one well past it is not although its backlog is flat.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.planner import PlanResult
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.capacity import capacity_search
from scheduling.core.simulator.run import MIN_SUSTAINED, SimulationConfig, simulate

NAIVE = SimulationConfig(policy="naive", requests=4000, seed=7)


def test_a_rate_long_runs_sustain_is_sustained_though_a_few_requests_are_refused(
    case_study: Scenario,
) -> None:
    run = simulate(case_study, replace(NAIVE, rate_per_s=2.3))
    assert run.dropped_by_reason.get("no_capacity", 0) > 0
    assert run.sustained_fraction >= MIN_SUSTAINED
    assert run.sustained


def test_a_rate_past_capacity_is_not_sustained_though_its_backlog_is_flat(
    case_study: Scenario,
) -> None:
    run = simulate(case_study, replace(NAIVE, rate_per_s=2.8))
    assert run.stable
    assert run.sustained_fraction < MIN_SUSTAINED
    assert not run.sustained


def test_the_naive_capacity_lands_near_the_planners_lambda_max(
    case_study: Scenario, case_study_plan: PlanResult
) -> None:
    found = capacity_search(case_study, NAIVE, plan=case_study_plan, iterations=5)
    assert found.planned_capacity_rps is not None
    # Long runs put the 97% point at about 2.45 req/s, 2% under the planner's 2.50 (the planner
    # evaluates T(E[L]), real queues pay E[T(L)]); "nothing refused" stopped at about 2.0.
    assert found.capacity_rps == pytest.approx(found.planned_capacity_rps, rel=0.06)
    above = [p for p in found.probes if p.rate_rps > found.capacity_rps]
    assert above and not any(p.sustained for p in above)
