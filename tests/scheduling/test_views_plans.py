"""Plan pages: predicted against current, approve/reject/roll back by role, bad requests."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.urls import reverse

from controlplane.redis_connection import redis_sync
from scheduling.models import Plan, PlanStatus
from scheduling.traffic import TrafficRecord, traffic_record_queue
from tests.scheduling.plan_pages_support import proposed_plan

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


@pytest.fixture
def plan(scenarios_dir: Path) -> Plan:
    return proposed_plan(scenarios_dir)


def test_the_plan_list_shows_proposed_plans(client_as, plan: Plan) -> None:
    page = client_as("viewer").get(reverse("plan-list")).content.decode()
    assert f'data-plan-status="{plan.pk}">proposed<' in page


def test_filtering_plans_by_an_unknown_status_says_which_are_valid(client_as, plan) -> None:
    response = client_as("viewer").get(reverse("plan-list"), {"status": "done"})
    assert response.status_code == 422
    assert "status: must be one of" in response.content.decode()


def test_the_plan_page_compares_predicted_with_current(client_as, plan: Plan) -> None:
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    rows = {row["label"]: row for row in response.context["comparison"]}
    current, proposed = plan.predictions["current"], plan.predictions["proposed"]
    assert rows["Throughput"]["current"] == current["throughput_rps"]
    assert rows["Throughput"]["proposed"] == proposed["throughput_rps"]
    assert rows["Capacity"]["delta"] == pytest.approx(
        proposed["capacity_rps"] - current["capacity_rps"]
    )


def test_a_viewer_gets_no_approve_button_and_403_when_posting(client_as, plan: Plan) -> None:
    client = client_as("viewer")
    page = client.get(reverse("plan-detail", args=[plan.pk])).content.decode()
    assert 'data-action="approve"' not in page
    response = client.post(reverse("plan-action", args=[plan.pk, "approve"]))
    assert response.status_code == 403
    plan.refresh_from_db()
    assert plan.status == PlanStatus.PROPOSED


def test_an_operator_sees_approve_and_reject_that_ask_first(client_as, plan: Plan) -> None:
    page = client_as("operator").get(reverse("plan-detail", args=[plan.pk])).content.decode()
    assert 'data-action="approve"' in page and 'data-action="reject"' in page
    assert page.count("hx-confirm=") == 2
    assert 'data-action="roll-back"' not in page


def test_rejecting_a_plan_answers_with_its_new_panel(client_as, plan: Plan) -> None:
    response = client_as("operator").post(
        reverse("plan-action", args=[plan.pk, "reject"]), {"version": plan.version}
    )
    assert response.status_code == 200
    assert 'id="plan-status">rejected<' in response.content.decode()
    plan.refresh_from_db()
    assert plan.status == PlanStatus.REJECTED


def test_acting_on_a_stale_version_is_refused_with_the_reason(client_as, plan: Plan) -> None:
    response = client_as("operator").post(
        reverse("plan-action", args=[plan.pk, "approve"]), {"version": plan.version + 1}
    )
    assert response.status_code == 409
    assert f"is at version {plan.version}" in response.content.decode()
    plan.refresh_from_db()
    assert plan.status == PlanStatus.PROPOSED


def test_rolling_back_a_plan_that_is_not_applied_is_refused(client_as, plan: Plan) -> None:
    response = client_as("operator").post(reverse("plan-action", args=[plan.pk, "rollback"]))
    assert response.status_code == 409
    assert "cannot be rolled back" in response.content.decode()


def test_an_unknown_plan_or_action_is_404(client_as, plan: Plan) -> None:
    client = client_as("operator")
    assert client.get(reverse("plan-detail", args=[999999])).status_code == 404
    assert client.post(reverse("plan-action", args=[999999, "approve"])).status_code == 404
    assert client.post(f"/plans/{plan.pk}/delete/").status_code == 404


def test_the_plan_page_shows_predicted_and_simulated_figures_side_by_side(
    client_as, plan: Plan
) -> None:
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    assert plan.simulated["confirmed"] is True
    rows = response.context["simulated"]
    assert rows, "a proposed plan was simulated before it was shown"
    p90 = [r for r in rows if r["label"] == "TTFT P90"]
    assert p90
    situation = "stress" if plan.simulated.get("stress") else "observed"
    assert p90[-1]["proposed"] == plan.simulated[situation]["proposed"]["ttft_p90_s"]
    assert p90[-1]["current"] == plan.simulated[situation]["current"]["ttft_p90_s"]
    page = response.content.decode()
    assert "Simulated on the recent traffic" in page
    assert plan.simulated["detail"] in page


def test_rejecting_from_the_page_keeps_the_reason_and_shows_it(client_as, plan: Plan) -> None:
    response = client_as("operator").post(
        reverse("plan-action", args=[plan.pk, "reject"]),
        {"version": plan.version, "reason": "drains during the evening peak"},
    )
    assert "Rejected: drains during the evening peak" in response.content.decode()
    plan.refresh_from_db()
    assert plan.closed_reason == "drains during the evening peak"


def test_an_applied_plan_shows_predicted_simulated_and_observed_figures(
    client_as, plan: Plan
) -> None:
    applied = time.time() - 150
    Plan.objects.filter(pk=plan.pk).update(
        status=PlanStatus.APPLIED, applied_at=datetime.fromtimestamp(applied, tz=UTC)
    )
    pipe = redis_sync().pipeline()
    for i in range(60):  # one offload a second, starting just after the apply
        record = TrafficRecord(
            origin=plan.cluster.name,
            ts=applied + 1 + i,
            route="prfaas",
            reason="above_threshold",
            incremental_tokens=20_000,
            cached_tokens=0,
        )
        traffic_record_queue(pipe, record, None)
    pipe.execute()
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    rows = {r["label"]: r for r in response.context["outcome"]}
    throughput = rows["Throughput"]
    assert throughput["predicted"] == plan.predictions["proposed"]["throughput_rps"]
    run = (plan.simulated.get("observed") or plan.simulated["stress"])["proposed"]
    assert throughput["simulated"] == run["rate_rps"] * run["sustained_fraction"]
    assert rows["TTFT P90"]["simulated"] == run["ttft_p90_s"]
    counted_from = math.ceil(applied / 60) * 60  # the traffic store's whole minutes
    after = sum(1 for i in range(60) if applied + 1 + i >= counted_from)
    assert throughput["observed"] == pytest.approx(after / (time.time() - counted_from), rel=0.05)
    assert rows["Offloaded"]["observed"] == 1.0
    assert "Observed over the" in response.content.decode()


def test_the_plan_list_shows_the_rebalancers_reasoning_per_tick(client_as, plan: Plan) -> None:
    page = client_as("viewer").get(reverse("plan-list")).content.decode()
    assert "The rebalancer&#x27;s reasoning" in page or "The rebalancer's reasoning" in page
    assert f"<code>{plan.tick.reason}</code>" in page
