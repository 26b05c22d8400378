"""Fidelity of the engine against queueing theory and its own bookkeeping (acceptance 5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scheduling.core.planner import PlanResult
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.simulator.policies import fleet_as_configured
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate
from tests.scheduling.core.simulator.conftest import ONE_INSTANCE

SERVICE_S = 1.0
RHO = 0.3


@pytest.mark.slow
def test_one_instance_under_poisson_arrivals_matches_the_md1_mean_wait(
    write_scenario: Callable[..., Path],
) -> None:
    # M/D/1: Wq = rho * S / (2 (1 - rho)). Averaged over 150,000 requests the relative
    # standard error of the mean wait is about 1% at rho = 0.3 (the waits are correlated),
    # so 3% is three standard errors. The formula uses the realised arrival rate.
    scenario = scenario_load(write_scenario(ONE_INSTANCE.format(service=SERVICE_S, rate=RHO)))
    result = simulate(
        scenario,
        SimulationConfig(requests=150_000, seed=11),
        fleet=fleet_as_configured(scenario),
        keep_requests=True,
    )
    requests = result.per_request
    waits = np.array([r.prefill_start_s - r.arrival_s for r in requests])
    rho = result.offered_rate_rps * SERVICE_S
    expected = rho * SERVICE_S / (2 * (1 - rho))
    assert waits.mean() == pytest.approx(expected, rel=0.03)
    assert all(
        r.prefill_end_s - r.prefill_start_s == pytest.approx(SERVICE_S) for r in requests[:100]
    )


def test_littles_law_holds_for_the_whole_run(
    case_study: Scenario, case_study_plan: PlanResult
) -> None:
    result = simulate(
        case_study,
        SimulationConfig(policy="prfaas", rate_per_s=2.5, requests=3000, seed=2),
        plan=case_study_plan,
    )
    # L from the time integral of the number in system, W from per-request timestamps.
    assert result.mean_in_system == pytest.approx(
        result.throughput_rps * result.mean_sojourn_s, rel=0.01
    )
    assert result.mean_in_system > 1.0


@pytest.fixture
def case_study_run(
    write_scenario: Callable[..., Path], scenarios_dir: Path, case_study_plan: PlanResult
) -> Callable[..., SimulationResult]:
    """Runs the case study as extended by a scenario template (``{base}`` is the case study),
    under the ``prfaas`` policy at 2 req/s on the case study's plan."""

    def run(
        template: str, requests: int, seed: int, keep_requests: bool = False
    ) -> SimulationResult:
        path = write_scenario(template.format(base=scenarios_dir / "paper-case-study.yaml"))
        config = SimulationConfig(policy="prfaas", rate_per_s=2.0, requests=requests, seed=seed)
        return simulate(
            scenario_load(path), config, plan=case_study_plan, keep_requests=keep_requests
        )

    return run


FAILURES = """
version: 1
name: failures
extends: {base}
events:
  - {{at_s: 60, instance: prfaas-h200-0, state: down}}
  - {{at_s: 90, instance: pd-h20-4, state: down}}
  - {{at_s: 120, link: "prfaas-h200->pd-h20", gbps: 5}}
  - {{at_s: 300, instance: prfaas-h200-0, state: active}}
  - {{at_s: 320, instance: pd-h20-4, state: active}}
  - {{at_s: 400, link: "prfaas-h200->pd-h20", gbps: 100}}
"""


def test_every_request_finishes_or_is_counted_as_dropped_through_failures(
    case_study_run: Callable[..., SimulationResult],
) -> None:
    result = case_study_run(FAILURES, requests=1500, seed=5, keep_requests=True)
    assert result.finished + result.dropped == result.requests == 1500
    assert result.dropped == sum(result.dropped_by_reason.values())
    # The decode instance that failed had requests running: they are lost, and said so.
    assert result.dropped_by_reason.get("decode_failed", 0) > 0
    assert result.redispatched > 0
    unaccounted = [r for r in result.per_request if not r.dropped and np.isnan(r.finish_s)]
    assert unaccounted == []


def test_kv_bytes_sent_equal_bytes_received(
    case_study_run: Callable[..., SimulationResult],
) -> None:
    result = case_study_run(FAILURES, requests=1500, seed=7, keep_requests=True)
    (link,) = result.links
    assert link.sent_bytes > 0
    # Everything that left the PrfaaS side arrived, except transfers cut by the failure.
    assert link.sent_bytes == pytest.approx(link.delivered_bytes + link.aborted_bytes, rel=1e-9)
    received = sum(
        r.kv_bytes for r in result.per_request if r.route == "prfaas" and not np.isnan(r.kv_ready_s)
    )
    assert link.delivered_bytes == pytest.approx(received + result.cache_transfer_bytes, rel=1e-9)


def test_the_same_seed_gives_identical_output(
    case_study: Scenario, case_study_plan: PlanResult
) -> None:
    config = SimulationConfig(policy="prfaas", rate_per_s=2.8, requests=1500, seed=21)
    first = simulate(case_study, config, plan=case_study_plan).to_dict()
    second = simulate(case_study, config, plan=case_study_plan).to_dict()
    other = simulate(case_study, replace(config, seed=22), plan=case_study_plan).to_dict()
    for run in (first, second, other):
        run.pop("wall_s")
    assert first == second
    assert first != other


CUT_FOR_GOOD = """
version: 1
name: cut
extends: {base}
events:
  - {{at_s: 50, link: "prfaas-h200->pd-h20", gbps: 0}}
"""


def test_a_link_cut_for_good_ends_the_run_and_counts_the_stranded_requests(
    case_study_run: Callable[..., SimulationResult],
) -> None:
    result = case_study_run(CUT_FOR_GOOD, requests=400, seed=3)
    assert result.finished + result.dropped == result.requests == 400
    assert result.dropped_by_reason.get("stranded", 0) > 0
    # After the cut the router keeps everything local: it sees the link has no room.
    assert result.reasons.get("link_congested", 0) > 0
    (link,) = result.links
    assert link.sent_bytes == pytest.approx(link.delivered_bytes + link.aborted_bytes, rel=1e-9)
