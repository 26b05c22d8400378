"""Shared set-up for the rebalancer's Django tests: the case-study inventory, a policy, recorded
traffic in the real traffic store and fresh telemetry in the real live store."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import redis
from django.conf import settings

from clusters.live.telemetry import InstanceSample, telemetry_batch_store
from clusters.models import Cluster, Instance, InstanceRole
from clusters.topology import topology_apply
from controlplane.audit import CLI_ACTOR
from scheduling.core import rebalancer
from scheduling.core.planner import fleet_from_scenario, plan_fleet
from scheduling.core.scenario import scenario_load
from scheduling.models import Policy, RebalanceSettings
from scheduling.policies import policy_create
from scheduling.traffic import BIN_EDGES, TrafficRecord, traffic_record_queue

PD = "pd-h20"
PERIOD = float(settings.REBALANCE_INTERVAL_S)


def inventory_load(scenarios_dir: Path, *, n_p: int = 2, n_d: int = 6) -> Cluster:
    """The case-study fleet with the PD cluster split ``n_p``/``n_d``."""
    scenario = scenario_load(scenarios_dir / "paper-case-study.yaml")
    clusters = tuple(
        replace(c, prefill_instances=n_p, decode_instances=n_d) if c.name == PD else c
        for c in scenario.clusters
    )
    topology_apply(replace(scenario, clusters=clusters), actor=CLI_ACTOR)
    return Cluster.objects.get(name=PD)


def policy_set(threshold: int) -> Policy:
    return policy_create(actor=CLI_ACTOR, thresholds={PD: threshold})


def settings_set(cluster: Cluster, **fields: object) -> RebalanceSettings:
    row, _ = RebalanceSettings.objects.get_or_create(cluster=cluster)
    for name, value in fields.items():
        setattr(row, name, value)
    row.save()
    return row


def sampled_lengths(seed: int, mu: float, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mu, 1.0, size=3 * n + 10)
    return np.round(x[(x >= 128) & (x <= 131072)][:n])


def traffic_record(end: float, lengths: np.ndarray, *, span: float = PERIOD) -> None:
    """Record one request per length, spread evenly over ``[end - span, end)``."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    pipe = client.pipeline(transaction=False)
    step = span / max(1, len(lengths))
    for i, tokens in enumerate(lengths):
        record = TrafficRecord(
            origin=PD,
            ts=end - span + i * step,
            route="local",
            reason="below_threshold",
            incremental_tokens=int(tokens),
            cached_tokens=0,
        )
        traffic_record_queue(pipe, record, None)
    pipe.execute()
    client.close()


def telemetry_fresh(ts: float | None = None, *, busy: dict[str, int] | None = None) -> None:
    """Every instance reports now: idle unless ``busy`` gives it running requests."""
    busy = busy or {}
    ts = time.time() if ts is None else ts
    samples = [
        InstanceSample(instance=i.name, ts=ts, running=busy.get(i.name, 0))
        for i in Instance.objects.all()
    ]
    telemetry_batch_store(samples, [])


def planner_answer(scenarios_dir: Path, lengths: np.ndarray) -> rebalancer.Setting:
    """What the planner says for a window of these lengths (binned like the traffic store)."""
    fleet = fleet_from_scenario(scenario_load(scenarios_dir / "paper-case-study.yaml"))
    window = rebalancer.window_from_lengths(
        lengths.tolist(), start_s=0, end_s=PERIOD, bin_edges=BIN_EDGES, output_tokens_mean=1024
    )
    ev = plan_fleet(
        rebalancer.fleet_for_cluster(fleet, PD, 8),
        rebalancer.DiscreteLengths.from_points(window.incremental_tokens),
        1024.0,
    ).cluster(PD)
    return rebalancer.Setting(ev.threshold_tokens, ev.n_p, ev.n_d)


def roles() -> dict[str, str]:
    return dict(Instance.objects.filter(cluster__name=PD).values_list("name", "role"))


def role_counts() -> tuple[int, int]:
    r = list(roles().values())
    return r.count(InstanceRole.PREFILL), r.count(InstanceRole.DECODE)
