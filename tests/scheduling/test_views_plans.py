"""Plan pages: predicted against current, approve/reject/roll back by role, bad requests."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.urls import reverse

from clusters.live.keys import traffic_key
from controlplane.redis_connection import redis_sync
from scheduling.alerts import Reading, readings_store
from scheduling.core.link import link_key
from scheduling.core.service_levels import TTFT_BUCKETS_S, ttft_bucket
from scheduling.models import Plan, PlanStatus
from scheduling.traffic import TrafficRecord, traffic_record_queue
from tests.factories import PlanFactory
from tests.scheduling.plan_pages_support import proposed_plan

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("route_state_clean")]


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
    rows = {row["key"]: row for row in response.context["comparison"]}
    current, proposed = plan.predictions["current"], plan.predictions["proposed"]
    assert rows["throughput_rps"]["current"] == current["throughput_rps"]
    assert rows["throughput_rps"]["proposed"] == proposed["throughput_rps"]
    assert rows["capacity_rps"]["delta"] == pytest.approx(
        proposed["capacity_rps"] - current["capacity_rps"]
    )
    window = plan.inputs["window"]
    planned = response.context["planned"]
    assert planned["arrivals"] == window["arrivals"]
    assert planned["offered_rps"] == pytest.approx(
        window["arrivals"] / (window["end_s"] - window["start_s"])
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
    assert response.context["verdict"].startswith("Confirmed: ")
    assert "{#" not in page and "#}" not in page


def test_each_outcome_row_compares_one_quantity_over_stated_windows(client_as, plan) -> None:
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    rows = {r.key: r for r in response.context["outcome"]}
    planned = response.context["planned"]
    # The check ran at the planned rate (alone: the current capacity is below it).
    run = (plan.simulated["observed"] or plan.simulated["stress"])["proposed"]
    # Offered rate against offered rate: what was planned for, what was simulated.
    assert rows["offered_rps"].predicted.value == pytest.approx(planned["offered_rps"])
    assert rows["offered_rps"].simulated.value == pytest.approx(run["rate_rps"])
    assert rows["offered_rps"].simulated.value == pytest.approx(planned["offered_rps"], rel=0.02)
    # Served against served, P90 at that rate against P90 at that rate.
    proposed = plan.predictions["proposed"]
    assert rows["carried_rps"].predicted.value == proposed["throughput_rps"]
    assert rows["carried_rps"].simulated.value == pytest.approx(
        run["rate_rps"] * run["sustained_fraction"]
    )
    assert rows["ttft_p90_s"].predicted.value == proposed["at_rate_ttft_p90_s"]
    assert rows["ttft_p90_s"].simulated.value == run["ttft_p90_s"]
    # Not applied: every observed cell says so; the windows say what each column covers.
    assert {r.observed.note for r in rows.values()} == {"not applied"}
    windows = response.context["windows"]
    assert planned["start_utc"] in windows["predicted"]
    assert f"{planned['arrivals']} requests" in windows["predicted"]
    assert f"{run['requests']} requests drawn from that traffic" in windows["simulated"]


def test_a_simulation_at_a_rate_no_setting_carries_says_so(client_as) -> None:
    def run(rate: float, sustained: float, p90: float) -> dict[str, float | int | bool]:
        return {
            "rate_rps": rate,
            "requests": 2000,
            "sustained_fraction": sustained,
            "ttft_mean_s": p90 / 2,
            "ttft_p90_s": p90,
            "link_congested": 0.0,
            "stable": False,
        }

    # The page's example: 12.1 req/s offered against a predicted capacity of 1.9.
    plan = PlanFactory(
        predictions={"current": {"capacity_rps": 1.9}, "proposed": {"capacity_rps": 3.6}},
        simulated={
            "confirmed": True,
            "reason": "confirmed",
            "detail": "the simulation confirms the gain",
            "observed": None,
            "stress": {"current": run(12.1, 0.16, 623.0), "proposed": run(12.1, 0.20, 341.0)},
        },
        inputs={"window": {"start_s": 0.0, "end_s": 600.0, "arrivals": 7260}},
    )
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    verdict = response.context["verdict"]
    assert verdict.startswith("Overloaded: at 12.10 req/s offered, more than either setting")
    assert "the proposal carries 2.42 req/s against 1.94 now" in verdict
    page = response.content.decode()
    assert "confirms the gain" not in page
    rows = {r.key: r for r in response.context["outcome"]}
    assert rows["ttft_p90_s"].predicted.note == "overloaded: no steady state"
    assert rows["ttft_p90_s"].simulated.flag == "overloaded run"


def test_rejecting_from_the_page_keeps_the_reason_and_shows_it(client_as, plan: Plan) -> None:
    response = client_as("operator").post(
        reverse("plan-action", args=[plan.pk, "reject"]),
        {"version": plan.version, "reason": "drains during the evening peak"},
    )
    assert "Rejected: drains during the evening peak" in response.content.decode()
    plan.refresh_from_db()
    assert plan.closed_reason == "drains during the evening peak"


def _applied(plan: Plan, seconds_ago: float) -> float:
    applied = time.time() - seconds_ago
    Plan.objects.filter(pk=plan.pk).update(
        status=PlanStatus.APPLIED, applied_at=datetime.fromtimestamp(applied, tz=UTC)
    )
    plan.refresh_from_db()
    return applied


def _decisions(plan: Plan, start: float, n: int, per_s: float) -> None:
    """``n`` decisions at the plan's cluster from ``start`` on: one in four link_congested
    (kept local by the link's budget), the others offloaded over its link."""
    link = link_key("prfaas-h200", plan.cluster.name)
    pipe = redis_sync().pipeline()
    for i in range(n):
        refused = i % 4 == 0
        record = TrafficRecord(
            origin=plan.cluster.name,
            ts=start + i / per_s,
            route="local" if refused else "prfaas",
            reason="link_congested" if refused else "above_threshold",
            incremental_tokens=20_000,
            cached_tokens=0,
            link="" if refused else link,
            refusal=f"{link}:budget" if refused else "",
        )
        traffic_record_queue(pipe, record, None)
    pipe.execute()


def _traffic_cleared(plan: Plan, start: float) -> None:
    """The plan's cluster's traffic minutes from ``start`` to now, emptied. The plan fixture
    records the traffic it was planned on in the rebalancer's current period, which may begin
    after a back-dated apply: without this, those requests would count as observed after it."""
    minutes = range(math.floor(start / 60), math.floor(time.time() / 60) + 2)
    redis_sync().delete(*(traffic_key(plan.cluster.name, m) for m in minutes))


def _served(plan: Plan, start: float, seconds: int, per_s: int) -> None:
    """The engines' service counters as the overview tick stores them, every 2 s: ``per_s``
    requests a second, each with its first token 1.2 s after it arrived."""
    bucket = ttft_bucket(1.2)
    for k in range(0, seconds + 1, 2):
        buckets = [0] * (len(TTFT_BUCKETS_S) + 1)
        buckets[bucket] = per_s * k
        counters = [start + k, per_s * k, per_s * k, buckets]
        readings_store(
            Reading(ts=start + k, queues={}, links={}, service={plan.cluster.name: counters})
        )


def test_an_applied_plan_shows_not_enough_data_until_its_window_means_something(
    client_as, plan: Plan
) -> None:
    applied = _applied(plan, seconds_ago=30)
    _decisions(plan, applied + 1, n=40, per_s=2.0)
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    rows = {r.key: r for r in response.context["outcome"]}
    assert {r.observed.note for r in rows.values()} == {"not enough data"}
    assert "not enough data" in response.content.decode()


def test_an_applied_plan_shows_observed_figures_of_the_same_quantities(
    client_as, plan: Plan, settings
) -> None:
    applied = _applied(plan, seconds_ago=200)
    counted_from = math.ceil(applied / 60) * 60  # the traffic store's whole minutes
    _traffic_cleared(plan, counted_from)
    _decisions(plan, counted_from, n=300, per_s=3.0)
    _served(plan, counted_from, seconds=100, per_s=3)
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    rows = {r.key: r for r in response.context["outcome"]}
    observed = response.context["observed"]
    assert observed["start"] == counted_from and observed["arrivals"] == 300
    assert rows["offered_rps"].observed.value == pytest.approx(
        300 / (time.time() - counted_from), rel=0.05
    )
    assert rows["offload_fraction"].observed.value == pytest.approx(0.75)
    assert rows["link_congested"].observed.value == pytest.approx(0.25)
    assert rows["refused_share"].observed.value == pytest.approx(0.25)
    # What the engines served over their reports inside the window: 3 first tokens a second,
    # every one within the 1.0-1.5 s bucket.
    assert rows["carried_rps"].observed.value == pytest.approx(3.0)
    assert 1.0 <= (rows["ttft_p90_s"].observed.value or 0) <= 1.5
    assert (
        "from the first whole minute after the apply, 300 requests"
        in (response.context["windows"]["observed"])
    )

    # An emulated fleet four times faster than the wall clock: rates read in its clock.
    settings.FLEET_CLOCK_SPEED = 4.0
    response = client_as("viewer").get(reverse("plan-detail", args=[plan.pk]))
    fleet = {r.key: r for r in response.context["outcome"]}
    assert fleet["offered_rps"].observed.value == pytest.approx(
        rows["offered_rps"].observed.value / 4, rel=0.05
    )
    assert fleet["carried_rps"].observed.value == pytest.approx(0.75)
    assert "runs 4x the wall clock here" in response.content.decode()


def test_the_plan_list_shows_the_rebalancers_reasoning_per_tick(client_as, plan: Plan) -> None:
    page = client_as("viewer").get(reverse("plan-list")).content.decode()
    assert "The rebalancer&#x27;s reasoning" in page or "The rebalancer's reasoning" in page
    assert f"<code>{plan.tick.reason}</code>" in page
