"""Alerts: judged from what governs routing (in-flight budget, refused offloads, queues,
instances), kept as a history of episodes."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import pytest

from clusters.models import Instance, Link
from controlplane.redis_connection import redis_sync
from scheduling.alerts import Reading, alert_episodes_update, alerts_evaluate
from scheduling.core.routing import RouteGuards
from scheduling.decision_log import decision_log_archive
from scheduling.models import AlertEpisode
from scheduling.overview import clusters_overview, links_overview
from scheduling.traffic import recent_queue
from tests.factories import InstanceFactory, LinkFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


def _fleet() -> tuple[Link, Instance]:
    link = cast(Link, LinkFactory(gbps=100.0))
    return link, cast(Instance, InstanceFactory(cluster=link.target, name="pd-0"))


def _evaluate(past: list[Reading] | None = None, **override: Any) -> list[Any]:
    now = time.time()
    links = links_overview(RouteGuards(), now, window_s=0)
    for link in links:
        link.update(override)
    clusters = clusters_overview()
    current = Reading(ts=now, queues={}, links={})
    return alerts_evaluate(links, clusters, RouteGuards(), current, past or [], now)


def _codes(alerts: list[Any]) -> dict[str, str]:
    return {a.code: a.message for a in alerts if a.code != "telemetry_stale"}


def test_a_link_whose_in_flight_budget_is_full_alerts_with_its_name_and_the_cause() -> None:
    link, _ = _fleet()
    budget = links_overview(RouteGuards(), window_s=0)[0]["kv_budget_bytes"]
    found = _codes(_evaluate(reserved_bytes=0.95 * budget))
    assert "budget exhausted" in found["link_budget_exhausted"]
    assert link.source.name in found["link_budget_exhausted"]
    assert "link_budget_exhausted" not in _codes(_evaluate(reserved_bytes=0.5 * budget))


def _logged(link: Link, n: int, refused: int, raised: int = 0) -> None:
    now = time.time()
    pipe = redis_sync().pipeline()
    for i in range(n):
        congested = i < refused + raised
        decision = {
            "route": "local" if congested else "prfaas",
            "reason": "link_congested" if congested else "above_threshold",
            # refused: above the effective threshold; raised: under a raised threshold
            "incremental_tokens": 30_000 if i < refused or not congested else 10_000,
            "threshold": 20_000,
        }
        entry = {"ts": now - i * 0.01, "inputs": {"origin": link.target.name}, "decision": decision}
        recent_queue(pipe, json.dumps(entry))
    pipe.execute()
    decision_log_archive()


def test_offloads_the_link_had_no_room_for_alert_but_a_raised_threshold_does_not() -> None:
    link, _ = _fleet()
    _logged(link, 40, refused=0, raised=20)
    assert "offloads_refused" not in _codes(_evaluate())
    _logged(link, 40, refused=10)
    message = _codes(_evaluate())["offloads_refused"]
    assert "no room for 10 of" in message and link.target.name in message


def test_a_down_instance_and_a_growing_local_queue_alert() -> None:
    link, inst = _fleet()
    Instance.objects.filter(pk=inst.pk).update(state="down")
    now = time.time()
    past = [Reading(ts=now - 10, queues={link.target.name: 5}, links={})]
    found = _codes(_evaluate(past))
    assert found["instance_down"] == f"pd-0 ({link.target.name}) is down"
    # The queue grows from 5 to 60 in 10 s: the telemetry says so.
    redis_sync().hset("live:insts", "pd-0", f"{now!r},60,0,0,0.0,0")
    assert "5 → 60" in _codes(_evaluate(past))["pd_queue_growing"]


def test_alert_episodes_open_once_and_close_when_the_alert_clears() -> None:
    _fleet()
    budget = links_overview(RouteGuards(), window_s=0)[0]["kv_budget_bytes"]
    for _ in range(3):
        alert_episodes_update(_evaluate(reserved_bytes=budget), time.time())
    (episode,) = AlertEpisode.objects.filter(code="link_budget_exhausted")
    assert episode.cleared_at is None
    alert_episodes_update(_evaluate(reserved_bytes=0), time.time())
    episode.refresh_from_db()
    assert episode.cleared_at is not None
