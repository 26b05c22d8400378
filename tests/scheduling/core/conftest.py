"""Fixtures of the core's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduling.core.performance import LengthDistribution
from scheduling.core.planner import FleetSpec, fleet_from_scenario, workload_lengths
from scheduling.core.scenario import scenario_load


@pytest.fixture(scope="module")
def case(scenarios_dir: Path) -> tuple[FleetSpec, LengthDistribution, float]:
    """The case study as the planner takes it: its fleet, prompt lengths and output tokens."""
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    lengths, out = workload_lengths(scenario)
    return fleet_from_scenario(scenario), lengths, out
