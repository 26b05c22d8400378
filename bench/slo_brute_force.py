"""Goodput planning against an independent brute force over the simulator (issue 28, item 3).

For each scenario (default: every one in ``scenarios/`` whose workload is a length
distribution) and a P90 TTFT target (default 15 s):

1. ``plan --ttft-slo``: the planner's setting and rate (goodput);
2. the simulator at that rate and setting: sustained >= 97% and P90 within the target?
3. brute force: every cell of a grid (thresholds every 2K tokens from 2K to 64K and "never",
   every split with at least one prefill and one decode instance) is simulated, its rate found
   by bisection (sustained >= 97% and simulated P90 within the target; 4,000 requests, seed 3,
   common random numbers). With several PD clusters, one cluster at a time, the others at
   their best so far, two rounds. A cell is skipped only when a bound that holds whatever the
   link does cannot beat the best rate found: its decode slots (N_d x batch / decode time)
   and its own prefill of the requests below its threshold, which stay local in every case.
   The planner's link model is never consulted.

Acceptance: planner / brute force >= 95% and the planner's setting meets the target in the
simulator. Prints a table; the last line is one JSON object. Slow (minutes per scenario).

    python bench/slo_brute_force.py [--quick] [--slo S] [--requests N] [scenario.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from scheduling.core.fleet import lengths_of  # noqa: E402
from scheduling.core.performance import decode_rate_per_instance, prefill_seconds  # noqa: E402
from scheduling.core.planner import (  # noqa: E402
    fleet_from_scenario,
    plan_for_ttft,
    workload_lengths,
    workload_output_scv,
)
from scheduling.core.scenario import Scenario, scenario_load  # noqa: E402
from scheduling.core.simulator.policies import fleet_setting  # noqa: E402
from scheduling.core.simulator.run import SimulationConfig, simulate  # noqa: E402

SEED = 3
STEPS = 6
NEVER = 131_100.0

Setting = dict[str, tuple[float, int, int]]


class Search:
    def __init__(self, scenario: Scenario, slo: float, requests: int) -> None:
        self.scenario = scenario
        self.slo = slo
        self.requests = requests
        self.fleet = fleet_from_scenario(scenario)
        self.lengths, self.out = workload_lengths(scenario)
        self.sims = 0

    def run(self, setting: Setting, rate: float) -> tuple[float, float, float]:
        """Simulated P90, sustained share and link_congested share of decisions."""
        fleet = fleet_setting(
            self.scenario,
            {c: t for c, (t, _, _) in setting.items()},
            {c: (p, d) for c, (_, p, d) in setting.items()},
        )
        result = simulate(
            self.scenario,
            SimulationConfig(policy="prfaas", rate_per_s=rate, requests=self.requests, seed=SEED),
            fleet=fleet,
        )
        self.sims += 1
        decisions = sum(result.reasons.values()) or 1
        return (
            result.ttft.p90,
            result.sustained_fraction,
            result.reasons.get("link_congested", 0) / decisions,
        )

    def within(self, setting: Setting, rate: float) -> bool:
        p90, sustained, _ = self.run(setting, rate)
        return sustained >= 0.97 and p90 <= self.slo

    def bound(self, setting: Setting) -> float:
        """An upper bound on the rate whatever the link does: each PD cluster's decode slots,
        and its prefill of the requests at or below its threshold (never offloaded)."""
        out = math.inf
        for c in self.fleet.pd:
            if c.share <= 0:
                continue
            t, n_p, n_d = setting[c.name]
            rate = decode_rate_per_instance(c.max_batch, c.step_seconds, self.out)
            out = min(out, n_d * rate / c.share)
            x, w = lengths_of(self.lengths, c.name).nodes()
            local = float(np.dot(np.where(x <= t, w, 0.0), prefill_seconds(c.prefill, x)))
            if local > 0:
                out = min(out, n_p / (c.share * local))
        return out

    def best_rate(self, setting: Setting, floor: float) -> float:
        """The highest rate within the target for this setting if it beats ``floor`` by 1%."""
        hi = 1.02 * self.bound(setting)
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


def brute_force(search: Search, quick: bool, start: Setting) -> tuple[float, Setting]:
    best, best_setting = search.best_rate(start, 0.0), dict(start)
    clusters = [c for c in search.fleet.pd if c.share > 0]
    for _ in range(2 if len(clusters) > 1 else 1):
        for c in clusters:
            cells = [
                {**best_setting, c.name: (t, n, c.instances - n)}
                for t, n in grid(c.instances, quick)
            ]
            cells.sort(key=search.bound, reverse=True)
            for cell in cells:
                if 1.02 * search.bound(cell) <= best * 1.01:
                    break  # sorted: no later cell can beat it either
                rate = search.best_rate(cell, best)
                if rate > best:
                    best, best_setting = rate, cell
    return best, best_setting


def plannable(path: Path) -> bool:
    try:
        workload_lengths(scenario_load(path))
    except (ValueError, TypeError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*", type=Path)
    parser.add_argument("--quick", action="store_true", help="thresholds every 8K tokens")
    parser.add_argument("--slo", type=float, default=15.0, help="P90 TTFT target, seconds")
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    paths = args.scenarios or sorted((ROOT / "scenarios").glob("*.yaml"))
    rows = []
    for path in paths:
        if not plannable(path):
            print(f"{path.name}: skipped (its workload is a trace, not a length distribution)")
            continue
        scenario = scenario_load(path)
        search = Search(scenario, args.slo, args.requests)
        t0 = time.perf_counter()
        slo, ev = plan_for_ttft(
            search.fleet,
            search.lengths,
            search.out,
            args.slo,
            output_scv=workload_output_scv(scenario),
        )
        plan_s = time.perf_counter() - t0
        planned: Setting = {c.name: (c.threshold_tokens, c.n_p, c.n_d) for c in ev.clusters}
        p90, sustained, congested = search.run(planned, slo.rate_rps)
        predicted = slo.at_rate.refused_fraction if slo.at_rate else float("nan")
        t0 = time.perf_counter()
        best, best_setting = brute_force(search, args.quick, planned)
        ratio = slo.rate_rps / best if best > 0 else math.inf
        meets = sustained >= 0.97 and p90 <= args.slo
        row = {
            "scenario": scenario.name,
            "planner_rps": round(slo.rate_rps, 3),
            "planner_setting": {k: list(v) for k, v in planned.items()},
            "simulated_p90_s": round(p90, 2),
            "sustained": round(sustained, 3),
            "predicted_refused": round(predicted, 3),
            "simulated_link_congested": round(congested, 3),
            "brute_force_rps": round(best, 3),
            "brute_force_setting": {k: list(v) for k, v in best_setting.items()},
            "ratio": round(ratio, 3),
            "holds": bool(meets and ratio >= 0.95),
            "simulations": search.sims,
            "plan_s": round(plan_s, 2),
            "brute_force_s": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(
            f"{row['scenario']}: planner {row['planner_rps']} req/s at {planned} "
            f"(sim P90 {row['simulated_p90_s']} s, sustained {row['sustained']}, refused "
            f"{row['predicted_refused']} predicted / {row['simulated_link_congested']} "
            f"simulated); brute force {row['brute_force_rps']} req/s at {best_setting} "
            f"({row['simulations']} simulations, {row['brute_force_s']} s); "
            f"{row['ratio']:.1%} -> {'holds' if row['holds'] else 'DOES NOT HOLD'}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "slo_p90_s": args.slo,
                "requests": args.requests,
                "seed": SEED,
                "quick": args.quick,
                "holds": all(r["holds"] for r in rows),
                "scenarios": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
