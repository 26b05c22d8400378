"""Workloads: Poisson arrivals, phases with ramps, origins, rate events, prefix hits, seeds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.simulator.workload import WorkloadError, workload_build


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps(case_study: Scenario) -> None:
    workload = workload_build(case_study, rate_per_s=3.0, seed=1, requests=20_000)
    arrivals = np.array([r.arrival_s for r in workload.requests])
    gaps = np.diff(arrivals)
    # 20,000 gaps: the mean is within 2% of 1/3 s (standard error 0.7%), the CV near 1.
    assert gaps.mean() == pytest.approx(1 / 3.0, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    lengths = np.array([r.input_tokens for r in workload.requests])
    assert lengths.min() >= 128 and lengths.max() <= 131072
    # Truncated log-normal(9.90, 1.00) on [128, 131072]: mean 27,486 tokens (paper notes 7.1).
    assert lengths.mean() == pytest.approx(27_486, rel=0.03)
    assert {r.output_tokens for r in workload.requests} == {1024}


def test_a_duration_cuts_the_arrivals_at_that_time(case_study: Scenario) -> None:
    workload = workload_build(case_study, rate_per_s=2.0, seed=1, duration_s=500.0)
    assert workload.requests[-1].arrival_s <= 500.0
    assert len(workload.requests) == pytest.approx(1000, rel=0.15)


def test_runs_at_different_rates_reuse_the_same_random_draws(case_study: Scenario) -> None:
    slow = workload_build(case_study, rate_per_s=1.0, seed=4, requests=500)
    fast = workload_build(case_study, rate_per_s=2.0, seed=4, requests=500)
    assert [r.input_tokens for r in slow.requests] == [r.input_tokens for r in fast.requests]
    assert [r.arrival_s / 2 for r in slow.requests] == pytest.approx(
        [r.arrival_s for r in fast.requests]
    )


def test_a_ramp_phase_moves_lengths_and_rate_gradually(scenarios_dir: Path) -> None:
    drift = scenario_load(scenarios_dir / "drift.yaml")
    workload = workload_build(drift, rate_per_s=None, seed=2, duration_s=21_600)
    arrivals = np.array([r.arrival_s for r in workload.requests])
    logs = np.log([r.input_tokens for r in workload.requests])
    hour = [logs[(arrivals >= h * 3600) & (arrivals < (h + 1) * 3600)].mean() for h in range(6)]
    # mu is 9.3 for the first hour, ramps to 10.2 over three hours, then stays.
    assert hour[0] < hour[1] < hour[2] < hour[3]
    assert hour[4] - hour[0] > 0.6
    last = (arrivals >= 14_400).sum() / 7200
    first = (arrivals < 3600).sum() / 3600
    assert last / first == pytest.approx(2.7 / 2.6, rel=0.06)


def test_origins_receive_their_shares(scenarios_dir: Path) -> None:
    two = scenario_load(scenarios_dir / "two-pd-clusters.yaml")
    workload = workload_build(two, rate_per_s=3.0, seed=3, requests=10_000)
    east = sum(1 for r in workload.requests if r.origin == "pd-east") / 10_000
    assert east == pytest.approx(0.6, abs=0.015)


RATE_EVENT = """
version: 1
name: surge
extends: {base}
workload:
  origins: {{pd-east: 0.5, pd-south: 0.5}}
events:
  - {{at_s: 1000, cluster: pd-south, rate_scale: 3.0}}
"""


def test_a_rate_event_scales_one_origins_traffic_from_its_time(
    write_scenario: Callable[..., Path], scenarios_dir: Path
) -> None:
    scenario = scenario_load(
        write_scenario(RATE_EVENT.format(base=scenarios_dir / "two-pd-clusters.yaml"))
    )
    workload = workload_build(scenario, rate_per_s=2.0, seed=5, duration_s=2000)
    before = [r for r in workload.requests if r.arrival_s < 1000]
    after = [r for r in workload.requests if r.arrival_s >= 1000]
    assert len(before) == pytest.approx(2000, rel=0.08)
    assert len(after) == pytest.approx(4000, rel=0.08)
    south_after = sum(1 for r in after if r.origin == "pd-south") / len(after)
    assert south_after == pytest.approx(0.75, abs=0.03)


def test_prefix_hit_fraction_marks_whole_cached_blocks_in_the_origin(
    write_scenario: Callable[..., Path], scenarios_dir: Path
) -> None:
    path = write_scenario(
        f"version: 1\nname: hits\nextends: {scenarios_dir / 'paper-case-study.yaml'}\n"
        "workload:\n  prefix_hit_fraction: 0.5\n"
    )
    workload = workload_build(scenario_load(path), rate_per_s=1.0, seed=1, requests=2000)
    cached = np.array([r.cached_tokens for r in workload.requests])
    prompts = np.array([r.input_tokens for r in workload.requests])
    assert (cached % 512 == 0).all()
    assert (cached <= prompts / 2).all()
    assert cached.sum() / prompts.sum() == pytest.approx(0.5, abs=0.02)


def test_a_poisson_workload_without_any_rate_is_refused(
    write_scenario: Callable[..., Path], case_study: Scenario
) -> None:
    with pytest.raises(WorkloadError, match="arrival rate is needed"):
        workload_build(case_study, rate_per_s=None, seed=1, requests=10)
    with pytest.raises(WorkloadError, match="arrival rate is needed"):
        workload_build(case_study, rate_per_s=-1.0, seed=1, requests=10)


def test_a_trace_replays_faster_with_a_higher_rate(scenarios_dir: Path) -> None:
    mooncake = scenario_load(scenarios_dir / "mooncake-conversation.yaml")
    natural = workload_build(mooncake, rate_per_s=None, seed=1, requests=3000)
    doubled = workload_build(
        mooncake, rate_per_s=2 * natural.base_rate_per_s, seed=1, requests=3000
    )
    assert doubled.requests[-1].arrival_s == pytest.approx(natural.requests[-1].arrival_s / 2)
    assert natural.requests[0].hash_ids is not None
    # De-quantised: the ten-odd requests of a 3 s bucket no longer share one timestamp.
    stamps = [r.arrival_s for r in natural.requests[:50]]
    assert len(set(stamps)) == 50
