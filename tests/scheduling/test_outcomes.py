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
from clusters.models import Link
from scheduling.core import routing
from scheduling.core.link import link_key
from scheduling.snapshot import snapshot_reset
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
    assert sent.json() == {
        "accepted": 1,
        "released": 1,
        "released_bytes": 4096,
        "duplicates": 0,
        "rejected": [],
    }
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


async def reserve(client: AsyncClient, tokens: dict[str, dict[str, str]], n: int) -> dict:
    body = {"source": PRFAAS, "target": PD, "bytes": n, "hold_s": 300}
    taken = (await post(client, "/reservations", body, tokens["router"])).json()
    assert taken["admitted"], taken
    return {"source": PRFAAS, "target": PD, "bytes": n, "id": taken["id"]}


async def test_one_bad_outcome_is_refused_alone_and_its_reservation_is_still_released(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    # Issue 30, finding 1: a 15M-token prompt's outcome failed validation and the whole batch
    # was refused; the three offloads beside it kept their reservations until they expired.
    good = [outcome(f"b-{i}", reservation=await reserve(client, tokens, 1000)) for i in range(3)]
    huge = outcome("b-huge", reservation=await reserve(client, tokens, 5000))
    huge["prompt_tokens"] = 15_000_000
    broken = {**outcome("b-broken"), "decision": {"route": "local"}}
    groups = [group(2), group(2, predicted_ttft_s=[0.1])]
    body = {"outcomes": [good[0], huge, good[1], broken, good[2]], "groups": groups}
    got = await post(client, "/outcomes", body, tokens["router"])
    assert got.status_code == 200, got.content
    answer = got.json()
    assert answer["accepted"] == 3 + 2
    assert answer["released"] == 4 and answer["released_bytes"] == 3 * 1000 + 5000
    assert [(r["kind"], r["index"], r["code"]) for r in answer["rejected"]] == [
        ("group", 1, "invalid"),
        ("outcome", 1, "invalid"),
        ("outcome", 3, "invalid"),
    ]
    assert "prompt_tokens" in answer["rejected"][1]["detail"]
    assert "pair up" in answer["rejected"][0]["detail"]
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == 0
    recent = (await client.get("/api/v1/outcomes/recent", headers=tokens["read"])).json()
    assert sorted(r["request_id"] for r in recent) == ["b-0", "b-1", "b-2"]
    metrics = (await client.get("/metrics")).content.decode()
    assert 'prfaas_outcomes_rejected_total{code="invalid"} 3.0' in metrics


async def test_an_outcome_on_a_link_taken_down_releases_its_reservation(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    # Finding 1: a link set to 0 Gbps with offloads in flight (422 unknown_link for the batch).
    reservation = await reserve(client, tokens, 7000)
    link = await Link.objects.aget(source__name=PRFAAS, target__name=PD)
    link.gbps = 0
    await link.asave()
    snapshot_reset()
    got = await post(
        client, "/outcomes", {"outcomes": [outcome("down-1", reservation=reservation)]},
        tokens["router"],
    )  # fmt: skip
    assert got.status_code == 200, got.content
    assert got.json()["accepted"] == 1 and got.json()["released_bytes"] == 7000
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == 0


async def test_an_outcome_sent_three_times_with_its_key_is_applied_once(
    client: AsyncClient, tokens: dict[str, dict[str, str]]
) -> None:
    # Finding 2: a stalled control plane received a gateway's retries and applied each copy.
    items = [{**outcome(f"k-{i}"), "idempotency_key": f"k-{i}/gw-1-{i}"} for i in range(10)]
    keyed_group = {**group(3), "idempotency_key": "group-1"}
    answers = await asyncio.gather(
        *(
            post(
                client, "/outcomes", {"outcomes": items, "groups": [keyed_group]}, tokens["router"]
            )
            for _ in range(3)
        )
    )
    assert [a.status_code for a in answers] == [200] * 3
    assert sorted(a.json()["accepted"] for a in answers) == [0, 0, 13]
    assert sum(a.json()["duplicates"] for a in answers) == 2 * 11
    recent = (await client.get("/api/v1/outcomes/recent", headers=tokens["read"])).json()
    assert sorted(r["request_id"] for r in recent) == sorted(f"k-{i}" for i in range(10))
    now = time.time()
    window = await asyncio.to_thread(traffic_window_read, PD, now - 120, now + 60)
    assert window.arrivals == 13
    # The same request id served again (another attempt, another key) is another outcome.
    again = {**outcome("k-0"), "idempotency_key": "k-0/gw-1-99"}
    got = await post(client, "/outcomes", {"outcomes": [again]}, tokens["router"])
    assert got.json()["accepted"] == 1 and got.json()["duplicates"] == 0
    metrics = (await client.get("/metrics")).content.decode()
    assert "prfaas_outcomes_duplicate_total 22.0" in metrics


async def test_made_up_names_are_refused_and_create_no_keys_or_series(
    client: AsyncClient, tokens: dict[str, dict[str, str]], redis_client: Any
) -> None:
    # Finding 3: 1,000 outcomes with made-up origin, reason and cluster names made 2,000 Redis
    # keys and 1,000 /metrics series.
    # One known and one made-up item first: the counters (refusals included) exist already.
    first = [outcome("n-known"), {**outcome("n-first"), "origin": "nowhere"}]
    sent = await post(client, "/outcomes", {"outcomes": first}, tokens["router"])
    assert sent.status_code == 200 and sent.json()["accepted"] == 1, sent.content
    keys_before = redis_client.dbsize()
    series_before = (await client.get("/metrics")).content.decode().count("\n")
    rejected: list[dict[str, Any]] = []
    for part in range(5):  # 1,000 made-up items, in posts under the body limit
        made_up = []
        for i in range(part * 200, part * 200 + 150):
            item = outcome(f"n-{i}")
            if i % 3 == 0:
                item["origin"] = f"nowhere-{i}"
            elif i % 3 == 1:
                item["reason"] = f"because-{i}"
            else:
                item["prefill"] = {"cluster": f"cl-{i}", "instance": "x"}
            made_up.append(item)
        groups = [group(1, origin=f"g-{i}") for i in range(50)]
        got = await post(
            client, "/outcomes", {"outcomes": made_up, "groups": groups}, tokens["router"]
        )
        assert got.status_code == 200, got.content
        assert got.json()["accepted"] == 0
        rejected += got.json()["rejected"]
    assert len(rejected) == 1000
    assert {r["code"] for r in rejected} == {"unknown_cluster", "unknown_reason"}
    assert redis_client.dbsize() == keys_before
    metrics = (await client.get("/metrics")).content.decode()
    # Two new series at most: the rejected counter's two codes.
    assert metrics.count("\n") <= series_before + 2
    assert 'prfaas_outcomes_rejected_total{code="unknown_cluster"} 751.0' in metrics
    assert "nowhere-" not in metrics and "because-" not in metrics


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
    assert got.status_code == 200 and got.json()["accepted"] == 0
    assert "pair up" in got.json()["rejected"][0]["detail"]
    assert (await post(client, "/outcomes", {}, tokens["router"])).status_code == 422
    negative = {**outcome("m-3"), "observed_ttft_s": -1}
    got = await post(client, "/outcomes", {"outcomes": [negative]}, tokens["router"])
    assert got.json()["rejected"][0]["code"] == "invalid"
    not_a_list = await post(client, "/outcomes", {"outcomes": {"a": 1}}, tokens["router"])
    assert not_a_list.status_code == 422
