"""While a plan drains an instance, ``POST /route`` sends it no new work (through the API)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.test import Client

from clusters.models import Instance, InstanceState
from controlplane.audit import Actor
from scheduling import rebalance
from tests.factories import api_token, bearer
from tests.scheduling.plan_pages_support import proposed_plan
from tests.scheduling.rebalance_support import PD, telemetry_fresh

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


def test_a_drained_instance_receives_no_new_route_decisions(
    scenarios_dir: Path, route_state_clean: None
) -> None:
    plan = proposed_plan(scenarios_dir)
    target = plan.role_changes[0]["instance"]
    router = bearer(api_token("router")[1])

    assert target in routed_instances(Client(), router)  # an idle instance routers like to use

    rebalance.plan_approve(plan_id=plan.pk, actor=Actor(label="user:ops", source="api"))
    rebalance.plan_apply_step(plan_id=plan.pk)  # the drain step
    assert Instance.objects.get(name=target).state == InstanceState.DRAINING
    assert target not in routed_instances(Client(), router)
