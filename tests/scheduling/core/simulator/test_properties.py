"""Invariants of any run on random small fleets (hypothesis, a modest number of examples)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from scheduling.core.planner import PlanResult
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.simulator.policies import (
    POLICIES,
    PolicyError,
    fleet_as_configured,
    fleet_plan,
)
from scheduling.core.simulator.routing import FleetPlan, RouterDispatcher
from scheduling.core.simulator.run import SimulationConfig, simulate

FLEET = """
version: 1
name: random-fleet
model:
  name: m
  block_tokens: 512
  kv_cache_mib: [[1024, 190.8], [8192, 308.9], [32768, 701.3], [131072, 2316.3]]
accelerators:
  - {{name: H200, gpu_hour_cost: 2.0}}
  - {{name: H20, gpu_hour_cost: 1.0}}
profiles:
  - accelerator: H200
    gpus_per_instance: 8
    prefill_seconds: [[1024, 0.44], [8192, 0.72], [32768, 1.84], [131072, 7.40]]
  - accelerator: H20
    gpus_per_instance: 8
    prefill_seconds: [[1024, 0.603], [16384, 2.679], [131072, 22.565]]
    decode: {{max_batch: {batch}, step_seconds: 0.025}}
clusters:
  - {{name: prfaas, kind: prfaas, site: a, accelerator: H200, prefill_instances: {n_prfaas}}}
  - {{name: pd, kind: pd, site: b, accelerator: H20, prefill_instances: {n_p}, decode_instances: {n_d}}}
links:
  - {{source: prfaas, target: pd, gbps: {gbps:.4f}, rtt_ms: {rtt:.4f}}}
workload:
  arrival: {{process: poisson, rate_per_s: {rate:.4f}}}
  input_tokens: {{distribution: lognormal, mu: 9.5, sigma: 1.0, min: 128, max: 131072}}
  output_tokens: {{distribution: fixed, value: {output}}}
events:
  - {{at_s: {cut:.4f}, link: "prfaas->pd", gbps: {low:.4f}}}
  - {{at_s: {fail:.4f}, instance: prfaas-0, state: down}}
  - {{at_s: {back:.4f}, instance: prfaas-0, state: active}}
"""


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    # No "explain" phase: it traces every line of a failing run, far too slow for a simulation.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(
    n_prfaas=st.integers(1, 3),
    n_p=st.integers(1, 3),
    n_d=st.integers(1, 3),
    batch=st.integers(1, 16),
    gbps=st.floats(1.0, 100.0),
    low=st.floats(0.0, 10.0),
    rtt=st.floats(0.0, 50.0),
    rate=st.floats(0.05, 2.0),
    output=st.integers(1, 600),
    threshold=st.integers(0, 60_000),
    cut=st.floats(0.0, 300.0),
    fail=st.floats(0.0, 300.0),
    seed=st.integers(0, 1000),
)
def test_every_run_accounts_for_every_request_and_every_byte(
    tmp_path: Path,
    n_prfaas: int,
    n_p: int,
    n_d: int,
    batch: int,
    gbps: float,
    low: float,
    rtt: float,
    rate: float,
    output: int,
    threshold: int,
    cut: float,
    fail: float,
    seed: int,
) -> None:
    path = tmp_path / f"fleet-{seed}.yaml"
    path.write_text(
        FLEET.format(
            n_prfaas=n_prfaas,
            n_p=n_p,
            n_d=n_d,
            batch=batch,
            gbps=gbps,
            low=low,
            rtt=rtt,
            rate=rate,
            output=output,
            cut=cut,
            fail=fail,
            back=fail + 120,
        ),
        encoding="utf-8",
    )
    scenario = scenario_load(path)
    result = simulate(
        scenario,
        SimulationConfig(requests=300, seed=seed),
        fleet=fleet_as_configured(scenario, threshold=threshold),
        keep_requests=True,
    )
    assert result.finished + result.dropped == result.requests == 300
    (link,) = result.links
    assert link.sent_bytes == pytest.approx(
        link.delivered_bytes + link.aborted_bytes, rel=1e-9, abs=1.0
    )
    for r in result.per_request:
        if r.dropped:
            continue
        assert r.arrival_s <= r.prefill_start_s <= r.prefill_end_s <= r.kv_ready_s
        assert r.kv_ready_s <= r.first_token_s <= r.finish_s
        assert r.prefill_end_s - r.prefill_start_s == pytest.approx(r.service_s)
        assert r.finish_s - r.first_token_s == pytest.approx(r.output_tokens * 0.025)
        if r.route == "prfaas":
            # Layer-wise pipelining never lets the KV land before its prefill ends plus one RTT.
            assert r.kv_ready_s >= r.prefill_end_s + scenario.links[0].rtt_ms / 1000.0 - 1e-9
        else:
            assert r.kv_ready_s == r.prefill_end_s
    assert not math.isnan(result.ttft.mean)


def test_an_unknown_policy_is_refused(case_study: Scenario, case_study_plan: PlanResult) -> None:
    with pytest.raises(PolicyError, match="unknown policy 'fastest'"):
        fleet_plan(case_study, "fastest", case_study_plan)
    assert "prfaas-dual" in POLICIES


def test_an_unknown_routing_length_is_refused(case_study: Scenario) -> None:
    fleet: FleetPlan = fleet_as_configured(case_study, threshold=1000)
    with pytest.raises(ValueError, match="routing_length must be one of"):
        RouterDispatcher(None, fleet, None, routing_length="tokens")  # type: ignore[arg-type]
