"""Time a full plan of the paper's case study (optimum + three baselines + TTFT) on one core.

Standalone: sets up nothing Django. Prints times and ratios, measured in the same run:
* against one evaluation of the model at a fixed setting (what a full plan costs in
  evaluations), and
* against a naive pure-Python loop over the same threshold x split grid (what vectorising buys).
* the queue-aware path (issue 12), on its own: the search alone (``plan_fleet``, which now
  includes the links' admission), the ``at_load`` prediction (M/G/c waits, link refusals,
  TTFT quantile), and goodput planning for a 10 s P90 TTFT (``plan --ttft-slo 10``).

Budget (issues 3 and 12): a full plan, ``at_load`` included, stays under 0.5 s on one core.
This script reports it; it does not gate (benchmarks measure, CI asserts behaviour).

    python bench/planner.py [SCENARIO.yaml]
"""

from __future__ import annotations

import bisect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core.operating import operating_point  # noqa: E402
from scheduling.core.planner import (  # noqa: E402
    DEFAULT_LOAD,
    evaluate,
    fleet_from_scenario,
    plan,
    plan_fleet,
    plan_for_ttft,
    threshold_grid,
    workload_lengths,
)
from scheduling.core.scenario import LognormalDist, Scenario, scenario_load  # noqa: E402

BUDGET_S = 0.5


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def naive_grid(scenario: Scenario, thresholds: Sequence[float]) -> float:
    """The single-pair grid search written as plain Python loops (scalar math only)."""
    assert scenario.workload is not None
    dist = scenario.workload.input_tokens
    assert isinstance(dist, LognormalDist), "the naive baseline handles the log-normal case"

    def phi(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def interp(points: Sequence[tuple[float, float]], x: float) -> float:
        xs = [p[0] for p in points]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        return y0 + (x - x0) * (y1 - y0) / (x1 - x0)

    mu, s = dist.mu, dist.sigma
    za, zb = (math.log(dist.min) - mu) / s, (math.log(dist.max) - mu) / s
    mass = phi(zb) - phi(za)
    scale = math.exp(mu + s * s / 2)
    mean = scale * (phi(zb - s) - phi(za - s)) / mass
    prf = scenario.prfaas_clusters[0]
    pd = scenario.pd_clusters[0]
    t_prf = scenario.profile_for(prf.accelerator).prefill_seconds
    prof = scenario.profile_for(pd.accelerator)
    gbps = scenario.links[0].gbps
    assert prof.decode is not None
    rate = prof.decode.max_batch / (prof.decode.step_seconds * 1024)
    best = 0.0
    for t in thresholds:
        z = (math.log(min(max(t, dist.min), dist.max)) - mu) / s
        p = (phi(zb) - phi(z)) / mass
        above = scale * (phi(zb - s) - phi(z - s)) / mass
        for n_p in range(pd.instances + 1):
            bounds = [(pd.instances - n_p) * rate]
            if p > 0:
                l_long = above / p
                kv = interp(scenario.model.kv_cache_mib, l_long) * 2**20 * 8
                bounds.append(
                    min(prf.prefill_instances / interp(t_prf, l_long), gbps * 1e9 / kv) / p
                )
            if p < 1:
                l_short = (mean - above) / (1 - p)
                bounds.append(n_p / interp(prof.prefill_seconds, l_short) / (1 - p))
            best = max(best, min(bounds))
    return best


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "scenarios" / "paper-case-study.yaml"
    scenario = scenario_load(path)
    fleet = fleet_from_scenario(scenario)
    lengths, out_tokens = workload_lengths(scenario)

    full = best_of(lambda: plan(fleet, lengths, out_tokens))
    with_load = best_of(
        lambda: plan(
            *(lambda s: (fleet_from_scenario(s), *workload_lengths(s)))(scenario_load(path))
        )
    )
    result = plan(fleet, lengths, out_tokens)
    ts = {c.name: c.threshold_tokens for c in result.prfaas.clusters}
    ns = {c.name: c.n_p for c in result.prfaas.clusters}
    one = best_of(lambda: evaluate(fleet, lengths, out_tokens, ts, ns), repeat=20)
    grid = threshold_grid(lengths, 100)
    cells = len(grid) * sum(c.instances + 1 for c in fleet.pd)

    print(f"scenario: {scenario.name} ({len(grid)} thresholds x splits = {cells} cells per plan)")
    print(f"full plan (optimum + 3 baselines + TTFT): {full * 1000:.1f} ms")
    print(f"full plan including reading the file:     {with_load * 1000:.1f} ms")
    print(
        f"one evaluation at a fixed setting:        {one * 1000:.2f} ms  (plan = {full / one:.0f} evaluations)"
    )
    if (
        len(fleet.pd) == 1
        and len(fleet.prfaas) == 1
        and scenario.workload
        and isinstance(scenario.workload.input_tokens, LognormalDist)
    ):
        naive = best_of(lambda: naive_grid(scenario, list(grid)), repeat=2)
        print(
            f"naive pure-Python grid (optimum only):    {naive * 1000:.1f} ms  (x{naive / full:.1f} the full plan)"
        )
        print(
            f"naive optimum {naive_grid(scenario, list(grid)):.4f} req/s vs planner {result.prfaas.throughput_rps:.4f} req/s"
        )
    search = best_of(lambda: plan_fleet(fleet, lengths, out_tokens))
    at_load = best_of(
        lambda: operating_point(
            fleet, lengths, out_tokens, ts, ns, DEFAULT_LOAD * result.prfaas.throughput_rps
        ),
        repeat=10,
    )
    slo = best_of(lambda: plan_for_ttft(fleet, lengths, out_tokens, 10.0), repeat=1)
    print("queue-aware path:")
    print(
        f"  search alone (plan_fleet, link admission included): {search * 1000:.1f} ms "
        f"({search / one:.0f} evaluations)"
    )
    print(
        f"  at_load prediction at {DEFAULT_LOAD:.0%} of Lambda_max:       {at_load * 1000:.1f} ms "
        f"(x{at_load / one:.1f} one evaluation, {at_load / full:.0%} of the full plan)"
    )
    print(
        f"  goodput plan for a 10 s P90 TTFT (--ttft-slo 10): {slo * 1000:.0f} ms (x{slo / full:.1f} the full plan)"
    )
    verdict = "within" if full < BUDGET_S else "OVER"
    print(f"budget {BUDGET_S * 1000:.0f} ms on one core: {verdict} ({full / BUDGET_S:.2f} of it)")


if __name__ == "__main__":
    main()
