"""The planner's prefill stations against the simulator's, one by one: where a TTFT
prediction misses, whether the queue model or the load it was given is what misses.

For a scenario, plan at ``--load`` (as ``plan --load``), simulate at the planned rate with the
planned setting (as ``bench/agreement.py``), and print for each prefill station (each PD
cluster's local prefill, each PrfaaS cluster): the predicted arrival rate, mean service time,
utilisation and mean wait; the simulated ones (after a tenth of the run as warm-up); and the
M/G/c mean wait (:func:`scheduling.core.queueing.mgc_wait`, Poisson arrivals) at the
*simulated* rate and service. When the last matches the simulated wait, the queue model holds
and the prediction missed on its inputs (how much work reaches the station); when it does
not, the queue model itself misses (bursty arrivals, say). Also the routing reasons the
simulator counted. The last line is one JSON object.

    python bench/stations.py scenarios/two-pd-clusters.yaml [--load 0.8] [--requests 6000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from scheduling.core.queueing import mgc_wait  # noqa: E402
from scheduling.core.scenario import Scenario, scenario_load  # noqa: E402
from scheduling.core.simulator.agreement import plan_for  # noqa: E402
from scheduling.core.simulator.fleet import SimRequest  # noqa: E402
from scheduling.core.simulator.run import SimulationConfig, simulate  # noqa: E402


def station_of(request: SimRequest) -> tuple[str, str]:
    """(kind, cluster) of the prefill station that served ``request``."""
    instance = request.prefill_instance
    assert instance is not None
    return ("prfaas" if instance.kind == "prfaas" else "pd_prefill"), instance.cluster


def servers_of(
    scenario: Scenario, split: dict[str, tuple[int, int]], kind: str, cluster: str
) -> int:
    """The station's prefill instances in the simulated setting."""
    if kind == "pd_prefill":
        return split[cluster][0]
    return next(c.prefill_instances for c in scenario.clusters if c.name == cluster)


def simulated_station(requests: list[SimRequest], span_s: float, servers: int) -> dict[str, Any]:
    service = np.array([r.service_s for r in requests])
    # From the decision to the prefill's start (an offload whose cached prefix is moved into
    # PrfaaS first counts that transfer as waiting too).
    waits = np.array([r.prefill_start_s - r.arrival_s for r in requests])
    rate = len(requests) / span_s
    mean = float(service.mean())
    scv = float(service.var() / mean**2) if mean > 0 else 0.0
    return {
        "rate_rps": rate,
        "service_mean_s": mean,
        "utilisation": rate * mean / servers,
        "wait_mean_s": float(waits.mean()),
        "mgc_wait_mean_s": mgc_wait(rate, mean, scv, servers).mean_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    scenario = scenario_load(args.scenario)
    plan = plan_for(scenario, load=args.load)
    at = plan.at_load
    if at is None:
        sys.exit(f"{args.scenario}: the plan has no operating point at load {args.load}")
    result = simulate(
        scenario,
        SimulationConfig(
            policy="prfaas", rate_per_s=at.rate_rps, requests=args.requests, seed=args.seed
        ),
        plan=plan,
        keep_requests=True,
    )
    served = sorted(
        (r for r in result.per_request if not r.dropped and r.prefill_instance is not None),
        key=lambda r: r.arrival_s,
    )
    warm = served[len(served) // 10 :]
    span = warm[-1].arrival_s - warm[0].arrival_s
    rows = []
    print(
        f"{scenario.name}: planned rate {at.rate_rps:.3f} req/s at load {args.load}; "
        f"simulated {len(served)} requests, P90 TTFT {result.ttft.p90:.2f} s "
        f"(predicted {at.ttft_p90_s:.2f} s); reasons {result.reasons}"
    )
    print(
        f"{'station':28} {'rate':>13} {'service s':>13} {'utilisation':>13} "
        f"{'wait s':>13} {'M/G/c at sim':>12}"
    )
    for station in at.stations:
        if station.kind == "decode":
            continue
        mine = [r for r in warm if station_of(r) == (station.kind, station.name)]
        servers = servers_of(scenario, result.split, station.kind, station.name)
        predicted_service = (
            station.utilisation * servers / station.rate_rps if station.rate_rps > 0 else 0.0
        )
        sim = simulated_station(mine, span, servers) if mine else None
        row = {
            "station": f"{station.kind}:{station.name}",
            "predicted": {
                "rate_rps": station.rate_rps,
                "service_mean_s": predicted_service,
                "utilisation": station.utilisation,
                "wait_mean_s": station.wait_mean_s,
            },
            "simulated": sim,
        }
        rows.append(row)
        if sim is None:
            print(f"{row['station']:28} (nothing simulated there)")
            continue
        print(
            f"{row['station']:28} {station.rate_rps:6.3f}/{sim['rate_rps']:6.3f} "
            f"{predicted_service:6.2f}/{sim['service_mean_s']:6.2f} "
            f"{station.utilisation:6.3f}/{sim['utilisation']:6.3f} "
            f"{station.wait_mean_s:6.2f}/{sim['wait_mean_s']:6.2f} "
            f"{sim['mgc_wait_mean_s']:12.2f}"
        )
    print("(each cell: predicted/simulated)")
    print(
        json.dumps(
            {
                "scenario": scenario.name,
                "load": args.load,
                "rate_rps": at.rate_rps,
                "requests": args.requests,
                "seed": args.seed,
                "predicted_p90_s": at.ttft_p90_s,
                "simulated_p90_s": result.ttft.p90,
                "reasons": result.reasons,
                "stations": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
