"""``manage.py simulate FILE --policy P (--rate R | --capacity)``: replay a scenario or trace.

A thin wrapper over :mod:`scheduling.core.simulator`. Bad arguments and unusable files print a
message naming the problem and exit with status 2.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.core.scenario import ScenarioError, scenario_load
from scheduling.core.simulator.capacity import CapacityResult, capacity_search
from scheduling.core.simulator.policies import POLICIES, PolicyError
from scheduling.core.simulator.report import report_write, requests_csv_write
from scheduling.core.simulator.routing import ROUTING_LENGTHS
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, plan_for, simulate
from scheduling.core.simulator.workload import WorkloadError
from scheduling.core.trace import TraceError

DEFAULT_REQUESTS = 10_000
MAX_REQUESTS = 10_000_000


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _bad(message: str) -> CommandError:
    return CommandError(message, returncode=2)


class Command(BaseCommand):
    help = "Simulate a scenario or trace under a policy; optionally search its capacity."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="scenario YAML file")
        parser.add_argument("--policy", choices=POLICIES, default="prfaas")
        load = parser.add_mutually_exclusive_group()
        load.add_argument(
            "--rate",
            type=float,
            help="arrival rate (req/s) of the first phase (default: the scenario's own rate, "
            "or a trace's natural rate)",
        )
        load.add_argument(
            "--capacity", action="store_true", help="search the largest sustained rate"
        )
        length = parser.add_mutually_exclusive_group()
        length.add_argument(
            "--requests",
            type=int,
            help="requests to replay (default: a trace's all, a scenario with phases its whole "
            f"length, else {DEFAULT_REQUESTS})",
        )
        length.add_argument("--duration", type=float, help="simulated seconds of arrivals")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument("--report", metavar="DIR", help="write report.html and PNG plots")
        parser.add_argument("--csv", metavar="FILE", help="write one CSV row per request")
        parser.add_argument(
            "--ttft-slo", type=float, metavar="S", help="TTFT target (s) for goodput"
        )
        parser.add_argument(
            "--skip-bad", action="store_true", help="skip corrupt trace lines (counted)"
        )
        parser.add_argument(
            "--threshold", type=float, help="override the planned threshold (tokens)"
        )
        parser.add_argument(
            "--routing-length",
            choices=ROUTING_LENGTHS,
            default="incremental",
            help="route by incremental (uncached) length or by prompt length",
        )
        parser.add_argument(
            "--replan-interval",
            type=float,
            default=600.0,
            help="prfaas-dual re-planning period (s)",
        )

    def _check(self, opts: dict[str, Any]) -> None:
        rate = opts["rate"]
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise _bad(f"--rate: must be a positive number of requests per second, got {rate:g}")
        requests = opts["requests"]
        if requests is not None and not (1 <= requests <= MAX_REQUESTS):
            raise _bad(f"--requests: must be between 1 and {MAX_REQUESTS}, got {requests}")
        duration = opts["duration"]
        if duration is not None and not (math.isfinite(duration) and duration > 0):
            raise _bad(f"--duration: must be a positive number of seconds, got {duration:g}")
        slo = opts["ttft_slo"]
        if slo is not None and not (math.isfinite(slo) and slo > 0):
            raise _bad(f"--ttft-slo: must be a positive number of seconds, got {slo:g}")
        threshold = opts["threshold"]
        if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
            raise _bad(f"--threshold: must be a non-negative number of tokens, got {threshold:g}")
        if threshold is not None and opts["policy"] in ("homogeneous", "naive"):
            raise _bad(f"--threshold: the {opts['policy']} policy has no threshold")
        interval = opts["replan_interval"]
        if not (math.isfinite(interval) and interval > 0):
            raise _bad(f"--replan-interval: must be a positive number of seconds, got {interval:g}")
        for flag, key in (("--report", "report"), ("--csv", "csv")):
            if opts[key]:
                parent = Path(opts[key]).resolve().parent
                if not parent.is_dir():
                    raise _bad(f"{flag}: directory {parent} does not exist")

    def handle(self, *args: Any, **opts: Any) -> None:
        started = time.perf_counter()
        self._check(opts)
        try:
            scenario = scenario_load(opts["file"])
        except ScenarioError as exc:
            raise _bad(str(exc)) from None
        if scenario.workload is None:
            raise _bad("workload: required key is missing (the simulator needs traffic)")
        if (
            opts["rate"] is None
            and not opts["capacity"]
            and scenario.workload.trace is None
            and scenario.workload.arrival.rate_per_s is None
        ):
            raise _bad("the scenario gives no arrival rate: pass --rate R or --capacity")
        requests, duration = opts["requests"], opts["duration"]
        if requests is None and duration is None and scenario.workload.trace is None:
            # The scenario's whole length when it has one (its phases); else a fixed count.
            phased = sum(p.duration_s for p in scenario.workload.phases)
            if phased > 0:
                duration = phased
            else:
                requests = DEFAULT_REQUESTS
        config = SimulationConfig(
            policy=opts["policy"],
            rate_per_s=opts["rate"],
            requests=requests,
            duration_s=duration,
            seed=opts["seed"],
            skip_bad=opts["skip_bad"],
            threshold=opts["threshold"],
            ttft_slo_s=opts["ttft_slo"],
            routing_length=opts["routing_length"],
            replan_interval_s=opts["replan_interval"],
        )
        keep = bool(opts["csv"] or opts["report"])
        capacity: CapacityResult | None = None
        try:
            plan = plan_for(scenario, skip_bad=config.skip_bad)
            if opts["capacity"]:
                capacity = capacity_search(scenario, config, plan=plan)
                result = (
                    simulate(
                        scenario,
                        replace(config, rate_per_s=capacity.capacity_rps),
                        plan=plan,
                        keep_requests=keep,
                    )
                    if capacity.capacity_rps > 0
                    else None
                )
            else:
                result = simulate(scenario, config, plan=plan, keep_requests=keep)
        except (ScenarioError, TraceError, WorkloadError, PolicyError) as exc:
            raise _bad(str(exc)) from None
        if result is None:
            raise CommandError("no sustainable rate was found", returncode=1)
        if opts["csv"]:
            requests_csv_write(result, Path(opts["csv"]))
        if opts["report"]:
            report_write(result, Path(opts["report"]), capacity=capacity)
        if opts["json"]:
            out = self._json(result, capacity)
            out["wall_s"] = time.perf_counter() - started
            self.stdout.write(json.dumps(out, allow_nan=False))
        else:
            self._human(result, capacity)

    @staticmethod
    def _json(result: SimulationResult, capacity: CapacityResult | None) -> dict[str, Any]:
        out = result.to_dict()
        if capacity is not None:
            out["capacity_rps"] = capacity.capacity_rps
            out["goodput_capacity_rps"] = capacity.goodput_capacity_rps
            out["probes"] = [
                {
                    "rate_rps": p.rate_rps,
                    "sustained": p.sustained,
                    "growth_rps": p.backlog_growth_rps,
                    "sustained_fraction": p.sustained_fraction,
                }
                for p in capacity.probes
            ]

        def clean(value: Any) -> Any:
            if isinstance(value, float):
                return _finite(value)
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [clean(v) for v in value]
            return value

        cleaned: dict[str, Any] = clean(out)
        return cleaned

    def _human(self, result: SimulationResult, capacity: CapacityResult | None) -> None:
        d = result.to_dict()
        w = self.stdout.write
        w(f"{result.scenario} / {result.policy} (seed {result.seed})")
        if capacity is not None:
            w(
                f"  capacity            {capacity.capacity_rps:.3f} req/s "
                f"(planner Lambda_max {capacity.planned_capacity_rps or float('nan'):.3f})"
            )
            if capacity.goodput_capacity_rps is not None:
                w(f"  goodput capacity    {capacity.goodput_capacity_rps:.3f} req/s")
        w(
            f"  requests            {result.requests} (finished {result.finished}, dropped "
            f"{result.dropped}, skipped lines {len(result.skipped_lines)})"
        )
        w(
            f"  rate / throughput   {result.offered_rate_rps:.3f} / {result.throughput_rps:.3f} req/s"
        )
        w(
            f"  sustained           {result.sustained_rps:.3f} req/s "
            f"({result.sustained_fraction:.1%} of offered, after warm-up, while arrivals last)"
        )
        t = result.ttft
        w(f"  TTFT mean/p50/p90/p99  {t.mean:.3f} / {t.p50:.3f} / {t.p90:.3f} / {t.p99:.3f} s")
        w(f"  TPOT mean/p99       {result.tpot_mean_s:.4f} / {result.tpot_p99_s:.4f} s")
        w(
            f"  SLO attainment      {result.slo_attainment:.3f} (goodput {result.goodput_rps:.3f} req/s)"
        )
        w(f"  offload fraction    {result.offload_fraction:.3f}")
        w(f"  cache-hit fraction  {result.cache_hit_fraction:.3f} of prompt tokens")
        w(
            f"  link                mean {d['link']['mean_gbps']:.2f} Gbps, p99 {d['link']['p99_gbps']:.2f} Gbps, "
            f"KV offloaded {result.kv_bytes_offloaded / 1e9:.1f} GB"
        )
        w(
            f"  queues              stable={result.stable} growth={result.backlog_growth_rps:.4f} req/s"
        )
        w(f"  wall                {result.wall_s:.2f} s")
