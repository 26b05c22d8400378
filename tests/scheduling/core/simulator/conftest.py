"""Small scenarios for the simulator tests, written next to each test's tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from scheduling.core.planner import PlanResult, plan_scenario
from scheduling.core.scenario import Scenario, scenario_load

ONE_INSTANCE = """
version: 1
name: one-instance
model:
  name: m
  block_tokens: 512
  kv_cache_mib: [[1024, 190.8], [131072, 2316.3]]
accelerators:
  - {{name: X, gpu_hour_cost: 1.0}}
profiles:
  - accelerator: X
    gpus_per_instance: 8
    prefill_seconds: [[1024, {service}], [131072, {service}]]
    decode: {{max_batch: 100000, step_seconds: 0.000001}}
clusters:
  - {{name: pd, kind: pd, site: s, accelerator: X, prefill_instances: 1, decode_instances: 1}}
workload:
  arrival: {{process: poisson, rate_per_s: {rate}}}
  input_tokens: {{distribution: fixed, value: 8192}}
  output_tokens: {{distribution: fixed, value: 1}}
"""


@pytest.fixture
def write_scenario(tmp_path: Path) -> Callable[..., Path]:
    def write(text: str, name: str = "scenario.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture(scope="session")
def case_study(scenarios_dir: Path) -> Scenario:
    return scenario_load(scenarios_dir / "paper-case-study.yaml")


@pytest.fixture(scope="session")
def case_study_plan(case_study: Scenario) -> PlanResult:
    return plan_scenario(case_study)
