"""Simulator throughput: 100,000 requests on the paper's case-study fleet (issue 5, item 6).

Runs the ``prfaas`` configuration at 80% of the planner's Lambda_max through the real router,
then the same workload on the same engine with a bare dispatcher (threshold on prompt length,
round-robin instances, no live state, no router call) to show what routing costs. Prints
simulated requests per wall-second for both and their ratio. Target: the full run within 60 s
on one core. Measures; does not gate.

    python bench/simulator.py [--requests 100000] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core.planner import plan_scenario  # noqa: E402
from scheduling.core.scenario import scenario_load  # noqa: E402
from scheduling.core.simulator.engine import Assignment, Simulation  # noqa: E402
from scheduling.core.simulator.fleet import ACTIVE, SimRequest  # noqa: E402
from scheduling.core.simulator.policies import fleet_plan  # noqa: E402
from scheduling.core.simulator.run import SimulationConfig, simulate, simulation_build  # noqa: E402
from scheduling.core.simulator.workload import workload_build  # noqa: E402


class BareDispatcher:
    """The least a dispatcher can do: static threshold on prompt length, round robin."""

    tick_s: float | None = None

    def __init__(self, threshold: float, kv_bytes_of: object) -> None:
        self.threshold = threshold
        self.kv_bytes_of = kv_bytes_of
        self.turn = 0

    def assign(self, sim: Simulation, request: SimRequest) -> Assignment | None:
        self.turn += 1
        offload = request.input_tokens > self.threshold
        kind = "prfaas" if offload else "pd"
        pool = [p for p in sim.prefill_instances if p.kind == kind and p.state == ACTIVE]
        decodes = [d for d in sim.decode_instances if d.state == ACTIVE]
        prefill = pool[self.turn % len(pool)]
        decode = decodes[self.turn % len(decodes)]
        link = sim.link_between.get((prefill.cluster, decode.cluster)) if offload else None
        kv = float(self.kv_bytes_of(request.input_tokens)) if offload else 0.0  # type: ignore[operator]
        return Assignment(
            "prfaas" if offload else "local", prefill, decode, 0, link=link, kv_bytes=kv
        )

    def tick(self, sim: Simulation) -> None:
        return None

    def fleet_changed(self, sim: Simulation) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    scenario = scenario_load(ROOT / "scenarios" / "paper-case-study.yaml")
    plan = plan_scenario(scenario)
    fleet = fleet_plan(scenario, "prfaas", plan)
    rate = 0.8 * plan.prfaas.throughput_rps
    config = SimulationConfig(
        policy="prfaas", rate_per_s=rate, requests=args.requests, seed=args.seed
    )
    workload = workload_build(scenario, rate_per_s=rate, seed=args.seed, requests=args.requests)

    started = time.perf_counter()
    result = simulate(scenario, config, fleet=fleet, workload=workload)
    full_s = time.perf_counter() - started

    sim, dispatcher = simulation_build(scenario, fleet, workload, config)
    threshold = next(iter(fleet.thresholds.values()), math.inf)
    sim.dispatcher = BareDispatcher(threshold, dispatcher.topology.kv_bytes)
    started = time.perf_counter()
    sim.run()
    bare_s = time.perf_counter() - started

    n = args.requests
    print(f"case study, prfaas at {rate:.2f} req/s (80% of the planner's Lambda_max), {n} requests")
    print(
        f"  full simulation (router per request): {full_s:6.2f} s  {n / full_s:9.0f} requests/s  "
        f"(target: <= 60 s)"
    )
    print(f"  bare event loop (no router):          {bare_s:6.2f} s  {n / bare_s:9.0f} requests/s")
    print(f"  ratio full / bare wall time:          {full_s / bare_s:6.2f}")
    print(
        f"  simulated: {result.duration_s:.0f} s, finished {result.finished}, "
        f"TTFT p90 {result.ttft.p90:.2f} s, offload {result.offload_fraction:.3f}, "
        f"link mean {result.link_mean_gbps:.1f} Gbps"
    )


if __name__ == "__main__":
    main()
