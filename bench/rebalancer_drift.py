"""The long-term rebalancer on drifting traffic: goodput of ``prfaas-dual`` against the best
static plan of the first hour, in the simulator, on ``drift.yaml`` (six hours: prompts grow from
mu 9.3 to 10.2, then the load rises).

Prints, for a few seeds and TTFT targets, the goodput (requests per second finishing within the
TTFT target and the decode SLO) of both, their ratio, and when the rebalancer re-planned.
A second table runs ``prfaas-dual`` with the router's PrfaaS-backlog rule switched off, to
separate the long-term loop from the short-term controller. Measures; does not gate.

    python bench/rebalancer_drift.py [--seeds 1 2] [--slo 5 10 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core import routing  # noqa: E402
from scheduling.core.planner import plan_scenario  # noqa: E402
from scheduling.core.scenario import scenario_load  # noqa: E402
from scheduling.core.simulator.policies import fleet_plan  # noqa: E402
from scheduling.core.simulator.run import (  # noqa: E402
    SimulationConfig,
    result_build,
    simulate,
    simulation_build,
)
from scheduling.core.simulator.workload import workload_build  # noqa: E402

DURATION_S = 6 * 3600.0


def dual_without_backlog_rule(scenario, plan, seed: int, slo: float) -> float:
    config = SimulationConfig(
        policy="prfaas-dual", duration_s=DURATION_S, seed=seed, ttft_slo_s=slo
    )
    workload = workload_build(scenario, rate_per_s=None, seed=seed, duration_s=DURATION_S)
    fleet = fleet_plan(scenario, "prfaas-dual", plan)
    sim, dispatcher = simulation_build(scenario, fleet, workload, config)
    off = routing.RouteGuards(
        prfaas_backlog_s=1e9, prfaas_backlog_clear_s=1e9, prfaas_backlog_reject_s=1e10
    )
    dispatcher.policy = dataclasses.replace(dispatcher.policy, guards=off)
    started = time.perf_counter()
    sim.run()
    result = result_build(scenario, fleet, workload, config, sim, dispatcher, started, False)
    return result.goodput_rps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(ROOT / "scenarios" / "drift.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--slo", type=float, nargs="+", default=[5.0, 10.0, 30.0])
    args = parser.parse_args()
    scenario = scenario_load(args.scenario)
    plan = plan_scenario(scenario)  # the first phase: the best static plan of the first hour
    print(
        f"{'seed':>4} {'ttft slo s':>10} {'static rps':>10} {'dual rps':>9} {'ratio':>6}"
        f" {'dual, no backlog rule':>22} {'ratio':>6}"
    )
    for seed in args.seeds:
        for slo in args.slo:
            runs = {
                policy: simulate(
                    scenario,
                    SimulationConfig(
                        policy=policy, duration_s=DURATION_S, seed=seed, ttft_slo_s=slo
                    ),
                    plan=plan,
                )
                for policy in ("prfaas", "prfaas-dual")
            }
            static, dual = runs["prfaas"].goodput_rps, runs["prfaas-dual"].goodput_rps
            free = dual_without_backlog_rule(scenario, plan, seed, slo)
            print(
                f"{seed:>4} {slo:>10.0f} {static:>10.3f} {dual:>9.3f} {dual / static:>6.2f}"
                f" {free:>22.3f} {free / static:>6.2f}"
            )
        replans = runs["prfaas-dual"].replans
        print(
            "     re-plans (time s, threshold, n_p/n_d):",
            ", ".join(f"{t:.0f}: {thr:.0f} {p}/{d}" for t, _, thr, p, d in replans),
        )


if __name__ == "__main__":
    main()
