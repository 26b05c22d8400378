"""One cell of the independent brute force over the simulator (``bench/slo_brute_force.py``):
the highest rate at which a setting (threshold and prefill/decode split of every PD cluster)
meets a P90 TTFT target in the simulator, found by bisection.

Pure Python and numpy: no Django. The bench runs cells here in its own process, or spreads them
over Celery workers (the ``scheduling.slo_cell_goodput`` task calls :func:`slo_cell_goodput`):
the same function with the same seed, so a cell's goodput is the same wherever it ran.

The bisection's upper end is a bound that holds whatever the link does, never the planner's
link model: each PD cluster's decode slots (N_d x batch / decode time), and its own prefill
of the requests at or below its threshold, which stay local in every case. It is a hard
capacity: no rate at or above it is sustained, however a finite run looks. A 4,000-request run
at 2% above a cluster's decode slots keeps 98% of its load (the queue it builds in the run is
smaller than the 3% slack of ``MIN_SUSTAINED``) and may still meet the P90 target; on
two-pd-clusters the brute force once "won" that way (3.98 req/s, 1.02 x pd-south's decode
bound, a setting whose queue grows without end). For the same reason a cell's rate is
confirmed on a longer run (:data:`CONFIRM`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from scheduling.core.fleet import FleetSpec, Lengths, lengths_of
from scheduling.core.performance import decode_rate_per_instance, prefill_seconds
from scheduling.core.scenario import Scenario
from scheduling.core.scenario_fleet import fleet_from_scenario, workload_lengths
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import MIN_SUSTAINED, SimulationConfig, simulate

#: A setting: per PD cluster, (threshold in tokens, prefill instances, decode instances).
Setting = Mapping[str, tuple[float, int, int]]

#: The brute force's common random numbers: every cell sees the same arrivals and lengths.
SEED = 3
#: Bisection steps per cell after its bracket: the rate to 1/64 of the bracket.
STEPS = 6
#: A cell's rate is confirmed on a run this many times as long as the search's. Near a
#: station's capacity a run that starts from an empty fleet meets the target long before its
#: queue reaches its steady state: on two-pd-clusters, a setting whose pd-south decode runs at
#: 99.97% of its slots keeps its P90 at 11 s over 4,000 requests and passes 29 s over 16,000.
CONFIRM = 4
#: Bisection steps on the long runs where the confirmation fails (1/8 of the bracket).
CONFIRM_STEPS = 3


@dataclass(frozen=True)
class CellRun:
    """One simulation of a setting at a rate."""

    ttft_p90_s: float
    sustained: float  # share of the offered load completed
    stable: bool  # the simulator's verdict: no backlog trend and MIN_SUSTAINED completed
    link_congested: float  # share of routing decisions the link guard refused

    def meets(self, slo_s: float) -> bool:
        """Sustained (the simulator's criterion) with the P90 TTFT within ``slo_s``."""
        return self.stable and self.sustained >= MIN_SUSTAINED and self.ttft_p90_s <= slo_s


@dataclass(frozen=True)
class CellGoodput:
    """A cell's goodput (0 when it cannot beat the floor it was given) and the simulations
    it took."""

    rate_rps: float
    simulations: int


def cell_simulate(
    scenario: Scenario, setting: Setting, rate: float, *, requests: int, seed: int = SEED
) -> CellRun:
    """The setting simulated at ``rate`` (the PrfaaS policy, ``requests`` requests)."""
    fleet = fleet_setting(
        scenario,
        {c: t for c, (t, _, _) in setting.items()},
        {c: (p, d) for c, (_, p, d) in setting.items()},
    )
    result = simulate(
        scenario,
        SimulationConfig(policy="prfaas", rate_per_s=rate, requests=requests, seed=seed),
        fleet=fleet,
    )
    decisions = sum(result.reasons.values()) or 1
    return CellRun(
        result.ttft.p90,
        result.sustained_fraction,
        result.sustained,
        result.reasons.get("link_congested", 0) / decisions,
    )


def cell_bound(fleet: FleetSpec, lengths: Lengths, output_tokens: float, setting: Setting) -> float:
    """An upper bound on the setting's rate whatever the link does: each PD cluster's decode
    slots, and its prefill of the requests at or below its threshold (never offloaded)."""
    out = math.inf
    for c in fleet.pd:
        if c.share <= 0:
            continue
        t, n_p, n_d = setting[c.name]
        rate = decode_rate_per_instance(c.max_batch, c.step_seconds, output_tokens)
        out = min(out, n_d * rate / c.share)
        x, w = lengths_of(lengths, c.name).nodes()
        local = float(np.dot(np.where(x <= t, w, 0.0), prefill_seconds(c.prefill, x)))
        if local > 0:
            out = min(out, n_p / (c.share * local))
    return out


def slo_cell_goodput(
    scenario: Scenario,
    setting: Setting,
    floor: float,
    *,
    slo_s: float,
    requests: int,
    seed: int = SEED,
    confirm: int = CONFIRM,
) -> CellGoodput:
    """The highest rate at which the setting is sustained (:meth:`CellRun.meets`) with its
    simulated P90 TTFT within ``slo_s``, if that beats ``floor`` by 1% (else 0): bisection
    between the floor (or 30% of the bound) and :func:`cell_bound`, always below the bound,
    on runs of ``requests``; the rate found is then confirmed on a run ``confirm`` times as
    long, and bisected down on such runs if it fails there."""
    fleet = fleet_from_scenario(scenario)
    lengths, output_tokens = workload_lengths(scenario)
    runs = 0

    def within(rate: float, length: int = requests) -> bool:
        nonlocal runs
        runs += 1
        return cell_simulate(scenario, setting, rate, requests=length, seed=seed).meets(slo_s)

    hi = cell_bound(fleet, lengths, output_tokens, setting)
    lo = floor * 1.01
    if hi <= lo:
        return CellGoodput(0.0, runs)
    if lo > 0 and not within(lo):
        return CellGoodput(0.0, runs)
    if lo == 0:
        lo = 0.3 * hi
        if not within(lo):
            return CellGoodput(0.0, runs)
    base = lo
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        if within(mid):
            lo = mid
        else:
            hi = mid
    long = requests * confirm
    if confirm <= 1 or within(lo, long):
        return CellGoodput(lo, runs)
    # The short run started from an empty fleet and ended before the queues reached their
    # steady state: bisect between where the search began and there, on long runs (fewer
    # steps: each costs ``confirm`` short ones), unless the long run fails there too.
    if not within(base, long):
        return CellGoodput(0.0, runs)
    top = lo
    for _ in range(CONFIRM_STEPS):
        mid = (base + top) / 2
        if within(mid, long):
            base = mid
        else:
            top = mid
    return CellGoodput(base, runs)
