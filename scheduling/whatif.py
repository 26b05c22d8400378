"""What-if runs: the simulator on a scenario (or the current inventory) with edited knobs,
against the same deployment unedited ("the current plan"), as a Celery task with live progress.

A run is short-lived working data, kept in Redis (one store, key layout here):

``whatif:next``          STRING  last run id given out (INCR).
``whatif:run:{id}``      HASH    status (queued|running|finished|failed), done, total,
                                 params (JSON), result (JSON), error, actor, created_at.
                                 Expires after ``RUN_TTL_S``.

``whatif_start`` validates everything first (a bad knob or scenario raises ``Invalid`` naming
the field, and nothing is stored), then enqueues the task ``WHATIF_EXECUTE_TASK`` (by name) after commit.
Progress goes to the run's live group (:func:`controlplane.live.whatif_group`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from celery import current_app
from django.conf import settings
from django.db import transaction

from clusters.models import Cluster, ClusterKind
from clusters.topology import topology_scenario
from controlplane import live
from controlplane.audit import Actor
from controlplane.errors import Invalid, NotFound
from controlplane.redis_connection import redis_sync
from scheduling.core.planner import (
    DEFAULT_LOAD,
    FleetSpec,
    fleet_from_scenario,
    plan_fleet,
    workload_lengths,
    workload_planned,
)
from scheduling.core.scenario import (
    Scenario,
    ScenarioError,
    scenario_load,
    scenario_parse,
    scenario_to_dict,
)
from scheduling.core.simulator import SimulationConfig, SimulationResult
from scheduling.core.simulator.policies import fleet_setting
from scheduling.core.simulator.run import result_build, simulation_build
from scheduling.core.simulator.workload import WorkloadError, workload_build
from scheduling.core.sizing import Sizing, advice_to_dict, sizing_advice, sizing_at_load
from scheduling.policies import policy_current
from scheduling.snapshot import DEFAULT_THRESHOLD_TOKENS
from scheduling.traffic import fleet_rate, traffic_window_read

INVENTORY = "inventory"
#: The Celery task that runs a what-if (``scheduling.tasks.whatif_execute``), sent by name: the
#: task module imports this one, so this one must not import it.
WHATIF_EXECUTE_TASK = "scheduling.whatif_execute"
RunStatus = Literal["queued", "running", "finished", "failed"]
RUN_TTL_S = 7 * 24 * 3600
NEXT_KEY = "whatif:next"
RUN_KEY = "whatif:run:{run_id}"
MAX_REQUESTS = 20_000
# The traffic window an inventory run without a rate takes its rate from.
TRAFFIC_WINDOW_S = 15 * 60
# Progress frames per simulation: enough for a smooth bar, few enough for the channel layer.
PROGRESS_STEPS = 20
# Points of each chart series kept in the stored result.
CHART_POINTS = 300


@dataclass(frozen=True)
class WhatIfParams:
    """What to simulate. ``None`` knobs keep the deployment's own value."""

    source: str  # a scenario file name in settings.SCENARIOS_DIR, or "inventory"
    workload: str  # the scenario file whose workload drives an inventory run
    requests: int = 2000
    seed: int = 0
    rate_per_s: float | None = None
    link_gbps: float | None = None
    prfaas_instances: int | None = None
    pd_prefill_instances: int | None = None
    pd_decode_instances: int | None = None
    threshold: float | None = None


def scenarios_dir() -> Path:
    return Path(settings.SCENARIOS_DIR)


def scenario_choices() -> list[str]:
    """Scenario files an operator may pick (names only; never a path from the browser)."""
    folder = scenarios_dir()
    return sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _scenario_file(name: str, field: str) -> Scenario:
    if name not in scenario_choices():
        raise Invalid(f"{field}: unknown scenario {name!r}")
    try:
        return scenario_load(scenarios_dir() / name)
    except ScenarioError as exc:
        raise Invalid(f"{field}: {exc}") from None


def _deployment(params: WhatIfParams) -> dict[str, Any]:
    """The scenario the run starts from, as a mapping (inventory + a file's workload, or a file)."""
    if params.source != INVENTORY:
        return scenario_to_dict(_scenario_file(params.source, "source"))

    try:
        inventory = scenario_to_dict(topology_scenario())
    except ScenarioError as exc:
        raise Invalid(f"source: the inventory is not a complete deployment: {exc}") from None
    workload = scenario_to_dict(_scenario_file(params.workload, "workload"))
    for key in ("workload", "slo", "caches"):
        if key in workload:
            inventory[key] = workload[key]
    return inventory


def _edited(base: dict[str, Any], params: WhatIfParams) -> dict[str, Any]:
    data = json.loads(json.dumps(base))
    if params.link_gbps is not None:
        for link in data.get("links", []):
            link["gbps"] = params.link_gbps
    for cluster in data.get("clusters", []):
        if cluster.get("kind") == "prfaas" and params.prfaas_instances is not None:
            cluster["prefill_instances"] = params.prfaas_instances
        if cluster.get("kind") == "pd":
            if params.pd_prefill_instances is not None:
                cluster["prefill_instances"] = params.pd_prefill_instances
            if params.pd_decode_instances is not None:
                cluster["decode_instances"] = params.pd_decode_instances
    data.pop("expected", None)
    return data


def _parsed(data: dict[str, Any], field: str) -> Scenario:
    try:
        return scenario_parse(data, base_dir=scenarios_dir())
    except ScenarioError as exc:
        raise Invalid(f"{field}: {exc}") from None


def whatif_scenarios(params: WhatIfParams) -> tuple[Scenario, Scenario]:
    """(current plan, what-if) scenarios; Invalid naming the field when a knob can't apply."""
    if not 1 <= params.requests <= MAX_REQUESTS:
        raise Invalid(f"requests: must be within 1..{MAX_REQUESTS}")
    for name in ("rate_per_s", "link_gbps", "threshold"):
        value = getattr(params, name)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise Invalid(f"{name}: must be a finite number of at least 0")
    if params.rate_per_s is not None and params.rate_per_s <= 0:
        raise Invalid("rate_per_s: must be greater than 0")
    base = _deployment(params)
    current = _parsed(base, "source")
    edited = _parsed(_edited(base, params), "source")
    workload = edited.workload
    if workload is None:
        raise Invalid("source: this scenario has no workload to simulate")
    if params.rate_per_s is None and workload.trace is None and workload.arrival.rate_per_s is None:
        raise Invalid("rate_per_s: this scenario gives no arrival rate; enter one")
    return current, edited


# ---------------------------------------------------------------------------------------------
# Store


def _key(run_id: int) -> str:
    return RUN_KEY.format(run_id=run_id)


def observed_rate(window_s: float = TRAFFIC_WINDOW_S, now: float | None = None) -> float:
    """Requests per second that arrived at all PD clusters over the last ``window_s``."""

    now = time.time() if now is None else now
    names = Cluster.objects.filter(kind=ClusterKind.PD).values_list("name", flat=True)
    arrivals = sum(traffic_window_read(n, now - window_s, now).arrivals for n in names)
    return fleet_rate(arrivals, window_s)


def whatif_start(params: WhatIfParams, *, actor: Actor) -> int:
    """Validate, store and enqueue a run; returns its id. Nothing is stored when invalid.

    An inventory run without a rate takes the rate observed over the last traffic window."""
    if params.source == INVENTORY and params.rate_per_s is None:
        rate = observed_rate()
        if rate <= 0:
            raise Invalid(
                f"rate_per_s: no traffic observed in the last {TRAFFIC_WINDOW_S // 60} minutes; "
                "enter a rate"
            )
        params = replace(params, rate_per_s=round(rate, 6))
    whatif_scenarios(params)
    client = redis_sync()
    run_id = int(client.incr(NEXT_KEY))
    key = _key(run_id)
    client.hset(
        key,
        mapping={
            "status": "queued",
            "done": 0,
            "total": 1,
            "params": json.dumps(asdict(params)),
            "actor": actor.label,
            "created_at": time.time(),
        },
    )
    client.expire(key, RUN_TTL_S)

    transaction.on_commit(lambda: current_app.send_task(WHATIF_EXECUTE_TASK, args=(run_id,)))
    return run_id


def whatif_get(run_id: int) -> dict[str, Any]:
    """A run as plain data: status, progress, params and (once finished) its result."""
    raw = redis_sync().hgetall(_key(run_id))
    if not raw:
        raise NotFound(f"what-if run {run_id} does not exist (or has expired)")
    h = {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]
    return {
        "id": run_id,
        "status": h.get("status", "queued"),
        "done": float(h.get("done", 0)),
        "total": float(h.get("total", 1)),
        "params": json.loads(h.get("params", "{}")),
        "result": json.loads(h["result"]) if "result" in h else None,
        "error": h.get("error", ""),
        "actor": h.get("actor", ""),
        "created_at": float(h.get("created_at", 0)),
    }


def _progress(run_id: int, status: RunStatus, done: float, total: float, message: str = "") -> None:
    redis_sync().hset(_key(run_id), mapping={"status": status, "done": done, "total": total})
    live.live_publish(
        live.whatif_group(run_id),
        live.WhatIfProgress(
            run_id=run_id,
            state=status,
            done=done,
            total=total,
            message=message,
        ),
    )


# ---------------------------------------------------------------------------------------------
# Execution (the Celery task calls this)


class _Reporting(list[Any]):
    """The request list handed to the simulator: reports every ``every``-th arrival it reads."""

    def __init__(self, items: Iterable[Any], every: int, report: Callable[[int], None]) -> None:
        super().__init__(items)
        self.every = max(1, every)
        self.report = report

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index % self.every == 0:
            self.report(index)
        return super().__getitem__(index)


def _setting(
    scenario: Scenario, threshold: float | None, deployed: Mapping[str, float] | None
) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    """The thresholds and splits a run simulates: every PD cluster's split as the scenario
    lists it (the inventory's roles, or the what-if's knobs: never re-solved), and its
    threshold from ``deployed`` (the routers' policy), else ``threshold``, else the
    planner's best threshold for that split."""
    splits = {c.name: (c.prefill_instances, c.decode_instances) for c in scenario.pd_clusters}
    if deployed is not None:
        return {name: deployed[name] for name in splits}, splits
    if threshold is not None:
        return dict.fromkeys(splits, float(threshold)), splits
    lengths, output = workload_lengths(scenario)
    planned = plan_fleet(
        fleet_from_scenario(scenario),
        lengths,
        output,
        split_bounds={name: (n_p, n_p) for name, (n_p, _) in splits.items()},
    )
    return {c.name: c.threshold_tokens for c in planned.clusters}, splits


def deployed_thresholds(scenario: Scenario) -> dict[str, float]:
    """The threshold routers apply to each PD cluster now (the current policy, its default for
    a cluster it does not name)."""
    policy = policy_current()
    named = dict(policy.thresholds) if policy is not None else {}
    return {
        c.name: float(named.get(c.name, DEFAULT_THRESHOLD_TOKENS)) for c in scenario.pd_clusters
    }


def _simulate(
    scenario: Scenario,
    config: SimulationConfig,
    report: Callable[[int], None],
    deployed: Mapping[str, float] | None = None,
) -> SimulationResult:
    # scheduling.core.simulator.run.simulate, with the request list wrapped to report progress.

    started = time.perf_counter()
    thresholds, splits = _setting(scenario, config.threshold, deployed)
    fleet = fleet_setting(scenario, thresholds, splits)
    workload = workload_build(
        scenario, rate_per_s=config.rate_per_s, seed=config.seed, requests=config.requests
    )
    sim, dispatcher = simulation_build(scenario, fleet, workload, config)
    sim.requests = _Reporting(sim.requests, len(sim.requests) // PROGRESS_STEPS, report)
    sim.run()
    return result_build(scenario, fleet, workload, config, sim, dispatcher, started, False)


def _downsample(values: list[float], points: int = CHART_POINTS) -> list[float]:
    if len(values) <= points:
        return values
    step = len(values) / points
    return [
        max(values[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)])
        for i in range(points)
    ]


def result_summary(result: SimulationResult) -> dict[str, Any]:
    """What the page shows of one simulation: throughput, TTFT, offload, links, queue."""
    qt = list(result.queue_t)
    qs = [float(v) for v in result.queue_in_system]
    step = max(1, len(qt) // CHART_POINTS)
    return {
        "throughput_rps": result.throughput_rps,
        "goodput_rps": result.goodput_rps,
        "offered_rate_rps": result.offered_rate_rps,
        "finished": result.finished,
        "dropped": result.dropped,
        "ttft": asdict(result.ttft),
        "slo_attainment": result.slo_attainment,
        "offload_fraction": result.offload_fraction,
        "thresholds": result.thresholds,
        "split": {k: list(v) for k, v in result.split.items()},
        "stable": result.stable,
        "duration_s": result.duration_s,
        "reasons": result.reasons,
        "links": [
            {
                "key": link.key,
                "capacity_gbps": link.capacity_gbps,
                "mean_gbps": link.mean_gbps,
                "p99_gbps": link.p99_gbps,
                "peak_gbps": link.peak_gbps,
                "series_gbps": _downsample(list(link.series_gbps)),
                # Seconds each point spans (the simulator's buckets are 1 s; long runs are
                # downsampled to their per-span peaks).
                "series_step_s": max(1.0, len(link.series_gbps) / CHART_POINTS),
            }
            for link in result.links
        ],
        "queue": {"t": qt[::step], "in_system": qs[::step]},
    }


def sizing_summary(scenario: Scenario) -> dict[str, Any]:
    """How many more PrfaaS instances or Gbps would raise the what-if's planned rate (at the
    planner's load, within what the links admit), and by how much (``plan --advise``)."""
    workload = workload_planned(scenario)
    fleet = fleet_from_scenario(scenario)

    def planned(f: FleetSpec) -> Sizing:
        return sizing_at_load(
            f,
            workload.lengths,
            workload.output_tokens,
            load=DEFAULT_LOAD,
            output_scv=workload.output_scv,
            windows=workload.windows,
        )

    return advice_to_dict(*sizing_advice(fleet, planned))


def whatif_execute(run_id: int) -> dict[str, Any]:
    """Run both simulations of a stored run, publishing progress; store and return the result."""

    run = whatif_get(run_id)
    params = WhatIfParams(**run["params"])
    try:
        current, edited = whatif_scenarios(params)
        config = SimulationConfig(
            requests=params.requests, seed=params.seed, rate_per_s=params.rate_per_s
        )
        total = 2 * params.requests
        _progress(run_id, "running", 0, total, "simulating the current plan")
        # "Current" is what runs: the inventory's roles under the deployed policy.
        deployed = deployed_thresholds(current) if params.source == INVENTORY else None
        base = _simulate(
            current,
            config,
            lambda i: _progress(run_id, "running", i, total, "current plan"),
            deployed,
        )
        _progress(run_id, "running", params.requests, total, "simulating the what-if")
        what = _simulate(
            edited,
            replace(config, threshold=params.threshold),
            lambda i: _progress(run_id, "running", params.requests + i, total, "what-if"),
        )
        result = {
            "current": result_summary(base),
            "whatif": result_summary(what),
            "advice": sizing_summary(edited),
        }
    except (Invalid, ScenarioError, WorkloadError, ValueError) as exc:
        message = exc.detail if isinstance(exc, Invalid) else str(exc)
        redis_sync().hset(_key(run_id), mapping={"error": message})
        _progress(run_id, "failed", 0, 1, message)
        return {"error": message}
    redis_sync().hset(_key(run_id), mapping={"result": json.dumps(result)})
    _progress(run_id, "finished", 1, 1, "done")
    return result


def whatif_snapshot(run_id: int) -> dict[str, Any]:
    """A what-if run's live snapshot: its status and progress (the result is fetched as HTML)."""
    try:
        run = whatif_get(run_id)
    except NotFound:
        return {"id": run_id, "status": "missing", "done": 0, "total": 1}
    return {k: run[k] for k in ("id", "status", "done", "total", "error")}
