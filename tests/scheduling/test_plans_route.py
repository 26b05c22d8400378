"""While a plan drains an instance, ``POST /route`` sends it no new work (through the API)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from clusters.models import Instance, InstanceState
from controlplane.audit import Actor
from controlplane.auth import token_cache_clear
from scheduling import plans
from scheduling.models import Plan
from scheduling.snapshot import snapshot_reset
from tests.factories import api_token, bearer
from tests.scheduling.rebalance_support import (
    PD,
    PERIOD,
    inventory_load,
    policy_set,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)

pytestmark = pytest.mark.django_db(transaction=True)

PROMPTS = [500, 3000, 9000, 15000, 30000, 60000] * 8


def routed_instances(client: Client, headers: dict[str, str]) -> set[str]:
    used: set[str] = set()
    for i, tokens in enumerate(PROMPTS):
        telemetry_fresh()
        response = client.post(
            "/api/v1/route",
            data=json.dumps({"origin": PD, "prompt_tokens": tokens, "request_id": f"r{i}"}),
            content_type="application/json",
            headers=headers,
        )
        assert response.status_code == 200, response.content
        body = response.json()
        used |= {body["prefill"]["instance"], body["decode"]["instance"]}
    return used


def test_a_drained_instance_receives_no_new_route_decisions(scenarios_dir: Path, redis_client):
    snapshot_reset()
    token_cache_clear()
    cluster = inventory_load(scenarios_dir)
    policy_set(8500)
    settings_set(cluster, guards={"max_change_fraction": 0.25, "persist_ticks": 1})
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    period = plans.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    plan = Plan.objects.get(tick=plans.rebalance_tick(cluster_id=cluster.pk, period_start=period))
    target = plan.role_changes[0]["instance"]
    router = bearer(api_token("router")[1])

    assert target in routed_instances(Client(), router)  # an idle instance routers like to use

    plans.plan_approve(plan_id=plan.pk, actor=Actor(label="user:ops", source="api"))
    plans.plan_apply_step(plan_id=plan.pk)  # the drain step
    assert Instance.objects.get(name=target).state == InstanceState.DRAINING
    assert target not in routed_instances(Client(), router)
    snapshot_reset()
