"""Goodput planning against an independent brute force over the simulator (issue 28, item 3).

For each scenario (default: every one in ``scenarios/`` whose workload is a length
distribution) and a P90 TTFT target (default 15 s):

1. ``plan --ttft-slo``: the planner's setting and rate (goodput);
2. the simulator at that rate and setting (16,000 requests: 4 x ``--requests``): sustained (no
   backlog trend and >= 97% of the load completed, the simulator's own verdict) and P90 within
   the target?
3. brute force: every cell of a grid (thresholds every 2K tokens from 2K to 64K and "never",
   every split with at least one prefill and one decode instance) is simulated, its rate found
   by bisection (sustained and simulated P90 within the target; 4,000 requests, seed 3,
   common random numbers: :func:`scheduling.core.brute_force.slo_cell_goodput`), then
   confirmed on 16,000 (bisected down on such runs where it fails: near a station's capacity a
   short run from an empty fleet ends before its queue reaches its steady state). With several
   PD clusters, one cluster at a time, the others at their best so far, two rounds. A cell is
   skipped only when a bound that holds whatever the link does cannot beat the best rate found:
   its decode slots (N_d x batch / decode time) and its own prefill of the requests below its
   threshold, which stay local in every case. The planner's link model is never consulted.
   The same bound caps a cell's bisection: no rate at or above a hard capacity is sustained,
   however a finite run looks (:mod:`scheduling.core.brute_force`).

Cells are simulated in waves of ``--wave`` (default 1 in this process, twice the workers
with ``--workers``), the most promising first (highest bound); every cell of a wave is given
the best rate found before the wave as its floor, so the same wave size gives the same
goodput per cell in this process or on any number of workers.

``--workers N``: N Celery worker processes (``celery -A controlplane worker``, solo pool) on a
private Redis (the embedded one, in a temporary directory); each wave is a ``celery.group`` of
``scheduling.slo_cell_goodput`` tasks. Every process the bench starts is stopped by its id.
``--speedup``: the brute force of each scenario (not the planner's check) with 1 then 2
workers, the same waves (``--wave``, default 4): wall times, their ratio, and whether every
cell's goodput came out identical.

Acceptance: planner / brute force >= 95% and the planner's setting meets the target in the
simulator. Prints a table; the last line is one JSON object. Slow (minutes per scenario).

    python bench/slo_brute_force.py [--quick] [--slo S] [--requests N] [--workers N | --speedup]
        [--wave W] [scenario.yaml ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support.setup import PY  # noqa: E402
from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402
from scheduling.core.brute_force import (  # noqa: E402
    CONFIRM,
    SEED,
    CellGoodput,
    CellRun,
    Setting,
    cell_bound,
    cell_simulate,
    slo_cell_goodput,
)
from scheduling.core.planner import (  # noqa: E402
    fleet_from_scenario,
    plan_for_ttft,
    workload_lengths,
    workload_output_scv,
)
from scheduling.core.scenario import Scenario, scenario_load  # noqa: E402
from scheduling.core.scenario_writer import scenario_to_dict  # noqa: E402

NEVER = 131_100.0
TASK = "scheduling.slo_cell_goodput"
WORKER_READY_S = 120.0
#: A wave's results are awaited this long at most (a cell is a few simulations).
WAVE_TIMEOUT_S = 3600.0

Cell = dict[str, tuple[float, int, int]]


def cell_key(cell: Setting) -> str:
    return json.dumps(sorted((name, *v) for name, v in cell.items()))


class Cells(Protocol):
    """Where a wave of cells is simulated: every cell given the same floor."""

    def goodputs(
        self, scenario: Scenario, cells: list[Cell], floor: float, slo: float, requests: int
    ) -> list[CellGoodput]: ...


class InProcess:
    def goodputs(
        self, scenario: Scenario, cells: list[Cell], floor: float, slo: float, requests: int
    ) -> list[CellGoodput]:
        return [
            slo_cell_goodput(scenario, cell, floor, slo_s=slo, requests=requests, seed=SEED)
            for cell in cells
        ]


class CeleryWorkers:
    """N real Celery worker processes on a private Redis; a wave is one ``celery.group``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def goodputs(
        self, scenario: Scenario, cells: list[Cell], floor: float, slo: float, requests: int
    ) -> list[CellGoodput]:
        from celery import group

        data = scenario_to_dict(scenario)
        wave = group(
            self.app.signature(
                TASK,
                args=(data, {k: list(v) for k, v in cell.items()}, floor, slo, requests, SEED),
            )
            for cell in cells
        )
        results = wave.apply_async().get(timeout=WAVE_TIMEOUT_S)
        return [CellGoodput(float(r["rate_rps"]), int(r["simulations"])) for r in results]


@contextlib.contextmanager
def private_broker() -> Iterator[tuple[Any, Path]]:
    """A private Redis (the embedded one, in a temporary directory) and this process's Celery
    app on it, once per bench run (the app reads its broker from the settings once); the
    directory for the workers' state and log. The Redis is stopped by its id afterwards."""
    with tempfile.TemporaryDirectory(prefix="prfaas-brute-force-") as tmp:
        redis_server = EmbeddedRedis(Path(tmp))
        redis_server.start()
        try:
            # The database is never used: SQLite under the temporary directory, untouched.
            os.environ["REDIS_URL"] = redis_server.url
            os.environ["VAR_DIR"] = tmp
            os.environ.pop("REDIS_CLUSTER_URL", None)
            from controlplane.celery import app

            yield app, Path(tmp)
        finally:
            redis_server.stop()


@contextlib.contextmanager
def celery_workers(broker: tuple[Any, Path], n: int) -> Iterator[CeleryWorkers]:
    """``n`` worker processes (each one task at a time) on the private broker, ready; each
    stopped by its id afterwards."""
    from controlplane.celery import worker_argv, worker_stop

    app, tmp = broker
    env = {**os.environ, "LOG_LEVEL": "WARNING"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(tmp / "workers.log", "ab") as log:
            for i in range(n):
                procs.append(
                    subprocess.Popen(
                        [*worker_argv(PY), "-n", f"brute-force-{i}@%h"],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + WORKER_READY_S
        while len(app.control.ping(timeout=1.0) or []) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                tail = (tmp / "workers.log").read_text(errors="replace")[-2000:]
                sys.exit(f"{n} Celery workers did not all start:\n{tail}")
        yield CeleryWorkers(app)
    finally:
        for proc in procs:
            worker_stop(proc)


class Search:
    def __init__(self, scenario: Scenario, slo: float, requests: int, cells: Cells) -> None:
        self.scenario = scenario
        self.slo = slo
        self.requests = requests
        self.cells = cells
        self.fleet = fleet_from_scenario(scenario)
        self.lengths, self.out = workload_lengths(scenario)
        self.sims = 0
        #: every cell simulated: its goodput (0 when it could not beat its floor)
        self.found: dict[str, float] = {}

    def run(self, setting: Setting, rate: float) -> CellRun:
        """The setting simulated at ``rate``, on the run a cell's rate is confirmed on."""
        self.sims += 1
        return cell_simulate(self.scenario, setting, rate, requests=self.requests * CONFIRM)

    def bound(self, setting: Setting) -> float:
        return cell_bound(self.fleet, self.lengths, self.out, setting)

    def wave(self, cells: list[Cell], floor: float) -> list[float]:
        found = self.cells.goodputs(self.scenario, cells, floor, self.slo, self.requests)
        for cell, f in zip(cells, found, strict=True):
            self.sims += f.simulations
            self.found[cell_key(cell)] = f.rate_rps
        return [f.rate_rps for f in found]


def grid(instances: int, quick: bool) -> list[tuple[float, int]]:
    step = 8000 if quick else 2000
    thresholds = [float(t) for t in range(2000, 64001, step)] + [NEVER]
    return [(t, n) for t in thresholds for n in range(1, instances)]


def brute_force(search: Search, quick: bool, start: Cell, wave: int) -> tuple[float, Cell]:
    (best,) = search.wave([dict(start)], 0.0)
    best_setting = dict(start)
    clusters = [c for c in search.fleet.pd if c.share > 0]
    for _ in range(2 if len(clusters) > 1 else 1):
        for c in clusters:
            cells: list[Cell] = [
                {**best_setting, c.name: (t, n, c.instances - n)}
                for t, n in grid(c.instances, quick)
            ]
            cells.sort(key=search.bound, reverse=True)
            i = 0
            while i < len(cells):
                # Sorted: once a cell's bound cannot beat the best, no later cell can either.
                batch: list[Cell] = []
                while i < len(cells) and len(batch) < wave:
                    if 1.02 * search.bound(cells[i]) <= best * 1.01:
                        i = len(cells)
                        break
                    batch.append(cells[i])
                    i += 1
                floor = best
                for cell, rate in zip(batch, search.wave(batch, floor), strict=True):
                    if rate > best:
                        best, best_setting = rate, cell
    return best, best_setting


def plannable(path: Path) -> bool:
    """A scenario whose workload is length distributions (a trace's cells would replay it)."""
    try:
        scenario = scenario_load(path)
        workload_lengths(scenario)
    except (ValueError, TypeError):
        return False
    return scenario.workload is not None and scenario.workload.trace is None


def planned_setting(search: Search, slo_s: float) -> tuple[Any, Cell]:
    slo, ev = plan_for_ttft(
        search.fleet,
        search.lengths,
        search.out,
        slo_s,
        output_scv=workload_output_scv(search.scenario),
    )
    return slo, {c.name: (c.threshold_tokens, c.n_p, c.n_d) for c in ev.clusters}


def check(paths: list[Path], args: argparse.Namespace, cells: Cells, wave: int) -> None:
    """The planner against the brute force, scenario by scenario (the acceptance)."""
    rows = []
    for path in paths:
        scenario = scenario_load(path)
        search = Search(scenario, args.slo, args.requests, cells)
        t0 = time.perf_counter()
        slo, planned = planned_setting(search, args.slo)
        plan_s = time.perf_counter() - t0
        run = search.run(planned, slo.rate_rps)
        predicted = slo.at_rate.refused_fraction if slo.at_rate else float("nan")
        t0 = time.perf_counter()
        best, best_setting = brute_force(search, args.quick, planned, wave)
        ratio = slo.rate_rps / best if best > 0 else math.inf
        meets = run.meets(args.slo)
        row = {
            "scenario": scenario.name,
            "planner_rps": round(slo.rate_rps, 3),
            "planner_setting": {k: list(v) for k, v in planned.items()},
            "simulated_p90_s": round(run.ttft_p90_s, 2),
            "sustained": round(run.sustained, 3),
            "stable": run.stable,
            "predicted_refused": round(predicted, 3),
            "simulated_link_congested": round(run.link_congested, 3),
            "brute_force_rps": round(best, 3),
            "brute_force_setting": {k: list(v) for k, v in best_setting.items()},
            "ratio": round(ratio, 3),
            "holds": bool(meets and ratio >= 0.95),
            "cells": len(search.found),
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
            f"({row['cells']} cells, {row['simulations']} simulations, "
            f"{row['brute_force_s']} s); "
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
                "workers": args.workers,
                "wave": wave,
                "holds": all(r["holds"] for r in rows),
                "scenarios": rows,
            }
        )
    )


def speedup(
    paths: list[Path], args: argparse.Namespace, wave: int, broker: tuple[Any, Path]
) -> None:
    """The brute force of each scenario on 1 then 2 workers: wall times and their ratio."""
    rows = []
    for path in paths:
        scenario = scenario_load(path)
        walls: dict[int, float] = {}
        found: dict[int, dict[str, float]] = {}
        best: dict[int, float] = {}
        for n in (1, 2):
            with celery_workers(broker, n) as workers:
                search = Search(scenario, args.slo, args.requests, workers)
                _, planned = planned_setting(search, args.slo)
                # Timed from the first wave sent to the last result back, the workers ready.
                t0 = time.perf_counter()
                best[n], _ = brute_force(search, args.quick, planned, wave)
                walls[n] = time.perf_counter() - t0
                found[n] = search.found
        row = {
            "scenario": scenario.name,
            "cells": len(found[1]),
            "one_worker_s": round(walls[1], 1),
            "two_workers_s": round(walls[2], 1),
            "speedup": round(walls[1] / walls[2], 2),
            "identical": found[1] == found[2],
            "brute_force_rps": round(best[2], 3),
        }
        rows.append(row)
        print(
            f"{row['scenario']}: {row['cells']} cells in waves of {wave}; 1 worker "
            f"{row['one_worker_s']} s, 2 workers {row['two_workers_s']} s: speedup "
            f"{row['speedup']}x; every cell's goodput identical: {row['identical']}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "slo_p90_s": args.slo,
                "requests": args.requests,
                "seed": SEED,
                "quick": args.quick,
                "wave": wave,
                "cpus": os.cpu_count(),
                "identical": all(r["identical"] for r in rows),
                "scenarios": rows,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="*", type=Path)
    parser.add_argument("--quick", action="store_true", help="thresholds every 8K tokens")
    parser.add_argument("--slo", type=float, default=15.0, help="P90 TTFT target, seconds")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument(
        "--workers", type=int, default=0, help="Celery worker processes (0: this process)"
    )
    parser.add_argument(
        "--speedup", action="store_true", help="the brute force on 1 then 2 workers, timed"
    )
    parser.add_argument("--wave", type=int, default=0, help="cells simulated per wave")
    args = parser.parse_args()
    if args.workers < 0 or args.wave < 0:
        parser.error("--workers and --wave must be >= 0")
    paths = []
    for path in args.scenarios or sorted((ROOT / "scenarios").glob("*.yaml")):
        if plannable(path):
            paths.append(path)
        else:
            print(f"{path.name}: skipped (its workload is a trace, not a length distribution)")
    if args.speedup or args.workers:
        # By default SIGTERM ends Python without running ``finally``: workers would be left.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.speedup:
        with private_broker() as broker:
            speedup(paths, args, args.wave or 4, broker)
    elif args.workers:
        with private_broker() as broker, celery_workers(broker, args.workers) as workers:
            check(paths, args, workers, args.wave or 2 * args.workers)
    else:
        check(paths, args, InProcess(), args.wave or 1)


if __name__ == "__main__":
    main()
