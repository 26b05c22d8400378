"""Requests bigger than a link's in-flight budget: refuse them always, or admit one alone on an
idle link? (issue 28, item 2)

The router's rule (``scheduling.core.link.link_admits``) admits a reservation bigger than the
whole budget only when nothing else is reserved on the link. This bench measures it against
the rule it replaced ("never": such a request always prefills locally) in the simulator, which
routes every request through the router. Per scenario (default: the thin-link fleets in
``scenarios/``), for the planner's goodput setting (``plan --ttft-slo``) and for the same split
with the threshold at 16K and 32K tokens:

* at the planner's rate: P90 TTFT, SLO attainment, offloaded and ``link_congested`` shares;
* the highest rate at which the P90 TTFT holds the target with >= 97% sustained (bisection,
  seed 3, common random numbers).

The "never" rule is the router's admission function with the idle-link clause removed, swapped
in for the run (a measurement only: the product has one rule). Prints a table and, last, one
JSON object.

    python bench/oversize_offloads.py [--requests N] [--slo S] [scenario.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core import link as core_link  # noqa: E402
from scheduling.core.planner import (  # noqa: E402
    fleet_from_scenario,
    plan_for_ttft,
    workload_lengths,
    workload_output_scv,
)
from scheduling.core.routing import candidates, live  # noqa: E402
from scheduling.core.scenario import Scenario, scenario_load  # noqa: E402
from scheduling.core.simulator.policies import fleet_setting  # noqa: E402
from scheduling.core.simulator.run import (  # noqa: E402
    MIN_SUSTAINED,
    SimulationConfig,
    SimulationResult,
    simulate,
)

SEED = 3
STEPS = 7
Setting = dict[str, tuple[float, int, int]]


def never(utilisation: float, inflight_bytes: float, nbytes: float, budget: float) -> bool:
    """The rule before issue 28: within the budget or not at all."""
    return utilisation < 1.0 and inflight_bytes + nbytes <= budget


@contextmanager
def rule(name: str) -> Iterator[None]:
    admits: Callable[[float, float, float, float], bool] = (
        never if name == "never" else core_link.link_admits
    )
    saved = candidates.link_admits, live.link_admits
    candidates.link_admits = live.link_admits = admits  # type: ignore[assignment]
    try:
        yield
    finally:
        candidates.link_admits, live.link_admits = saved


def run(
    scenario: Scenario, setting: Setting, rate: float, requests: int, slo: float
) -> SimulationResult:
    fleet = fleet_setting(
        scenario,
        {c: t for c, (t, _, _) in setting.items()},
        {c: (p, d) for c, (_, p, d) in setting.items()},
    )
    config = SimulationConfig(
        policy="prfaas", rate_per_s=rate, requests=requests, seed=SEED, ttft_slo_s=slo
    )
    return simulate(scenario, config, fleet=fleet)


def within(scenario: Scenario, setting: Setting, rate: float, requests: int, slo: float) -> bool:
    result = run(scenario, setting, rate, requests, slo)
    return result.sustained_fraction >= MIN_SUSTAINED and result.ttft.p90 <= slo


def goodput(scenario: Scenario, setting: Setting, hint: float, requests: int, slo: float) -> float:
    lo, hi = 0.3 * hint, 2.0 * hint
    if not within(scenario, setting, lo, requests, slo):
        return 0.0
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        if within(scenario, setting, mid, requests, slo):
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*", type=Path)
    parser.add_argument("--slo", type=float, default=15.0, help="P90 TTFT target, seconds")
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    paths = args.scenarios or sorted((ROOT / "scenarios").glob("thin-link*.yaml"))
    rows = []
    print(
        f"{'scenario':<22} {'setting':<10} {'rule':<6} {'rate':>6} {'P90 s':>7} {'att.':>6} "
        f"{'offl.':>6} {'cong.':>6} {'goodput':>8}"
    )
    for path in paths:
        scenario = scenario_load(path)
        fleet = fleet_from_scenario(scenario)
        lengths, out = workload_lengths(scenario)
        plan, ev = plan_for_ttft(
            fleet, lengths, out, args.slo, output_scv=workload_output_scv(scenario)
        )
        planned: Setting = {c.name: (c.threshold_tokens, c.n_p, c.n_d) for c in ev.clusters}
        settings = {"planned": planned}
        for t in (16000, 32000):
            settings[f"t={t // 1000}K"] = {k: (t, p, d) for k, (_, p, d) in planned.items()}
        for label, setting in settings.items():
            for name in ("never", "idle"):
                with rule(name):
                    result = run(scenario, setting, plan.rate_rps, args.requests, args.slo)
                    best = goodput(scenario, setting, plan.rate_rps, args.requests, args.slo)
                decisions = sum(result.reasons.values()) or 1
                row = {
                    "scenario": scenario.name,
                    "setting": label,
                    "thresholds_splits": {k: list(v) for k, v in setting.items()},
                    "rule": name,
                    "rate_rps": round(plan.rate_rps, 3),
                    "p90_s": round(result.ttft.p90, 2),
                    "attainment": round(result.slo_attainment, 3),
                    "offloaded": round(result.offload_fraction, 3),
                    "link_congested": round(result.reasons.get("link_congested", 0) / decisions, 3),
                    "goodput_rps": round(best, 3),
                }
                rows.append(row)
                print(
                    f"{row['scenario']:<22} {label:<10} {name:<6} {row['rate_rps']:>6.3f} "
                    f"{row['p90_s']:>7.2f} {row['attainment']:>6.3f} {row['offloaded']:>6.3f} "
                    f"{row['link_congested']:>6.3f} {row['goodput_rps']:>8.3f}",
                    flush=True,
                )
    print(json.dumps({"slo_s": args.slo, "requests": args.requests, "rows": rows}))


if __name__ == "__main__":
    main()
