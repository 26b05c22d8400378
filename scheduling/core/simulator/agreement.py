"""Does a plan hold? The planner's queue-aware prediction at its planned load confronted with
the simulator running the same router at that rate (issue 12, acceptance 1).

``plan S --load F`` predicts ``at_load`` (rate, TTFT mean and P90, link utilisation, share of
decisions ``link_congested``); ``simulate S --policy prfaas --rate <at_load rate>`` measures
them. :func:`agreement_check` does both and says whether the plan holds:

* the fleet keeps up: completions while arrivals last, after warm-up, are at least
  ``min_sustained`` of the offered rate (``SimulationResult.sustained_fraction``);
* the simulated P90 TTFT is within ``[p90_low, p90_high]`` x the predicted one;
* the predicted share of decisions ``link_congested`` (the link guard's refusals, prefilled
  locally: planned since issue 28, not a constraint) is within ``MAX_REFUSAL_ERROR`` of the
  simulated one.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.core.planner import DEFAULT_LOAD
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.run import (
    MIN_SUSTAINED,
    SimulationConfig,
    SimulationResult,
    plan_for,
    simulate,
)

P90_LOW, P90_HIGH = 0.67, 1.5
MAX_REFUSAL_ERROR = 0.05


@dataclass(frozen=True)
class Agreement:
    """One scenario: what the planner said at its planned load and what the simulator saw."""

    scenario: str
    capacity_rps: float
    rate_rps: float
    predicted_ttft_mean_s: float
    predicted_ttft_p90_s: float
    predicted_link_utilisation: float
    predicted_link_congested: float
    offered_rps: float
    sustained_fraction: float
    throughput_fraction: float
    ttft_mean_s: float
    ttft_p90_s: float
    link_congested: float

    @property
    def p90_ratio(self) -> float:
        return self.ttft_p90_s / self.predicted_ttft_p90_s

    @property
    def holds(self) -> bool:
        return (
            self.sustained_fraction >= MIN_SUSTAINED
            and P90_LOW <= self.p90_ratio <= P90_HIGH
            and abs(self.link_congested - self.predicted_link_congested) <= MAX_REFUSAL_ERROR
        )


def agreement_check(
    scenario: Scenario, *, load: float = DEFAULT_LOAD, requests: int = 6000, seed: int = 3
) -> tuple[Agreement, SimulationResult]:
    """Plan at ``load``, simulate ``requests`` at the predicted rate, compare (see the
    module). A trace is replayed whole: its plan is made for all of it, window by window."""
    plan = plan_for(scenario, load=load)
    at = plan.at_load
    assert at is not None
    traced = scenario.workload is not None and scenario.workload.trace is not None
    result = simulate(
        scenario,
        SimulationConfig(
            policy="prfaas",
            rate_per_s=at.rate_rps,
            requests=None if traced else requests,
            seed=seed,
        ),
        plan=plan,
    )
    decisions = sum(result.reasons.values())
    row = Agreement(
        scenario=scenario.name,
        capacity_rps=plan.window_capacity_rps or plan.prfaas.throughput_rps,
        rate_rps=at.rate_rps,
        predicted_ttft_mean_s=at.ttft_mean_s,
        predicted_ttft_p90_s=at.ttft_p90_s,
        predicted_link_utilisation=at.link_utilisation,
        predicted_link_congested=at.refused_fraction,
        offered_rps=result.offered_rate_rps,
        sustained_fraction=result.sustained_fraction,
        throughput_fraction=result.throughput_rps / result.offered_rate_rps,
        ttft_mean_s=result.ttft.mean,
        ttft_p90_s=result.ttft.p90,
        link_congested=result.reasons.get("link_congested", 0) / decisions if decisions else 0.0,
    )
    return row, result
