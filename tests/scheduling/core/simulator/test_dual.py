"""``prfaas-dual``: the short-term controller per request and re-planning on the simulated clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduling.core.planner import PlanResult
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.simulator.replan import PlannerReplanner
from scheduling.core.simulator.routing import Replan, ReplanInput
from scheduling.core.simulator.run import SimulationConfig, plan_for, simulate


class FlipOnce:
    """A replanner that turns one decode instance into a prefill one at its first tick."""

    def __init__(self) -> None:
        self.seen: list[ReplanInput] = []

    def replan(self, inp: ReplanInput) -> Replan | None:
        self.seen.append(inp)
        if len(self.seen) > 1:
            return None
        return Replan(threshold=inp.threshold + 1000, flips=((inp.decode[0], "prefill"),))


def test_a_replanner_plugs_in_and_its_flips_drain_then_change_roles(
    case_study: Scenario, case_study_plan: PlanResult
) -> None:
    replanner = FlipOnce()
    result = simulate(
        case_study,
        SimulationConfig(
            policy="prfaas-dual", rate_per_s=2.0, requests=2000, replan_interval_s=300
        ),
        plan=case_study_plan,
        replanner=replanner,
        keep_requests=True,
    )
    first = replanner.seen[0]
    assert first.now == 300
    assert first.requests and all(r.origin == "pd-h20" for r in first.requests)
    n_p = case_study_plan.prfaas.cluster("pd-h20").n_p
    assert result.split["pd-h20"] == (n_p + 1, 8 - n_p - 1)
    assert result.thresholds["pd-h20"] == round(first.threshold) + 1000
    flipped = first.decode[0]
    # After the flip the instance prefills; it decoded nothing it was not already given.
    assert any(
        r.prefill_instance and r.prefill_instance.name == flipped for r in result.per_request
    )
    assert result.finished + result.dropped == result.requests
    assert result.dropped == 0


@pytest.mark.slow
def test_re_planning_follows_prompts_that_grow_longer(scenarios_dir: Path) -> None:
    drift = scenario_load(scenarios_dir / "drift.yaml")
    replanner = PlannerReplanner(drift)
    result = simulate(
        drift,
        SimulationConfig(policy="prfaas-dual", duration_s=10_800, seed=1),
        plan=plan_for(drift),
        replanner=replanner,
    )
    assert result.finished + result.dropped == result.requests
    assert result.replans, "the long-term loop never proposed anything"
    first_threshold = result.replans[0][2]
    assert result.thresholds["pd-h20"] >= first_threshold
    # Longer prompts move the optimum towards more offloading per request and more prefill.
    assert result.thresholds["pd-h20"] > 8500
    reasons = {decision.reason for _, _, decision in replanner.decisions}
    assert "gain" in reasons
