"""The operator UI in a real browser: login, the live overview, what-if runs, roles.

(The screenshots in docs/screenshots/ come from the live demo: tests/browser/test_demo_ui.py.)"""

from __future__ import annotations

import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import httpx
import pytest
from django.db import connection

from clusters.models import Instance, Link
from tests.factories import InstanceFactory, LinkFactory, PrfaasClusterFactory, api_token
from tests.scheduling.plan_pages_support import proposed_plan

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _fleet() -> tuple[Link, list[Instance]]:
    link = cast(Link, LinkFactory(source=PrfaasClusterFactory(name="prfaas-h200"), gbps=100.0))
    instances = [
        cast(
            Instance, InstanceFactory(cluster=link.source, name=f"prfaas-h200-{i}", role="prefill")
        )
        for i in range(2)
    ] + [
        cast(Instance, InstanceFactory(cluster=link.target, name=f"pd-h20-{i}", role=role))
        for i, role in enumerate(["prefill", "decode"])
    ]
    return link, instances


def _post_telemetry(live_url: str, secret: str, link: Link, gbps: float, queue: int) -> None:
    now = time.time()
    body = {
        "idempotency_key": uuid.uuid4().hex,
        "links": [
            {
                "source": link.source.name,
                "target": link.target.name,
                "ts": now,
                "bytes_sent": int(gbps * 1e9 / 8),
                "interval_s": 1.0,
            }
        ],
        "instances": [{"instance": "prfaas-h200-0", "ts": now, "queue_depth": queue, "running": 2}],
    }
    _telemetry_post(live_url, secret, body)


def _telemetry_post(live_url: str, secret: str, body: dict[str, Any]) -> None:
    response = httpx.post(
        f"{live_url}/api/v1/telemetry",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=5,
    )
    assert response.status_code == 200, response.text


def _plan_proposed(scenarios_dir: Any) -> Any:
    # In a thread of its own: the rebalancer publishes live events from sync code, which cannot
    # run on this thread while Playwright's event loop is registered here.
    def propose() -> Any:
        try:
            return proposed_plan(scenarios_dir)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(propose).result()


def _post_history(live_url: str, secret: str, link: Link, seconds: int) -> None:
    now = int(time.time())
    body = {
        "idempotency_key": uuid.uuid4().hex,
        "links": [
            {
                "source": link.source.name,
                "target": link.target.name,
                "ts": float(now - seconds + i),
                # A day-like swell between 20 and 60 Gbps.
                "bytes_sent": int((40 + 20 * math.sin(i / 25)) * 1e9 / 8),
                "interval_s": 1.0,
            }
            for i in range(seconds)
        ],
    }
    _telemetry_post(live_url, secret, body)


def _csrf_post(page: Any, live_url: str, path: str, data: dict[str, str] | None = None) -> Any:
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    return page.request.post(
        f"{live_url}{path}",
        form=data or {},
        headers={"X-CSRFToken": cookies["csrftoken"], "Referer": f"{live_url}/"},
    )


def test_the_overview_link_chart_moves_within_two_seconds_of_posted_telemetry(
    page_as: Any, live_url: str
) -> None:
    link, _ = _fleet()
    _, secret = api_token("agent")
    page = page_as("viewer")
    page.wait_for_function("document.getElementById('live-status').textContent === 'Live'")
    chart = page.locator("#link-chart")
    assert chart.get_attribute("data-points") == "0"

    _post_telemetry(live_url, secret, link, gbps=42.0, queue=5)
    started = time.monotonic()
    page.wait_for_function(
        "document.getElementById('link-chart').dataset.points !== '0'", timeout=2000
    )
    assert time.monotonic() - started < 2.0
    page.wait_for_function(
        "document.querySelector('.link-gbps').textContent.startsWith('42.00')", timeout=2000
    )
    # More samples keep the chart moving, without a reload: three minutes of history at once.
    points = int(chart.get_attribute("data-points") or 0)
    _post_history(live_url, secret, link, seconds=180)
    page.wait_for_function(
        f"Number(document.getElementById('link-chart').dataset.points) > {points + 100}"
    )
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: the layout reflows
    page.wait_for_timeout(300)
    widest = page.evaluate(
        """[...document.querySelectorAll('body *')]
             .map(e => [e.getBoundingClientRect().right, e.tagName + '.' + e.className])
             .sort((a, b) => b[0] - a[0]).slice(0, 5)"""
    )
    assert page.evaluate("document.documentElement.scrollWidth") <= 390 + 1, widest


def test_an_operator_drains_an_instance_after_confirming_without_a_reload(
    page_as: Any, live_url: str
) -> None:
    link, instances = _fleet()
    page = page_as("operator")
    page.goto(f"{live_url}/clusters/{link.target_id}/")
    page.evaluate("window.__notReloaded = true")
    row = page.locator(f"#instance-{instances[2].pk}")
    row.get_by_role("button", name="Drain").click()
    row.locator(".badge-draining").wait_for()
    assert page.evaluate("window.__notReloaded") is True
    instances[2].refresh_from_db()
    assert instances[2].state == "draining"


def test_a_viewer_gets_no_drain_button_and_a_403_when_posting_anyway(
    page_as: Any, live_url: str
) -> None:
    link, instances = _fleet()
    page = page_as("viewer")
    page.goto(f"{live_url}/clusters/{link.target_id}/")
    assert page.get_by_role("button", name="Drain").count() == 0
    response = _csrf_post(page, live_url, f"/instances/{instances[2].pk}/drain/")
    assert response.status == 403
    instances[2].refresh_from_db()
    assert instances[2].state == "active"


def test_a_what_if_run_shows_progress_then_its_results(
    page_as: Any, live_url: str, celery_worker_process: Any
) -> None:
    page = page_as("operator")
    # Record every value the progress bar takes, from the moment the run page loads.
    page.context.add_init_script(
        """
        window.__progress = [];
        document.addEventListener('DOMContentLoaded', function () {
          var bar = document.getElementById('whatif-progress');
          if (!bar) return;
          window.__progress.push(Number(bar.getAttribute('aria-valuenow')));
          new MutationObserver(function () {
            window.__progress.push(Number(bar.getAttribute('aria-valuenow')));
          }).observe(bar, {attributes: true});
        });
        """
    )
    page.goto(f"{live_url}/whatif/")
    page.get_by_label("Arrival rate (req/s)").fill("2")
    page.get_by_label("Requests").fill("20000")
    page.get_by_label("Link capacity (Gbps)").fill("25")
    page.get_by_role("button", name="Run simulation").click()
    page.wait_for_url(f"{live_url}/whatif/*/")
    page.locator("#whatif-results").wait_for(timeout=60_000)
    progress = page.evaluate("window.__progress")
    assert any(0 < p < 100 for p in progress), progress
    assert progress[-1] == 100
    assert float(page.locator("#whatif-throughput").inner_text()) > 0
    page.locator("#chart-links canvas").first.wait_for()


def test_approving_a_plan_updates_this_page_and_a_viewers_page_without_a_reload(
    page_as: Any, live_url: str, scenarios_dir: Any, celery_worker_process: Any
) -> None:
    plan = _plan_proposed(scenarios_dir)
    watcher = page_as("viewer")
    watcher.goto(f"{live_url}/plans/{plan.pk}/")
    watcher.wait_for_function("document.getElementById('live-status').textContent === 'Live'")
    watcher.evaluate("window.__notReloaded = true")
    assert watcher.get_by_role("button", name="Approve").count() == 0

    page = page_as("operator")
    page.goto(f"{live_url}/plans/{plan.pk}/")
    page.wait_for_function("document.getElementById('live-status').textContent === 'Live'")
    page.evaluate("window.__notReloaded = true")
    page.get_by_role("button", name="Approve").click()  # the confirmation is accepted
    page.wait_for_function("document.getElementById('plan-status').textContent !== 'proposed'")
    assert page.evaluate("window.__notReloaded") is True
    assert page.get_by_role("button", name="Approve").count() == 0

    # The viewer's tab learns it over the websocket.
    watcher.wait_for_function("document.getElementById('plan-status').textContent !== 'proposed'")
    assert watcher.evaluate("window.__notReloaded") is True
    plan.refresh_from_db()
    assert plan.status != "proposed"
    assert plan.approved_by.endswith(page.locator(".userbox .user").inner_text().split()[0])


def test_a_viewer_gets_no_approve_button_and_a_403_when_posting_anyway(
    page_as: Any, live_url: str, scenarios_dir: Any
) -> None:
    plan = _plan_proposed(scenarios_dir)
    page = page_as("viewer")
    page.goto(f"{live_url}/plans/{plan.pk}/")
    assert page.get_by_role("button", name="Approve").count() == 0
    response = _csrf_post(
        page, live_url, f"/plans/{plan.pk}/approve/", {"version": str(plan.version)}
    )
    assert response.status == 403
    plan.refresh_from_db()
    assert plan.status == "proposed"
