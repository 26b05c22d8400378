"""Plans that hold (issue 12, acceptance 1), as a table: for each scenario, the planner's
``at_load`` prediction at 80% of its capacity against the simulator at that rate (6,000
requests, or a whole trace, seed 3), with the acceptance verdict. The test ``tests/scheduling/core/
test_agreement.py`` asserts the same on the same scenarios; this prints the numbers.

``--slo S``: the same at the planned *goodput* rate (issue 28, item 4): ``plan --ttft-slo S``'s
setting simulated at its rate, 16,000 requests for each of five seeds, pooled (a trace replayed
whole, once); each seed's P90 is printed beside the pooled one.

    python bench/agreement.py [--slo S] [SCENARIO.yaml ...]

Without arguments: every scenario of ``scenarios/`` with a PrfaaS cluster, and those of
``tests/scheduling/scenarios`` (thin links, heavy and dense KV, several PD clusters).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core.scenario import scenario_load  # noqa: E402
from scheduling.core.simulator.agreement import (  # noqa: E402
    agreement_check,
    goodput_agreement_check,
)

OWN = ROOT / "tests" / "scheduling" / "scenarios"


def default_paths() -> list[Path]:
    shipped = sorted((ROOT / "scenarios").glob("*.yaml"))
    own = sorted(p for p in OWN.glob("*.yaml") if p.stem != "fleet-base")
    return [p for p in shipped + own if scenario_load(p).prfaas_clusters]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slo", type=float, help="check at the goodput rate for this P90 (s)")
    parser.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args()
    if args.slo is not None and not (0 < args.slo <= 3600):
        parser.error(f"--slo: must be within (0, 3600] seconds, got {args.slo:g}")
    paths = args.paths or default_paths()
    header = (
        f"{'scenario':24s} {'capacity':>8s} {'rate':>6s} {'sustained':>9s} {'thr/off':>7s} "
        f"{'P90 pred':>8s} {'P90 sim':>7s} {'ratio':>5s} {'mean pred':>9s} {'mean sim':>8s} "
        f"{'lc pred':>7s} {'lc sim':>6s} {'link':>5s}  verdict"
    )
    print(header)
    held = 0
    started = time.perf_counter()
    for path in paths:
        scenario = scenario_load(path)
        extra = ""
        if args.slo is None:
            row, _ = agreement_check(scenario)
        else:
            checked = goodput_agreement_check(scenario, args.slo)
            row = checked.agreement
            seeds = ", ".join(f"{p:.2f}" for p in checked.seed_p90_s)
            extra = f"  setting {checked.setting}; P90 by seed {seeds}"
        held += row.holds
        print(
            f"{row.scenario:24s} {row.capacity_rps:8.3f} {row.rate_rps:6.3f} "
            f"{row.sustained_fraction:9.1%} {row.throughput_fraction:7.1%} "
            f"{row.predicted_ttft_p90_s:8.2f} {row.ttft_p90_s:7.2f} {row.p90_ratio:5.2f} "
            f"{row.predicted_ttft_mean_s:9.2f} {row.ttft_mean_s:8.2f} "
            f"{row.predicted_link_congested:7.2%} {row.link_congested:6.2%} "
            f"{row.predicted_link_utilisation:5.0%}  {'holds' if row.holds else 'DOES NOT HOLD'}"
            f"{extra}",
            flush=True,
        )
    print(
        f"\n{held}/{len(paths)} hold (sustained >= 97%, P90 within [0.67, 1.5]x, "
        f"link_congested predicted within 5 points); {time.perf_counter() - started:.0f} s"
    )
    print(
        "sustained: completions per second while arrivals last, after the first tenth; "
        "thr/off: throughput over the whole run (drain included) / offered"
        + ("; goodput runs: the lowest of the seeds, P90 and means pooled" if args.slo else "")
    )


if __name__ == "__main__":
    main()
