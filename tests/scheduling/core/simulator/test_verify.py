"""The proposal check's verdict follows from the numbers it reports: a run at a rate neither
setting can carry says so, and rests on the rates each carried."""

from __future__ import annotations

from pathlib import Path

from scheduling.core.scenario import scenario_load
from scheduling.core.simulator.verify import (
    CONFIRMED_OVERLOADED,
    NO_GAIN_UNDER_STRESS,
    Limits,
    Traffic,
    candidate_verify,
    overloaded,
    run_from_dict,
)

# Prompt lengths (tokens, count) of a long-prompt mix, and the case study's settings: now
# (t = 19,600, 3 prefill / 5 decode) and a candidate with more prefill.
LENGTHS = ((8000.0, 3.0), (24000.0, 4.0), (60000.0, 2.0))


def test_a_rate_no_setting_carries_is_called_overloaded_not_a_confirmed_gain(
    scenarios_dir: Path,
) -> None:
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    verdict = candidate_verify(
        scenario,
        {"pd-h20": Traffic(rate_rps=12.0, lengths=LENGTHS, output_tokens=256)},
        {"pd-h20": (19600.0, 3, 5)},
        {"pd-h20": (12000.0, 5, 3)},
        capacity_rps=2.0,  # far below what is offered: the check runs at the observed rate
        limits=Limits(max_requests=400, max_wall_s=120),
    )
    assert verdict.stress is not None and verdict.observed is None
    current, proposal = verdict.stress
    assert current.rate_rps > 10 and overloaded(current, proposal)
    assert verdict.reason in (CONFIRMED_OVERLOADED, NO_GAIN_UNDER_STRESS)
    assert "more than either setting carries" in verdict.detail
    assert "confirms the gain" not in verdict.detail
    carried = f"{proposal.rate_rps * proposal.sustained_fraction:.2f} req/s"
    assert carried in verdict.detail
    # The stored form reads back to the same runs (the plan page judges from them).
    stored = verdict.to_dict()["stress"]
    assert overloaded(run_from_dict(stored["current"]), run_from_dict(stored["proposed"]))
