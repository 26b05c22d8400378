"""A trace as the planner plans it: the uncached lengths its replay through the fleet's prefix
caches leaves, and its windows (a trace's mix drifts as it is replayed; issue 28, item 4)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scheduling.core.operating import WorkloadWindow, operating_point, operating_windows
from scheduling.core.planner import (
    evaluation_settings,
    fleet_from_scenario,
    plan_for_ttft,
    plan_workload,
)
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.scenario_fleet import TRACE_WINDOW_MIN_REQUESTS, trace_rows, workload_planned
from scheduling.core.simulator.run import SimulationConfig, simulate


def _with_trace(scenario: Scenario, path: Path) -> Scenario:
    assert scenario.workload is not None and scenario.workload.trace is not None
    trace = replace(scenario.workload.trace, path=path, dequantize="none")
    return replace(scenario, workload=replace(scenario.workload, trace=trace))


def _drifting(scenarios_dir: Path, tmp_path: Path, long_output: int, short_output: int) -> Scenario:
    """The synthetic trace's fleet replaying :func:`_drifting_trace` (two windows)."""
    path = _drifting_trace(tmp_path, 2 * TRACE_WINDOW_MIN_REQUESTS, long_output, short_output)
    return _with_trace(scenario_load(scenarios_dir / "mooncake-synthetic.yaml"), path)


def _drifting_trace(tmp_path: Path, rows: int, long_output: int, short_output: int) -> Path:
    """One request a second, no shared prefixes; the first half decodes long outputs."""
    path = tmp_path / "drift.jsonl"
    with path.open("w") as fh:
        for k in range(rows):
            fh.write(
                json.dumps(
                    {
                        "timestamp": 1000 * k,
                        "input_length": 4096,
                        "output_length": long_output if k < rows // 2 else short_output,
                        "hash_ids": [10 * k + b for b in range(8)],
                    }
                )
                + "\n"
            )
    return path


def test_a_trace_is_planned_from_what_the_simulated_caches_leave(scenarios_dir: Path) -> None:
    scenario = scenario_load(scenarios_dir / "mooncake-synthetic.yaml")
    planned = workload_planned(scenario)
    prompts = np.array([row.input_tokens for row in trace_rows(scenario)], dtype=float)
    # Mostly cached prefixes: the plan's uncached lengths are about half the prompts.
    assert planned.lengths.mean < 0.6 * prompts.mean()
    result = simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=2.0, seed=3),
        keep_requests=True,
    )
    simulated = np.mean([r.incremental_tokens for r in result.per_request])
    assert planned.lengths.mean == pytest.approx(simulated, rel=0.05)


def test_a_trace_is_cut_in_windows_that_follow_its_drift(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    scenario = _drifting(scenarios_dir, tmp_path, long_output=400, short_output=50)
    planned = workload_planned(scenario)
    assert [w.share for w in planned.windows] == [0.5, 0.5]
    assert [w.output_tokens for w in planned.windows] == [400, 50]
    assert planned.output_tokens == pytest.approx(225)
    assert all(w.rate_factor == pytest.approx(1.0, rel=0.01) for w in planned.windows)
    # Nothing is shared: every prompt is planned whole.
    assert planned.lengths.mean == pytest.approx(4096, abs=16)


def test_the_heaviest_window_bounds_a_traces_planned_rate(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    scenario = _drifting(scenarios_dir, tmp_path, long_output=2000, short_output=20)
    fleet = fleet_from_scenario(scenario)
    planned = workload_planned(scenario)
    result = plan_workload(fleet, planned, load=0.8)
    assert result.window_capacity_rps is not None and result.at_load is not None
    # The long-output half needs more decode than the mix: it sets the trace's rate.
    assert result.window_capacity_rps < 0.8 * result.prfaas.throughput_rps
    assert result.at_load.rate_rps == pytest.approx(0.8 * result.window_capacity_rps)
    assert result.at_load.stable
    # Planned as one steady mix, the same rate would look easier than it is.
    ts, ns = evaluation_settings(result.prfaas)
    mixed = operating_point(
        fleet,
        planned.lengths,
        planned.output_tokens,
        ts,
        ns,
        result.at_load.rate_rps,
        output_scv=planned.output_scv,
    )
    assert mixed.ttft_p90_s < result.at_load.ttft_p90_s


def test_a_traces_goodput_is_judged_window_by_window(scenarios_dir: Path, tmp_path: Path) -> None:
    scenario = _drifting(scenarios_dir, tmp_path, long_output=2000, short_output=20)
    fleet = fleet_from_scenario(scenario)
    planned = workload_planned(scenario)
    mixed, _ = plan_for_ttft(fleet, planned.lengths, planned.output_tokens, 15.0)
    windowed, _ = plan_for_ttft(
        fleet, planned.lengths, planned.output_tokens, 15.0, windows=planned.windows
    )
    capacity = plan_workload(fleet, planned).window_capacity_rps
    assert capacity is not None
    # The long-output half bounds the goodput; planned as one mix it would overload it.
    assert windowed.rate_rps <= capacity < mixed.rate_rps
    assert windowed.at_rate is not None and windowed.at_rate.ttft_p90_s <= 15.0


def test_one_window_of_the_whole_workload_is_its_operating_point(scenarios_dir: Path) -> None:
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    fleet = fleet_from_scenario(scenario)
    planned = workload_planned(scenario)
    result = plan_workload(fleet, planned, load=0.8)
    assert planned.windows == () and result.window_capacity_rps is None
    assert result.at_load is not None
    ts, ns = evaluation_settings(result.prfaas)
    whole = WorkloadWindow(1.0, 1.0, planned.lengths, planned.output_tokens, planned.output_scv)
    windowed = operating_windows(fleet, (whole, whole), ts, ns, result.at_load.rate_rps)
    assert windowed.ttft_p90_s == pytest.approx(result.at_load.ttft_p90_s, rel=1e-3)
    assert windowed.ttft_mean_s == pytest.approx(result.at_load.ttft_mean_s, rel=1e-3)
    assert windowed.refused_fraction == pytest.approx(result.at_load.refused_fraction)


def test_a_short_window_has_not_built_its_steady_queue(scenarios_dir: Path) -> None:
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    fleet = fleet_from_scenario(scenario)
    planned = workload_planned(scenario)
    result = plan_workload(fleet, planned, load=0.95)
    assert result.at_load is not None
    ts, ns = evaluation_settings(result.prfaas)
    rate = result.at_load.rate_rps
    lasting = WorkloadWindow(1.0, 1.0, planned.lengths, planned.output_tokens, planned.output_scv)

    def p90(requests: int) -> float:
        window = replace(lasting, requests=requests)
        return operating_windows(fleet, (window,), ts, ns, rate).ttft_p90_s

    # 300 requests from an empty fleet wait less than the steady state; a long stretch as much.
    assert p90(300) < 0.9 * result.at_load.ttft_p90_s
    assert p90(10_000_000) == pytest.approx(result.at_load.ttft_p90_s, rel=0.01)
    # A second window starts from the backlog the first left, so it waits longer than alone.
    short = replace(lasting, share=0.5, requests=300)
    two = operating_windows(fleet, (short, short), ts, ns, rate).ttft_p90_s
    assert p90(300) < two < result.at_load.ttft_p90_s


def test_a_traces_windows_count_its_requests(scenarios_dir: Path) -> None:
    scenario = scenario_load(scenarios_dir / "mooncake-synthetic.yaml")
    planned = workload_planned(scenario)
    assert sum(w.requests for w in planned.windows) == len(trace_rows(scenario))
