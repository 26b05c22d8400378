"""Inventory pages: clusters, instances (drain and activate by role), links."""

from __future__ import annotations

import time
from typing import cast

import pytest
from django.urls import reverse
from django.utils import timezone

from clusters.live import telemetry
from clusters.models import Instance, Link
from controlplane.models import ChangeRecord
from controlplane.redis_connection import redis_sync
from scheduling import traffic
from scheduling.models import PlanStatus
from scheduling.overview import overview_snapshot
from scheduling.rebalance.selectors import PREDICTED_REFUSAL_KEY
from tests.factories import InstanceFactory, LinkFactory, PlanFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


def _instance(**kwargs: object) -> Instance:
    return cast(Instance, InstanceFactory(**kwargs))


def test_the_cluster_list_shows_roles_states_and_live_load(client_as) -> None:
    inst = _instance(name="pd-a-0", role="decode")
    telemetry.telemetry_batch_store(
        [telemetry.InstanceSample(instance="pd-a-0", ts=time.time(), queue_depth=7, running=3)], []
    )
    response = client_as("viewer").get(reverse("cluster-list"))
    row = next(c for c in response.context["clusters"] if c["id"] == inst.cluster_id)
    assert (row["decode"], row["active"], row["queued"], row["running"]) == (1, 1, 7, 3)


def test_the_cluster_page_lists_its_instances(client_as) -> None:
    inst = _instance(name="pd-a-0")
    page = client_as("viewer").get(reverse("cluster-detail", args=[inst.cluster_id])).content
    assert b"pd-a-0" in page


def test_the_cluster_page_shows_a_registered_instance_gone_unreachable(client_as) -> None:
    inst = _instance(name="pd-a-9", origin="registered", engine="vllm", state="unreachable")
    page = client_as("viewer").get(reverse("cluster-detail", args=[inst.cluster_id])).content
    assert b'<span class="badge badge-unreachable">unreachable</span>' in page
    assert b'title="registered by its agent: vllm">registered</small>' in page


def test_an_unknown_cluster_is_404(client_as) -> None:
    assert client_as("viewer").get(reverse("cluster-detail", args=[999999])).status_code == 404


def test_a_viewer_sees_no_drain_button(client_as) -> None:
    inst = _instance(name="pd-a-0")
    page = client_as("viewer").get(reverse("cluster-detail", args=[inst.cluster_id])).content
    assert b'data-action="drain"' not in page


def test_an_operator_sees_a_drain_button_that_asks_first(client_as) -> None:
    inst = _instance(name="pd-a-0")
    page = client_as("operator").get(reverse("cluster-detail", args=[inst.cluster_id]))
    html = page.content.decode()
    assert 'data-action="drain"' in html
    assert "hx-confirm=" in html


def test_a_viewer_posting_a_drain_gets_403_and_the_instance_stays_active(client_as) -> None:
    inst = _instance(name="pd-a-0")
    response = client_as("viewer").post(reverse("instance-state", args=[inst.pk, "drain"]))
    assert response.status_code == 403
    inst.refresh_from_db()
    assert inst.state == "active"


def test_an_operator_drains_and_reactivates_an_instance(client_as) -> None:
    inst = _instance(name="pd-a-0")
    client = client_as("operator")
    response = client.post(reverse("instance-state", args=[inst.pk, "drain"]))
    assert response.status_code == 200
    assert 'data-action="activate"' in response.content.decode()
    inst.refresh_from_db()
    assert inst.state == "draining"
    client.post(reverse("instance-state", args=[inst.pk, "activate"]))
    inst.refresh_from_db()
    assert inst.state == "active"
    actions = ChangeRecord.objects.filter(object_id=str(inst.pk)).values_list("action", flat=True)
    assert {"drain", "activate"} <= set(actions)


def test_a_drain_with_a_stale_version_is_refused_with_the_reason(client_as) -> None:
    inst = _instance(name="pd-a-0")
    response = client_as("operator").post(
        reverse("instance-state", args=[inst.pk, "drain"]), {"version": inst.version + 5}
    )
    assert response.status_code == 409
    assert 'role="alert"' in response.content.decode()
    inst.refresh_from_db()
    assert inst.state == "active"


def test_an_unknown_action_or_instance_is_404(client_as) -> None:
    inst = _instance(name="pd-a-0")
    client = client_as("operator")
    assert client.post(f"/instances/{inst.pk}/delete/").status_code == 404
    assert client.post(reverse("instance-state", args=[999999, "drain"])).status_code == 404


def test_draining_needs_a_post(client_as) -> None:
    inst = _instance(name="pd-a-0")
    response = client_as("operator").get(reverse("instance-state", args=[inst.pk, "drain"]))
    assert response.status_code == 405


def test_the_link_page_shows_history_and_congestion_events(client_as) -> None:
    link = cast(Link, LinkFactory(gbps=10.0))
    key = link.key
    now = int(time.time()) - 5
    samples = [
        telemetry.LinkSample(link=key, ts=now + i, bytes_sent=int(gbps * 1e9 / 8), interval_s=1.0)
        for i, gbps in enumerate([1.0, 9.5, 9.9, 2.0])
    ]
    telemetry.telemetry_batch_store([], samples)
    response = client_as("viewer").get(reverse("link-detail", args=[link.pk]))
    history = response.context["link"]
    assert len(history["series"]) == 4
    assert [(e["duration_s"], round(e["peak_gbps"], 1)) for e in history["congestion"]] == [
        (2, 9.9)
    ]


def test_the_link_list_shows_capacity_and_budget(client_as) -> None:
    LinkFactory(gbps=100.0)
    links = client_as("viewer").get(reverse("link-list")).context["links"]
    assert links[0]["capacity_gbps"] == 100.0
    assert 0 < links[0]["budget_gbps"] < 100.0


def _guard_decisions(link: Link, carried: int, budget: int, saturation: int) -> None:
    """Decisions at the link's PD cluster as the route path records them."""
    key = link.key
    now = time.time()
    records = [
        traffic.TrafficRecord(
            link.target.name, now, "prfaas", "above_threshold", 30000, 0, link=key
        )
        for _ in range(carried)
    ] + [
        traffic.TrafficRecord(
            link.target.name, now, "local", "link_congested", 30000, 0, refusal=f"{key}:{cause}"
        )
        for cause, n in (("budget", budget), ("saturation", saturation))
        for _ in range(n)
    ]
    aggregate = traffic.TrafficAggregate()
    for record in records:
        aggregate.add(record)
    pipe = redis_sync().pipeline()
    aggregate.queue(pipe)
    pipe.execute()


def test_the_link_page_and_the_overview_show_the_share_the_link_guard_kept_local_and_why(
    client_as,
) -> None:
    link = cast(Link, LinkFactory(gbps=8.0))
    _guard_decisions(link, carried=30, budget=6, saturation=4)
    viewer = client_as("viewer")
    page = viewer.get(reverse("link-detail", args=[link.pk]))
    recent = page.context["link"]["guard"][0]
    assert (recent["offloads"], recent["refused_budget"], recent["refused_saturation"]) == (
        30,
        6,
        4,
    )
    assert recent["refused_share"] == pytest.approx(10 / 40)
    assert 300 <= recent["window_s"] <= 360  # the last 5 minutes, counted in whole minutes
    html = page.content.decode()
    assert "25%" in html and f"no plan applied to {link.target.name} yet" in html

    snapshot = overview_snapshot()
    (shown,) = [row for row in snapshot["links"] if row["id"] == link.pk]
    assert shown["guard"]["refused_share"] == pytest.approx(0.25)
    assert shown["guard"]["predicted_refused_share"] is None


def test_the_link_page_shows_what_the_plan_in_force_predicted_for_the_guard(client_as) -> None:
    link = cast(Link, LinkFactory(gbps=8.0))
    _guard_decisions(link, carried=9, budget=1, saturation=0)
    predictions = {"proposed": {PREDICTED_REFUSAL_KEY: 0.2}}
    plan = PlanFactory(
        tick__cluster=link.target,
        status=PlanStatus.APPLIED,
        applied_at=timezone.now(),
        predictions=predictions,
    )
    html = client_as("viewer").get(reverse("link-detail", args=[link.pk])).content.decode()
    assert "<strong>20%</strong> (plan" in html and f"#{plan.pk}" in html
    (shown,) = [r for r in overview_snapshot()["links"] if r["id"] == link.pk]
    assert shown["guard"]["predicted_refused_share"] == pytest.approx(0.2)
    assert shown["guard"]["refused_share"] == pytest.approx(0.1)


def test_the_overview_says_when_its_rates_are_in_a_faster_fleet_clock(client_as, settings) -> None:
    assert 'id="fleet-clock"' not in client_as("viewer").get(reverse("overview")).content.decode()
    settings.FLEET_CLOCK_SPEED = 4.0
    page = client_as("viewer").get(reverse("overview")).content.decode()
    assert "the fleet&#x27;s clock, which runs 4x the wall clock here" in page or (
        "the fleet's clock, which runs 4x the wall clock here" in page
    )
