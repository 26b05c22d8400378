"""Plans under real concurrency (threads, each with its own PostgreSQL connection): a burst of
``POST /rebalance`` for one cluster leaves one proposed plan, and approving concurrently gives
one success and 409s, never a 500 (issue 13: 2-6 proposed plans, IntegrityError on approve)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from clusters.models import Cluster, Instance
from scheduling.models import Plan, PlanStatus
from tests.factories import api_token, bearer
from tests.scheduling.rebalance_support import (
    PERIOD,
    inventory_load,
    policy_set,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)

THREADS = 4


@pytest.fixture
def fleet(transactional_db: None, scenarios_dir: Path, redis_client: Any) -> Cluster:
    cluster = inventory_load(scenarios_dir)
    policy_set(8500)
    settings_set(cluster, guards={"max_change_fraction": 0.25, "persist_ticks": 1})
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    traffic_record(time.time(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    return cluster


def together(call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` from THREADS threads released at once; their results."""
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = call(i)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_run_nows_leave_one_proposed_plan(fleet: Cluster) -> None:
    operator = bearer(api_token("read", "operate")[1])

    def run_now(i: int) -> int:
        return Client().post("/api/v1/rebalance?cluster=pd-h20", headers=operator).status_code

    assert together(run_now) == [200] * THREADS
    statuses = Counter(Plan.objects.filter(cluster=fleet).values_list("status", flat=True))
    assert statuses[PlanStatus.PROPOSED] == 1
    assert set(statuses) <= {PlanStatus.PROPOSED, PlanStatus.SUPERSEDED}


def test_concurrent_approvals_give_one_success_and_409s(fleet: Cluster) -> None:
    operator = bearer(api_token("read", "operate")[1])
    [tick] = Client().post("/api/v1/rebalance?cluster=pd-h20", headers=operator).json()["ticks"]
    plan_id = tick["plan_id"]
    assert plan_id

    def approve(i: int) -> tuple[int, Any]:
        r = Client().post(f"/api/v1/plans/{plan_id}/approve", headers=operator)
        return r.status_code, r.json()

    answers = together(approve)
    assert sorted(status for status, _ in answers) == [200] + [409] * (THREADS - 1)
    for status, body in answers:
        if status == 409:
            assert set(body) == {"detail", "code"} and body["code"] == "illegal_transition"
    assert Plan.objects.get(pk=plan_id).status in (PlanStatus.APPLYING, PlanStatus.APPLIED)
    assert Plan.objects.filter(cluster=fleet, status__in=["approved", "applying"]).count() <= 1
