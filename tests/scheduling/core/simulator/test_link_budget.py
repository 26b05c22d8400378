"""The simulated router sees what the server's router sees (issue 12): a link's bytes are
reserved from the decision, so a request queued for its PrfaaS prefill already holds them,
and released when its transfer lands; a decode instance's load counts the requests already
routed to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from scheduling.core.scenario import scenario_load
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate
from scheduling.core.simulator.workload import RequestSpec, Workload

# Every prefill makes 1000 MiB of KV; the link's budget holds two of them.
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
  - {{source: prfaas, target: pd, gbps: 10, rtt_ms: 0, kv_budget_mib: 2100}}
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
) -> SimulationResult:
    scenario = scenario_load(write_scenario(FLEET.format(local_s=local_s, batch=batch)))
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
