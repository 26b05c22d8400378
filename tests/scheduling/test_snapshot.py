"""The routing snapshot never takes routing down: a row outside its physical bounds, written
straight into the database past every check (the ``gbps: 1e308`` of issue 13), is left out
and named, and /route, /policy, /telemetry and /kv-events keep answering in a process that
builds its snapshot afresh (a restarted web process)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from clusters.models import Link, PerformanceProfile
from scheduling.snapshot import snapshot_refresh, snapshot_reset
from tests.factories import api_token, bearer
from tests.support.fleets import pd_prfaas_fleet

pytestmark = pytest.mark.usefixtures("route_state_clean")


@pytest.fixture
def tokens(db: None) -> dict[str, dict[str, str]]:
    pd_prfaas_fleet("pd-a", "prfaas-x", h20_prefill_seconds=[[1024, 0.9], [131072, 36.0]])
    return {scope: bearer(api_token(scope)[1]) for scope in ("router", "agent")}


def link_gbps_forced(gbps: float) -> None:
    """What a bad migration or a hand-written UPDATE does: past the API, the model validators
    and (dropped here, inside the test's transaction) the CHECK constraint."""
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending FK checks before ALTER
        cursor.execute('ALTER TABLE "clusters_link" DROP CONSTRAINT "link_physically_bounded"')
    Link.objects.update(gbps=gbps)


def post(path: str, body: Any, headers: dict[str, str]) -> Any:
    return Client().post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", headers=headers
    )


def routing_answers(tokens: dict[str, dict[str, str]]) -> None:
    snapshot_reset()  # a restarted web process: the snapshot is built from the database
    long_prompt = {"origin": "pd-a", "prompt_tokens": 100_000}
    route = post("/route", long_prompt, tokens["router"])
    assert route.status_code == 200, route.content
    assert route.json()["prefill"]["cluster"] == "pd-a"  # no link left: the prompt stays local
    assert Client().get("/api/v1/policy", headers=tokens["router"]).status_code == 200
    sample = {"idempotency_key": f"k{time.time()}", "instances": [{"instance": "pd-a-p0", "ts": 1}]}
    assert post("/telemetry", sample, tokens["agent"]).status_code == 200
    events = {"instance": "pd-a-p0", "batches": [{"seq": 0, "batch": [0, []]}]}
    assert post("/kv-events", events, tokens["agent"]).status_code == 200


def test_a_link_of_1e308_gbps_in_the_database_is_left_out_and_routing_answers(
    tokens: dict[str, dict[str, str]],
) -> None:
    link_gbps_forced(1e308)
    routing_answers(tokens)
    snap = snapshot_refresh(force=True)
    assert snap.link_keys == ()
    assert any("prfaas-x->pd-a: gbps must be at most" in s for s in snap.skipped)


def test_an_infinite_prefill_time_leaves_its_cluster_out(tokens: dict[str, dict[str, str]]) -> None:
    # JSON tables have no CHECK constraint: an UPDATE writes anything.
    PerformanceProfile.objects.filter(accelerator__name="H200").update(
        prefill_seconds=[[1024, 1e308], [2048, 1e308]]
    )
    routing_answers(tokens)
    snap = snapshot_refresh(force=True)
    assert "prfaas-x" not in {c.name for c in snap.topology.clusters}
    assert any("prfaas-x: performance profile prefill_seconds" in s for s in snap.skipped)
