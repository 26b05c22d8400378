"""Every page, at a desktop and a phone width, on the case-study fleet with a proposed plan, an
applied one whose simulation was overloaded, decisions and link history: no raw template
syntax, nothing overflowing its card unseen, axes that read (tests/browser/page_checks.py).

(The same checks run on the live demo's pages in tests/browser/test_demo_ui.py, which also
photographs them for docs/screenshots/.)"""

from __future__ import annotations

import json
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from clusters.models import Cluster, Link
from scheduling.models import PlanStatus
from scheduling.traffic import traffic_window_read
from tests.browser.page_checks import DESKTOP, PHONE, page_problems
from tests.factories import PlanFactory, api_token
from tests.scheduling.plan_pages_support import proposed_plan

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _in_thread(work: Any) -> Any:
    # The rebalancer publishes live events from sync code, which cannot run on this thread
    # while Playwright's event loop is registered here.
    def run() -> Any:
        try:
            return work()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def _overloaded_plan(cluster: Cluster) -> Any:
    def run(rate: float, sustained: float, p90: float) -> dict[str, Any]:
        return {
            "rate_rps": rate,
            "requests": 2000,
            "sustained_fraction": sustained,
            "ttft_mean_s": p90 / 2,
            "ttft_p90_s": p90,
            "link_congested": 0.01,
            "stable": False,
        }

    now = time.time()
    return PlanFactory(
        tick__cluster=cluster,
        status=PlanStatus.APPLIED,
        applied_at=timezone.now() - timedelta(minutes=5),
        predictions={
            "current": {"capacity_rps": 1.9, "throughput_rps": 1.9, "offload_fraction": 0.15},
            "proposed": {"capacity_rps": 3.6, "throughput_rps": 3.6, "offload_fraction": 0.3},
        },
        simulated={
            "confirmed": True,
            "reason": "confirmed_overloaded",
            "detail": "overloaded",
            "observed": None,
            "stress": {"current": run(12.1, 0.16, 623.0), "proposed": run(12.1, 0.20, 341.0)},
        },
        inputs={"window": {"start_s": now - 900, "end_s": now - 300, "arrivals": 7260}},
    )


def _traffic(live_url: str, link: Link) -> None:
    """Ten minutes of link history, and decisions with long request ids through the API."""
    _, agent = api_token("agent")
    _, router = api_token("router")
    now = int(time.time())
    body = {
        "idempotency_key": uuid.uuid4().hex,
        "links": [
            {
                "source": link.source.name,
                "target": link.target.name,
                "ts": float(now - 600 + i),
                "bytes_sent": int((30 + 20 * math.sin(i / 40)) * 1e9 / 8),
                "interval_s": 1.0,
            }
            for i in range(600)
        ],
    }
    headers = {"Authorization": f"Bearer {agent}"}
    response = httpx.post(f"{live_url}/api/v1/telemetry", json=body, headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    headers = {"Authorization": f"Bearer {router}"}
    for i, tokens in enumerate([400, 30000, 90000, 2000, 60000]):
        request = {
            "origin": link.target.name,
            "prompt_tokens": tokens,
            "request_id": f"conversation-{uuid.uuid4().hex}-{i}",
        }
        response = httpx.post(f"{live_url}/api/v1/route", json=request, headers=headers, timeout=10)
        assert response.status_code == 200, response.text


def test_every_page_reads_cleanly_at_desktop_and_phone_widths(
    page_as: Any, live_url: str, scenarios_dir: Any
) -> None:
    plan = _in_thread(lambda: proposed_plan(scenarios_dir))
    applied = _in_thread(lambda: _overloaded_plan(plan.cluster))
    link = Link.objects.select_related("source", "target").get(target=plan.cluster)
    _traffic(live_url, link)
    page = page_as("admin")
    pages = [
        "/",
        "/clusters/",
        f"/clusters/{plan.cluster_id}/",
        "/links/",
        f"/links/{link.pk}/",
        "/decisions/",
        "/alerts/",
        "/policies/",
        "/plans/",
        f"/plans/{plan.pk}/",
        f"/plans/{applied.pk}/",
        "/whatif/",
        "/kv/",
        "/audit/",
        "/tokens/",
    ]
    problems: dict[str, Any] = {}
    for size in (DESKTOP, PHONE):
        page.set_viewport_size(size)
        for path in pages:
            page.goto(f"{live_url}{path}")
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(400)  # live frames and charts in
            found = {k: v for k, v in page_problems(page).items() if v}
            if found:
                problems[f"{path} at {size['width']} px"] = found
    # The overview shows, per link, the offloads offered to it and those its guard kept local,
    # as the router counted them.
    page.set_viewport_size(DESKTOP)
    page.goto(f"{live_url}/")
    key = link.key
    row = page.locator(f'[data-link-guard="{key}"]')
    window = traffic_window_read(link.target.name, time.time() - 300, time.time())
    refused = sum(window.link_refusals.get(key, {}).values())
    offered = window.link_offloads.get(key, 0) + refused
    assert offered > 0
    assert (row.get_attribute("data-offered"), row.get_attribute("data-refused")) == (
        str(offered),
        str(refused),
    )
    assert f"of {offered} offloads offered" in row.inner_text()
    # The overloaded plan's page says so, in words that follow from its numbers.
    page.goto(f"{live_url}/plans/{applied.pk}/")
    verdict = page.locator("#sim-verdict").inner_text()
    assert verdict.startswith("Overloaded: at 12.10 req/s offered"), verdict
    assert not problems, json.dumps(problems, indent=1)
