"""Plans over HTTP: list, detail, approve, reject, rollback and run-now, with scopes, 409s for
illegal transitions and the one error shape; nothing changes on a refused request."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from clusters.models import Cluster, Instance
from controlplane.models import ChangeRecord
from scheduling import rebalance
from scheduling.models import Plan, PlanStatus, Policy, RebalanceTick
from tests.factories import api_token, bearer
from tests.scheduling.rebalance_support import (
    PERIOD,
    inventory_load,
    policy_set,
    roles,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(scenarios_dir: Path, redis_client) -> Cluster:
    cluster = inventory_load(scenarios_dir)
    policy_set(8500)
    settings_set(cluster, guards={"max_change_fraction": 0.25, "persist_ticks": 1})
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    return cluster


@pytest.fixture
def operator() -> dict[str, str]:
    return bearer(api_token("read", "operate")[1])


@pytest.fixture
def reader() -> dict[str, str]:
    return bearer(api_token("read")[1])


def proposed(cluster: Cluster) -> Plan:
    period = rebalance.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    tick = rebalance.rebalance_tick(cluster_id=cluster.pk, period_start=period)
    return Plan.objects.get(tick=tick)


def drive(plan: Plan) -> None:
    for _ in range(200):
        telemetry_fresh()
        if rebalance.plan_apply_step(plan_id=plan.pk)[0] in ("done", "idle"):
            return


def state() -> tuple:
    return (
        list(Plan.objects.order_by("pk").values_list("status", "version")),
        ChangeRecord.objects.count(),
        Policy.objects.count(),
        roles(),
    )


def test_plans_are_listed_and_read_with_predictions_and_steps(client: Client, fleet, reader):
    plan = proposed(fleet)
    listed = client.get("/api/v1/plans", headers=reader).json()
    assert listed["count"] == 1 and listed["items"][0]["id"] == plan.pk
    assert client.get("/api/v1/plans?status=applied", headers=reader).json()["count"] == 0
    detail = client.get(f"/api/v1/plans/{plan.pk}", headers=reader).json()
    assert detail["status"] == "proposed"
    assert detail["predictions"]["proposed"]["capacity_rps"] > 0
    assert detail["inputs"]["window"]["arrivals"] > 0
    assert detail["steps"] == []


def test_an_operator_approves_and_the_plan_applies(client: Client, fleet, operator):
    plan = proposed(fleet)
    response = client.post(
        f"/api/v1/plans/{plan.pk}/approve?version={plan.version}", headers=operator
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "applying" and body["approved_by"].startswith("token:")
    assert [s["action"] for s in body["steps"]][-1] == "policy"
    drive(plan)
    assert client.get(f"/api/v1/plans/{plan.pk}", headers=operator).json()["status"] == "applied"


def test_reject_then_rollback_is_a_conflict_with_the_error_shape(client: Client, fleet, operator):
    plan = proposed(fleet)
    assert client.post(f"/api/v1/plans/{plan.pk}/reject", headers=operator).json()["status"] == (
        "rejected"
    )
    before = state()
    response = client.post(f"/api/v1/plans/{plan.pk}/rollback", headers=operator)
    assert response.status_code == 409
    assert response.json() == {
        "detail": f"plan {plan.pk} is rejected: it cannot be rolled back",
        "code": "illegal_transition",
    }
    assert state() == before


def test_approving_an_applied_plan_is_a_conflict_and_changes_nothing(
    client: Client, fleet, operator
):
    plan = proposed(fleet)
    client.post(f"/api/v1/plans/{plan.pk}/approve", headers=operator)
    drive(plan)
    before = state()
    response = client.post(f"/api/v1/plans/{plan.pk}/approve", headers=operator)
    assert response.status_code == 409
    assert set(response.json()) == {"detail", "code"}
    assert response.json()["code"] == "illegal_transition"
    assert state() == before
    rolled = client.post(f"/api/v1/plans/{plan.pk}/rollback", headers=operator)
    assert rolled.status_code == 200 and rolled.json()["status"] == "rolling_back"


def test_a_read_token_cannot_approve_reject_roll_back_or_run(client: Client, fleet, reader):
    plan = proposed(fleet)
    before = state()
    for path in ("approve", "reject", "rollback"):
        response = client.post(f"/api/v1/plans/{plan.pk}/{path}", headers=reader)
        assert response.status_code == 403
        assert response.json()["code"] == "forbidden"
    assert client.post("/api/v1/rebalance", headers=reader).status_code == 403
    assert client.post(f"/api/v1/plans/{plan.pk}/approve").status_code == 401
    assert state() == before


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("get", "/api/v1/plans/999999", 404, "not_found"),
        ("post", "/api/v1/plans/999999/approve", 404, "not_found"),
        ("get", "/api/v1/plans/abc", 422, "invalid"),
        ("get", "/api/v1/plans/0", 422, "invalid"),
        ("get", "/api/v1/plans/99999999999999999999999", 422, "invalid"),
        ("post", "/api/v1/plans/99999999999999999999999/reject", 422, "invalid"),
        ("post", "/api/v1/plans/{id}/reject?version=99999999999999", 422, "invalid"),
        ("get", "/api/v1/plans?status=sideways", 422, "invalid"),
        ("get", "/api/v1/plans?limit=0", 422, "invalid"),
        ("post", "/api/v1/plans/{id}/approve?version=0", 422, "invalid"),
        ("post", "/api/v1/plans/{id}/approve?version=x", 422, "invalid"),
        ("post", "/api/v1/plans/{id}/approve?version=999", 409, "stale_version"),
        ("post", "/api/v1/rebalance?cluster=nowhere", 404, "not_found"),
        ("post", "/api/v1/rebalance?cluster=prfaas-h200", 422, "invalid"),
        ("post", "/api/v1/rebalance?cluster=", 422, "invalid"),
    ],
)
def test_bad_requests_get_a_clear_error(
    client: Client, fleet, operator, method, path, status, code
):
    plan = proposed(fleet)
    before = state()
    response = getattr(client, method)(path.format(id=plan.pk), headers=operator)
    assert response.status_code == status, response.content
    assert response.json()["code"] == code and response.json()["detail"]
    assert state() == before


def test_run_now_ticks_every_pd_cluster_and_reports_holds(client: Client, fleet, operator):
    telemetry_fresh()
    response = client.post("/api/v1/rebalance", headers=operator)
    assert response.status_code == 200
    [tick] = response.json()["ticks"]
    assert tick["cluster"] == "pd-h20"
    assert (tick["action"], tick["reason"]) == ("hold", "no_traffic")
    assert RebalanceTick.objects.count() == 1


def test_run_now_proposes_on_drifted_traffic(client: Client, fleet, operator):
    traffic_record(time.time(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    [tick] = client.post("/api/v1/rebalance?cluster=pd-h20", headers=operator).json()["ticks"]
    assert tick["action"] == "propose" and tick["plan_id"]
    assert Plan.objects.get(pk=tick["plan_id"]).status == PlanStatus.PROPOSED


def test_the_schema_knows_every_plan_status():
    from typing import get_args

    from scheduling.api.plans import StatusName

    assert set(get_args(StatusName)) == set(PlanStatus.values)


def test_settings_are_read_and_patched_by_an_admin(client: Client, fleet, reader):
    admin = bearer(api_token("admin")[1])
    got = client.get("/api/v1/rebalance/settings/pd-h20", headers=reader).json()
    assert got["mode"] == "manual" and got["effective_guards"]["dead_band"] == 0.05
    response = client.patch(
        "/api/v1/rebalance/settings/pd-h20",
        data={
            "mode": "auto",
            "guards": {"dead_band": 0.08},
            "actuator": "webhook",
            "webhook_url": "http://automation.example/prfaas",
            "webhook_secret": "s3",
        },
        content_type="application/json",
        headers=admin,
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["mode"], body["effective_guards"]["dead_band"]) == ("auto", 0.08)
    assert body["webhook_secret_set"] is True and "s3" not in response.content.decode()
    assert ChangeRecord.objects.filter(object_type="scheduling.rebalancesettings").count() == 1


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"mode": "yolo"}, 422, "mode"),
        ({"mode": None}, 422, "mode"),
        ({"guards": {"dead_bnad": 0.1}}, 422, "dead_bnad"),
        ({"guards": {"persist_ticks": 1.5}}, 422, "persist_ticks"),
        ({"guards": {"dead_band": -1}}, 422, "dead_band"),
        ({"guards": {"max_change_fraction": 3}}, 422, "max_change_fraction"),
        ({"guards": {"dead_band": None}}, 422, "dead_band"),
        ({"drain_timeout_s": 0}, 422, "drain_timeout_s"),
        ({"actuator": "webhook"}, 422, "webhook"),
        ({"actuator": "webhook", "webhook_url": "ftp://x", "webhook_secret": "k"}, 422, "webhook"),
        ({"actuator": "pigeon"}, 422, "actuator"),
    ],
)
def test_bad_settings_get_a_clear_error_and_change_nothing(
    client: Client, fleet, body, status, needle
):
    admin = bearer(api_token("admin")[1])
    before = client.get("/api/v1/rebalance/settings/pd-h20", headers=admin).json()
    response = client.patch(
        "/api/v1/rebalance/settings/pd-h20",
        data=body,
        content_type="application/json",
        headers=admin,
    )
    assert response.status_code == status, response.content
    assert needle in response.json()["detail"] and response.json()["code"]
    assert client.get("/api/v1/rebalance/settings/pd-h20", headers=admin).json() == before


def test_settings_need_the_admin_scope_and_a_pd_cluster(client: Client, fleet, operator):
    response = client.patch(
        "/api/v1/rebalance/settings/pd-h20",
        data={"mode": "auto"},
        content_type="application/json",
        headers=operator,
    )
    assert response.status_code == 403
    assert client.get("/api/v1/rebalance/settings/nowhere", headers=operator).status_code == 404
    assert client.get("/api/v1/rebalance/settings/prfaas-h200", headers=operator).status_code == 422


def test_recent_ticks_show_holds_with_their_reasons(client: Client, fleet, operator, reader):
    telemetry_fresh()
    client.post("/api/v1/rebalance", headers=operator)
    proposed(fleet)
    ticks = client.get("/api/v1/rebalance/ticks", headers=reader).json()["ticks"]
    # Newest first: the run-now tick (id: now) after the proposal of the current period.
    assert [(t["action"], t["reason"]) for t in ticks] == [
        ("hold", "no_traffic"),
        ("propose", "gain"),
    ]
    assert ticks[1]["plan_id"] is not None
    holds = client.get("/api/v1/rebalance/ticks?action=hold", headers=reader).json()["ticks"]
    assert [t["reason"] for t in holds] == ["no_traffic"] and holds[0]["detail"]
    bad = client.get("/api/v1/rebalance/ticks?action=maybe", headers=reader)
    assert bad.status_code == 422 and bad.json()["code"] == "invalid"
