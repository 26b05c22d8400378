"""Routers that decide in process: live state, atomic link reservations, and the outcomes
that release them, feed the traffic store and compare predicted with observed TTFT."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from django.test import AsyncClient

from clusters.live import telemetry
from scheduling.core import routing
from scheduling.snapshot import link_key
from scheduling.traffic import traffic_window_read
from tests.factories import api_token, bearer
from tests.support.fleets import pd_prfaas_fleet

PD, PRFAAS = "pd-o", "prfaas-o"
BUDGET = 2 * 2**30


@pytest.fixture
def tokens(transactional_db: None, route_state_clean: None) -> dict[str, dict[str, str]]:
    pd_prfaas_fleet(
        PD, PRFAAS, h20_prefill_seconds=[[1024, 0.9], [32768, 7.5]], kv_budget_bytes=BUDGET
    )
    return {s: bearer(api_token(s)[1]) for s in ("router", "agent", "read")}


@pytest.fixture
async def client() -> AsyncIterator[AsyncClient]:
    yield AsyncClient()


async def post(client: AsyncClient, path: str, body: Any, headers: dict[str, str]) -> Any:
    return await client.post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", headers=headers
    )


def decision(request_id: str, *, reservation: dict[str, Any] | None = None) -> dict[str, Any]:
    d = routing.RouteDecision(
        route="prfaas" if reservation else "local",
        prefill=routing.Placement(PRFAAS if reservation else PD, f"{PRFAAS}-p0", ""),
        decode=routing.Placement(PD, f"{PD}-d0", ""),
        incremental_tokens=30000,
        cached_tokens=0,
        threshold=8192,
        policy_version=0,
        reason="above_threshold" if reservation else "below_threshold",
        ttft_estimate_s=routing.TtftEstimate(local=6.0, prfaas=1.5),
        request_id=request_id,
    )
    out = routing.decision_to_dict(d)
    out["reservation"] = reservation
    return out


def outcome(request_id: str, *, reservation: dict[str, Any] | None = None, **extra: Any) -> dict:
    d = decision(request_id, reservation=reservation)
    return {
        "decision": d,
        "decided_by": "gateway",
        "origin": PD,
        "prompt_tokens": 30000,
        "route": d["route"],
        "reason": d["reason"],
        "prefill": {"cluster": d["prefill"]["cluster"], "instance": d["prefill"]["instance"]},
        "decode": {"cluster": PD, "instance": f"{PD}-d0"},
        "incremental_tokens": 30000,
        "cached_tokens": 0,
        "output_tokens": 12,
        "observed_ttft_s": 2.0,
        "transfer": "finished" if reservation else "none",
        "transfer_bytes": reservation["bytes"] if reservation else 0,
        "status": "ok",
        "ts": time.time(),
        "request_id": request_id,
        **extra,
    }


async def test_a_reservation_is_admitted_within_the_budget_and_refused_beyond_it(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    body = {"source": PRFAAS, "target": PD, "bytes": BUDGET // 2 + 1, "hold_s": 30}
    first = await post(client, "/reservations", body, tokens["router"])
    assert first.status_code == 200, first.content
    assert first.json()["admitted"] is True and first.json()["budget_bytes"] == BUDGET
    second = await post(client, "/reservations", body, tokens["router"])
    assert second.json() == {"admitted": False, "id": None, "budget_bytes": BUDGET}
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == BUDGET // 2 + 1


async def test_reservations_refuse_bad_input_and_other_scopes(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    ok = {"source": PRFAAS, "target": PD, "bytes": 10, "hold_s": 30}
    unknown = await post(client, "/reservations", {**ok, "target": "nowhere"}, tokens["router"])
    assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_link"
    for bad in ({**ok, "bytes": 0}, {**ok, "hold_s": 0}, {**ok, "hold_s": 10_000}):
        got = await post(client, "/reservations", bad, tokens["router"])
        assert got.status_code == 422, bad
    assert (await post(client, "/reservations", ok, tokens["read"])).status_code == 403


async def test_an_outcome_releases_its_reservation_and_is_shown_with_its_ttft(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    body = {"source": PRFAAS, "target": PD, "bytes": 4096, "hold_s": 300}
    taken = (await post(client, "/reservations", body, tokens["router"])).json()
    reservation = {"source": PRFAAS, "target": PD, "bytes": 4096, "id": taken["id"]}
    sent = await post(
        client,
        "/outcomes",
        {"outcomes": [outcome("o-1", reservation=reservation)]},
        tokens["router"],
    )
    assert sent.status_code == 200, sent.content
    assert sent.json() == {"accepted": 1, "released": 1, "released_bytes": 4096}
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == 0
    # Reported twice (a retry), it frees nothing more.
    again = await post(
        client,
        "/outcomes",
        {"outcomes": [outcome("o-1", reservation=reservation)]},
        tokens["router"],
    )
    assert again.json()["released_bytes"] == 0

    recent = await client.get("/api/v1/outcomes/recent", headers=tokens["read"])
    first = recent.json()[1]  # newest first: the retry, then the first report
    assert first["request_id"] == "o-1" and first["released_bytes"] == 4096
    assert first["predicted_ttft_s"] == 1.5 and first["observed_ttft_s"] == 2.0
    metrics = (await client.get("/metrics")).content.decode()
    assert f'prfaas_ttft_observed_seconds_count{{cluster="{PRFAAS}"}} 2.0' in metrics
    assert f'prfaas_ttft_predicted_seconds_sum{{cluster="{PRFAAS}"}} 3.0' in metrics
    assert "prfaas_reservations_released_bytes_total 4096.0" in metrics


async def test_gateway_decisions_feed_the_traffic_store_and_the_recent_decisions(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    batch = [outcome(f"t-{i}") for i in range(3)]
    batch.append({**outcome("t-cp"), "decided_by": "control_plane"})
    sent = await post(client, "/outcomes", {"outcomes": batch}, tokens["router"])
    assert sent.status_code == 200, sent.content
    now = time.time()
    window = await asyncio.to_thread(traffic_window_read, PD, now - 120, now + 60)
    # The route service already counted the control plane's decision: only the gateway's three.
    assert window.arrivals == 3 and window.incremental_tokens == 90000
    assert window.output_tokens == 36 and window.reasons == {"below_threshold": 3}
    recent = (await client.get("/api/v1/decisions/recent", headers=tokens["read"])).json()
    assert {r["decision"]["request_id"] for r in recent} == {"t-0", "t-1", "t-2"}


async def test_a_malformed_outcome_is_refused_whole(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    good = outcome("m-1")
    bad = {**outcome("m-2"), "decision": {"route": "local"}}
    got = await post(client, "/outcomes", {"outcomes": [good, bad]}, tokens["router"])
    assert got.status_code == 422 and "not a decision" in got.json()["detail"]
    now = time.time()
    window = await asyncio.to_thread(traffic_window_read, PD, now - 120, now + 60)
    assert window.arrivals == 0
    negative = {**outcome("m-3"), "observed_ttft_s": -1}
    assert (
        await post(client, "/outcomes", {"outcomes": [negative]}, tokens["router"])
    ).status_code == 422


async def test_the_live_state_routers_read_is_the_route_paths_own(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    ts = time.time()
    body = {
        "idempotency_key": "live-1",
        "instances": [{"instance": f"{PD}-d0", "ts": ts, "running": 7, "kv_usage": 0.5}],
        "links": [
            {"source": PRFAAS, "target": PD, "ts": ts, "bytes_sent": int(5e9 / 8), "interval_s": 1}
        ],
    }
    assert (await post(client, "/telemetry", body, tokens["agent"])).status_code == 200
    got = await client.get("/api/v1/route/live", headers=tokens["router"])
    assert got.status_code == 200, got.content
    live = routing.live_state_from_dict(got.json())
    assert not live.stale and live.telemetry_at == pytest.approx(ts)
    assert live.instances[f"{PD}-d0"].running == 7
    assert live.links[(PRFAAS, PD)].egress_gbps == pytest.approx(5.0)
    assert PD in live.control
    assert (await client.get("/api/v1/route/live", headers=tokens["read"])).status_code == 403


async def test_an_offload_decided_by_the_route_api_carries_its_reservation_id(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    ts = time.time()
    body = {
        "idempotency_key": "live-2",
        "instances": [{"instance": n, "ts": ts} for n in (f"{PD}-p0", f"{PD}-d0", f"{PRFAAS}-p0")],
    }
    assert (await post(client, "/telemetry", body, tokens["agent"])).status_code == 200
    got = await post(client, "/route", {"origin": PD, "prompt_tokens": 30000}, tokens["router"])
    answer = got.json()
    assert answer["route"] == "prfaas", answer
    rid = answer["reservation"]["id"]
    assert (
        rid
        and telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == answer["reservation"]["bytes"]
    )
    reservation = {**answer["reservation"]}
    done = outcome("r-1", reservation=reservation)
    done["decision"] = answer
    done["decided_by"] = "control_plane"
    sent = await post(client, "/outcomes", {"outcomes": [done]}, tokens["router"])
    assert sent.json()["released"] == 1
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == 0


def group(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "origin": PD,
        "route": "local",
        "reason": "below_threshold",
        "prefill_cluster": PD,
        "decided_by": "gateway",
        "status": "ok",
        "transfer": "none",
        "ts": time.time(),
        "incremental_tokens": [100 * (i + 1) for i in range(n)],
        "cached_tokens": 50 * n,
        "output_tokens": 16 * n,
        "observed_ttft_s": [0.2] * n,
        "predicted_ttft_s": [0.1] * n,
        **extra,
    }


async def test_summed_groups_count_as_their_requests_in_traffic_and_ttft(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    body = {"outcomes": [outcome("g-whole")], "groups": [group(4)]}
    sent = await post(client, "/outcomes", body, tokens["router"])
    assert sent.status_code == 200, sent.content
    assert sent.json()["accepted"] == 5
    now = time.time()
    window = await asyncio.to_thread(traffic_window_read, PD, now - 120, now + 60)
    assert window.arrivals == 5
    assert window.incremental_tokens == 30000 + 100 + 200 + 300 + 400
    assert window.cache_hit_tokens == 200
    assert window.output_tokens == 12 + 64 and window.output_known == 5
    metrics = (await client.get("/metrics")).content.decode()
    assert f'prfaas_ttft_observed_seconds_count{{cluster="{PD}"}} 5.0' in metrics
    assert 'prfaas_outcomes_total{status="ok",transfer="none"} 5.0' in metrics


async def test_groups_that_do_not_add_up_are_refused(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    unpaired = group(3, predicted_ttft_s=[0.1])
    got = await post(client, "/outcomes", {"groups": [unpaired]}, tokens["router"])
    assert got.status_code == 422 and "pair up" in got.json()["detail"]
    assert (await post(client, "/outcomes", {}, tokens["router"])).status_code == 422
