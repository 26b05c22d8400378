"""A plan the rebalancer really proposed (case-study fleet, drifted traffic, one tick), for
the plan pages' tests, the drain-and-route test and the browser tests."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from django.utils import timezone

from clusters.models import Instance
from scheduling import rebalance
from scheduling.models import Plan
from tests.scheduling.rebalance_support import (
    PERIOD,
    inventory_load,
    policy_set,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)


def proposed_plan(scenarios_dir: Path) -> Plan:
    cluster = inventory_load(scenarios_dir)
    policy_set(8500)
    settings_set(cluster, guards={"max_change_fraction": 0.25, "persist_ticks": 1})
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    period = rebalance.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    tick = rebalance.rebalance_tick(cluster_id=cluster.pk, period_start=period)
    assert tick.action == "propose", tick.detail
    return Plan.objects.get(tick=tick)
