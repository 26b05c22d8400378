"""Goodput planning against a brute-force search over the simulator (issue 12, acceptance 3).

For the case study and two-pd-clusters with a 10 s P90 TTFT target:

1. ``plan --ttft-slo 10``: the planner's setting and rate (goodput);
2. the simulator at that rate and setting (6,000 requests, seed 3): is the P90 within 10 s?
3. brute force over the simulator: for every setting of a grid (thresholds every 2K tokens
   from 2K to 64K and "never", every split), the highest rate whose simulated P90 is within
   10 s, by bisection (the same 6,000 requests, seed 3, common random numbers); with several PD
   clusters, one cluster at a time, the others at their best so far, two rounds. A setting is
   skipped when even 1.05 x its fluid Lambda_max cannot beat the best rate found, or when it
   misses the target at 1.01 x that best rate already (it cannot beat it by 1%).

Acceptance: the simulated P90 at the planner's rate is within the target, and the planner's
rate is at least 95% of the brute-force best. Prints the table and the verdict; measures, does
not gate. Slow (minutes): every probe is a 6,000-request simulation.

    python bench/slo_brute_force.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core.planner import (  # noqa: E402
    evaluate,
    fleet_from_scenario,
    plan_for_ttft,
    workload_lengths,
    workload_output_scv,
)
from scheduling.core.scenario import Scenario, scenario_load  # noqa: E402
from scheduling.core.simulator.policies import fleet_setting  # noqa: E402
from scheduling.core.simulator.run import SimulationConfig, simulate  # noqa: E402

SLO_S = 10.0
REQUESTS = 6000
SEED = 3
STEPS = 7
NEVER = 131_100.0

Setting = dict[str, tuple[float, int, int]]


def p90(scenario: Scenario, setting: Setting, rate: float) -> float:
    fleet = fleet_setting(
        scenario,
        {c: t for c, (t, _, _) in setting.items()},
        {c: (p, d) for c, (_, p, d) in setting.items()},
    )
    run = simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=rate, requests=REQUESTS, seed=SEED),
        fleet=fleet,
    )
    ok = run.sustained_fraction >= 0.97
    return run.ttft.p90 if ok else float("inf")


class Search:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.fleet = fleet_from_scenario(scenario)
        self.lengths, self.out = workload_lengths(scenario)
        self.sims = 0

    def fluid(self, setting: Setting) -> float:
        try:
            ev = evaluate(
                self.fleet,
                self.lengths,
                self.out,
                {c: t for c, (t, _, _) in setting.items()},
                {c: p for c, (_, p, _) in setting.items()},
                with_ttft=False,
            )
        except ValueError:
            return 0.0
        return ev.throughput_rps

    def within(self, setting: Setting, rate: float) -> bool:
        self.sims += 1
        return p90(self.scenario, setting, rate) <= SLO_S

    def best_rate(self, setting: Setting, floor: float) -> float:
        """The highest rate within the target for this setting, if at least 1% above
        ``floor`` (a setting that cannot beat the best by that much is not refined)."""
        hi = 1.05 * self.fluid(setting)
        lo = floor * 1.01
        if hi <= lo:
            return 0.0
        if lo > 0 and not self.within(setting, lo):
            return 0.0
        if lo == 0:
            lo = 0.3 * hi
            if not self.within(setting, lo):
                return 0.0
        for _ in range(STEPS):
            mid = (lo + hi) / 2
            if self.within(setting, mid):
                lo = mid
            else:
                hi = mid
        return lo


def grid(instances: int, quick: bool) -> list[tuple[float, int]]:
    step = 8000 if quick else 2000
    thresholds = [float(t) for t in range(2000, 64001, step)] + [NEVER]
    return [(t, n) for t in thresholds for n in range(1, instances)]


def brute_force(scenario: Scenario, quick: bool, start: Setting) -> tuple[float, Setting, int]:
    search = Search(scenario)
    best, best_setting = search.best_rate(start, 0.0), dict(start)
    clusters = [c for c in scenario.pd_clusters]
    for _ in range(2 if len(clusters) > 1 else 1):
        for c in clusters:
            cells = [
                {**best_setting, c.name: (t, n, c.instances - n)}
                for t, n in grid(c.instances, quick)
            ]
            cells.sort(key=search.fluid, reverse=True)
            for cell in cells:
                if 1.05 * search.fluid(cell) <= best:
                    break  # sorted: no later cell can beat it either
                rate = search.best_rate(cell, best)
                if rate > best:
                    best, best_setting = rate, cell
                    print(f"  {scenario.name}: {best:.3f} req/s at {best_setting}", flush=True)
    return best, best_setting, search.sims


def main() -> None:
    quick = "--quick" in sys.argv
    folder = ROOT / "scenarios"
    rows = []
    for name in ("paper-case-study", "two-pd-clusters"):
        scenario = scenario_load(folder / f"{name}.yaml")
        fleet = fleet_from_scenario(scenario)
        lengths, out = workload_lengths(scenario)
        t0 = time.perf_counter()
        slo, ev = plan_for_ttft(
            fleet, lengths, out, SLO_S, output_scv=workload_output_scv(scenario)
        )
        plan_s = time.perf_counter() - t0
        planned: Setting = {c.name: (c.threshold_tokens, c.n_p, c.n_d) for c in ev.clusters}
        sim_p90 = p90(scenario, planned, slo.rate_rps)
        t0 = time.perf_counter()
        best, best_setting, sims = brute_force(scenario, quick, planned)
        bf_s = time.perf_counter() - t0
        rows.append((name, slo, planned, sim_p90, best, best_setting, sims, plan_s, bf_s))
    print(f"TTFT target: P90 <= {SLO_S:g} s; simulations of {REQUESTS} requests, seed {SEED}")
    ok_all = True
    for name, slo, planned, sim_p90, best, best_setting, sims, plan_s, bf_s in rows:
        ratio = slo.rate_rps / best if best > 0 else float("inf")
        ok = sim_p90 <= SLO_S and ratio >= 0.95
        ok_all &= ok
        print(f"\n{name}:")
        print(
            f"  planner: {slo.rate_rps:.3f} req/s at {planned} (predicted P90 "
            f"{slo.at_rate.ttft_p90_s if slo.at_rate else float('nan'):.2f} s; {plan_s:.1f} s to plan)"
        )
        print(f"  simulated P90 at the planner's rate: {sim_p90:.2f} s")
        print(
            f"  brute force: {best:.3f} req/s at {best_setting} ({sims} simulations, {bf_s:.0f} s)"
        )
        print(f"  planner / brute force: {ratio:.1%} -> {'holds' if ok else 'DOES NOT HOLD'}")
    print(f"\nacceptance 3: {'holds' if ok_all else 'does not hold'}")


if __name__ == "__main__":
    main()
