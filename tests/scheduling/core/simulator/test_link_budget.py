"""The simulated router sees what the server's router sees (issue 12): a link's bytes are
reserved from the decision, so a request queued for its PrfaaS prefill already holds them,
and released when its transfer lands; a decode instance's load counts the requests already
routed to it. A request bigger than the budget is offloaded only alone on an idle link, and the
planner predicts the refusals that rule makes (issue 28, item 2)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from scheduling.core.operating import operating_point
from scheduling.core.planner import fleet_from_scenario, workload_lengths
from scheduling.core.scenario import scenario_load
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate
from scheduling.core.simulator.workload import RequestSpec, Workload

# Every prefill makes 1000 MiB of KV; the link's budget (2100 MiB unless a test says) holds two.
FLEET = """
version: 1
name: budget
model:
  name: m
  block_tokens: 512
  kv_cache_mib: [[1024, 1000], [131072, 1000]]
accelerators:
  - {{name: FAST, gpu_hour_cost: 2.0}}
  - {{name: SLOW, gpu_hour_cost: 1.0}}
profiles:
  - {{accelerator: FAST, gpus_per_instance: 8, prefill_seconds: [[1024, 10.0], [131072, 10.0]]}}
  - accelerator: SLOW
    gpus_per_instance: 8
    prefill_seconds: [[1024, {local_s}], [131072, {local_s}]]
    decode: {{max_batch: {batch}, step_seconds: 0.001}}
clusters:
  - {{name: prfaas, kind: prfaas, site: a, accelerator: FAST, prefill_instances: 1}}
  - {{name: pd, kind: pd, site: b, accelerator: SLOW, prefill_instances: 1, decode_instances: 2}}
links:
  - {{source: prfaas, target: pd, gbps: 10, rtt_ms: 0, kv_budget_mib: {budget_mib}}}
workload:
  arrival: {{process: poisson, rate_per_s: 1}}
  input_tokens: {{distribution: fixed, value: 8192}}
  output_tokens: {{distribution: fixed, value: 10}}
"""


def run(
    write_scenario: Callable[..., Path],
    arrivals: list[float],
    *,
    threshold: float = 0.0,
    local_s: float = 100.0,
    batch: int = 20,
    budget_mib: float = 2100,
) -> SimulationResult:
    scenario = scenario_load(
        write_scenario(FLEET.format(local_s=local_s, batch=batch, budget_mib=budget_mib))
    )
    workload = Workload(
        tuple(RequestSpec(t, 8192, 10, "pd") for t in arrivals), (), float(len(arrivals))
    )
    fleet = fleet_setting(scenario, {"pd": threshold}, {"pd": (1, 2)})
    return simulate(
        scenario,
        SimulationConfig(policy="prfaas"),
        fleet=fleet,
        workload=workload,
        keep_requests=True,
    )


def test_a_request_queued_for_its_prfaas_prefill_already_holds_its_bytes(
    write_scenario: Callable[..., Path],
) -> None:
    # r0 prefills at once, r1 queues behind it on the one PrfaaS instance: no byte of r1 is
    # moving yet, but its 1000 MiB are reserved, so r2's do not fit the 2100 MiB budget.
    result = run(write_scenario, [0.0, 0.1, 0.2])
    r0, r1, r2 = result.per_request
    assert (r0.route, r1.route) == ("prfaas", "prfaas")
    assert r1.prefill_start_s > 9.9  # still queued when r2 arrived
    assert (r2.route, r2.reason) == ("local", "link_congested")


def test_the_bytes_are_released_when_the_transfer_lands(
    write_scenario: Callable[..., Path],
) -> None:
    # By t = 11 r0's KV has landed (prefill 10 s, the transfer hidden behind it): room again.
    result = run(write_scenario, [0.0, 0.1, 11.0])
    r0, _, r2 = result.per_request
    assert r0.kv_ready_s < 11.0
    assert r2.route == "prfaas"


def test_requests_routed_to_a_decode_instance_count_in_its_load(
    write_scenario: Callable[..., Path],
) -> None:
    # Two requests decided while both still prefill: the first is counted on the instance it
    # was sent to, so the second goes to the other one (not both to the idle-looking first).
    result = run(write_scenario, [0.0, 0.1], threshold=1e9, local_s=5.0, batch=1)
    first, second = result.per_request
    assert first.decode_instance is not None and second.decode_instance is not None
    assert first.decode_instance.name != second.decode_instance.name


def test_a_request_bigger_than_the_budget_is_offloaded_alone_on_an_idle_link(
    write_scenario: Callable[..., Path],
) -> None:
    # A 900 MiB budget, 1000 MiB requests: r0 finds the link idle and holds it alone; r1
    # arrives while r0 prefills (its bytes reserved) and stays local; r2 comes after r0's KV
    # has landed and finds the link idle again.
    result = run(write_scenario, [0.0, 0.1, 11.0], local_s=1.0, budget_mib=900)
    r0, r1, r2 = result.per_request
    assert (r0.route, r0.kv_bytes) == ("prfaas", 1000 * 2**20)
    assert (r1.route, r1.reason) == ("local", "link_congested")
    assert r0.kv_ready_s < 11.0
    assert r2.route == "prfaas"


def test_the_planner_predicts_the_refusals_of_requests_bigger_than_the_budget(
    write_scenario: Callable[..., Path],
) -> None:
    # Every request is bigger than the budget, so the link holds one at a time for its 10 s
    # prefill: Erlang's loss formula with one server, 0.05 req/s x 10 s = 0.5 erlang, refuses
    # 1/3 of them (the old rule refused all). The simulator and the planner both say so.
    scenario = scenario_load(write_scenario(FLEET.format(local_s=1.0, batch=20, budget_mib=900)))
    rate = 0.05
    result = simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=rate, requests=3000, seed=3),
        fleet=fleet_setting(scenario, {"pd": 0.0}, {"pd": (1, 2)}),
    )
    simulated = result.reasons.get("link_congested", 0) / sum(result.reasons.values())
    assert simulated == pytest.approx(1 / 3, abs=0.03)
    lengths, output = workload_lengths(scenario)
    predicted = operating_point(
        fleet_from_scenario(scenario), lengths, output, {"pd": 0.0}, {"pd": 1}, rate
    ).refused_fraction
    assert abs(predicted - simulated) <= 0.05
