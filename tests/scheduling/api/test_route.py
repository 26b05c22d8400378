"""The route API against real PostgreSQL and Redis: every reason code, the paper's scarce and
abundant rules, the link budget under concurrency, bad input, and Redis going away.

Live state is created the way production creates it: telemetry and KV events posted through
the API by an agent token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from clusters.live import prefix_index
from clusters.live import telemetry as telemetry_store
from clusters.live.keys import prefix_instance_prefix, reservation_keys
from clusters.live.prefix_index import block_hash_key
from clusters.models import Instance, InstanceState
from clusters.services import instance_update
from controlplane.audit import CLI_ACTOR
from controlplane.errors import Invalid
from scheduling import decisions, traffic
from scheduling.api.route import route_body_decode
from scheduling.core.link import link_key
from scheduling.policies import policy_create
from scheduling.snapshot import DEFAULT_THRESHOLD_TOKENS
from tests.factories import PREFILL_SECONDS, api_token, bearer
from tests.support.fleets import BLOCK_TOKENS, LINK_GBPS, pd_prfaas_fleet
from tests.support.processes import RedisServer
from tests.support.servers import (
    control_plane_serve,
)
from tests.support.waiting import wait_for

BLOCK = BLOCK_TOKENS
_seq = itertools.count()


@dataclass
class Fleet:
    """pd-a (H20: 2 prefill, 2 decode) <- 100 Gbps <- prfaas-x (H200: 2 prefill)."""

    router: dict[str, str]
    agent: dict[str, str]
    read: dict[str, str]
    budget_bytes: int


H20_PREFILL_SECONDS = [[1024, 0.9], [8192, 2.4], [32768, 7.5], [131072, 36.0]]


def _fleet(budget_bytes: int, *, slowdown: float = 1.0) -> Fleet:
    """The test fleet; ``slowdown`` multiplies both clusters' prefill times (the decisions stay
    the same, the predicted transfer ends, when reservations expire, move out)."""
    slow = [[tokens, seconds * slowdown] for tokens, seconds in H20_PREFILL_SECONDS]
    pd_prfaas_fleet(
        "pd-a",
        "prfaas-x",
        h20_prefill_seconds=slow,
        kv_budget_bytes=budget_bytes,
        h200_prefill_seconds=[[t, s * slowdown] for t, s in PREFILL_SECONDS],
    )
    return Fleet(
        router=bearer(api_token("router")[1]),
        agent=bearer(api_token("agent")[1]),
        read=bearer(api_token("read")[1]),
        budget_bytes=budget_bytes,
    )


@pytest.fixture
def fleet(transactional_db: None, route_state_clean: None) -> Fleet:
    return _fleet(budget_bytes=50 * 2**30)


@pytest.fixture
async def client() -> AsyncIterator[AsyncClient]:
    yield AsyncClient()


def chain(n: int, start: int = 1000) -> list[int]:
    return [start + i for i in range(n)]


async def post(client: AsyncClient, path: str, body: Any, headers: dict[str, str]) -> Any:
    return await client.post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", headers=headers
    )


async def telemetry(
    client: AsyncClient,
    fleet: Fleet,
    *,
    link_gbps: float = 1.0,
    prfaas_queued_tokens: int = 0,
    age_s: float = 0.0,
) -> None:
    ts = time.time() - age_s
    instances = [{"instance": f"pd-a-p{i}", "ts": ts, "queue_depth": 0} for i in range(2)] + [
        {"instance": f"pd-a-d{i}", "ts": ts, "running": 3, "kv_usage": 0.3} for i in range(2)
    ]
    instances += [
        {
            "instance": f"prfaas-x-p{i}",
            "ts": ts,
            "queue_depth": 4 if prfaas_queued_tokens else 0,
            "queued_prefill_tokens": prfaas_queued_tokens,
        }
        for i in range(2)
    ]
    body = {
        "idempotency_key": f"batch-{next(_seq)}",
        "instances": instances,
        "links": [
            {
                "source": "prfaas-x",
                "target": "pd-a",
                "ts": ts,
                "bytes_sent": int(link_gbps * 1e9 / 8),
                "interval_s": 1.0,
            }
        ],
    }
    response = await post(client, "/telemetry", body, fleet.agent)
    assert response.status_code == 200, response.content


async def kv_stored(client: AsyncClient, fleet: Fleet, instance: str, hashes: list[int]) -> None:
    body = {
        "instance": instance,
        "batches": [
            {"seq": None, "batch": [time.time(), [["BlockStored", hashes, None, [], BLOCK]]]}
        ],
    }
    response = await post(client, "/kv-events", body, fleet.agent)
    assert response.status_code == 200, response.content


async def route(client: AsyncClient, fleet: Fleet, **request: Any) -> dict[str, Any]:
    request.setdefault("origin", "pd-a")
    response = await post(client, "/route", request, fleet.router)
    assert response.status_code == 200, response.content
    body: dict[str, Any] = response.json()
    return body


# --- reason codes ---------------------------------------------------------------------------


async def test_short_prompt_stays_local_below_threshold(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=2000)
    assert (d["route"], d["reason"]) == ("local", "below_threshold")
    assert d["prefill"]["cluster"] == "pd-a" and d["decode"]["cluster"] == "pd-a"
    assert d["threshold"] == DEFAULT_THRESHOLD_TOKENS and d["policy_version"] == 0
    assert d["ttft_estimate_s"]["local"] > 0


async def test_long_prompt_is_offloaded_above_threshold(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=60_000, request_id="long-1")
    assert (d["route"], d["reason"]) == ("prfaas", "above_threshold")
    assert d["prefill"]["cluster"] == "prfaas-x"
    assert d["prefill"]["endpoint"].startswith("http://")
    assert d["decode"]["cluster"] == "pd-a"
    assert d["incremental_tokens"] == 60_000
    assert d["ttft_estimate_s"]["prfaas"] is not None
    assert d["reservation"]["bytes"] > 0


async def test_congested_link_keeps_a_request_local(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet, link_gbps=0.95 * LINK_GBPS)
    d = await route(client, fleet, prompt_tokens=10_000)
    assert (d["route"], d["reason"]) == ("local", "link_congested")
    assert d["threshold"] > DEFAULT_THRESHOLD_TOKENS
    assert d["link_refusal"] == {"source": "prfaas-x", "target": "pd-a", "cause": "saturation"}


async def test_prfaas_backlog_keeps_a_request_local(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet, prfaas_queued_tokens=400_000)
    d = await route(client, fleet, prompt_tokens=10_000)
    assert (d["route"], d["reason"]) == ("local", "prfaas_backlog")
    assert d["threshold"] > DEFAULT_THRESHOLD_TOKENS


async def test_local_prefix_cache_keeps_a_long_request_local(
    client: AsyncClient, fleet: Fleet
) -> None:
    await telemetry(client, fleet)
    hashes = chain(40)
    await kv_stored(client, fleet, "pd-a-p1", hashes[:30])
    d = await route(client, fleet, prompt_tokens=40 * BLOCK, block_hashes=hashes)
    assert (d["route"], d["reason"]) == ("local", "cache_affinity")
    assert d["prefill"]["instance"] == "pd-a-p1"
    assert d["cached_tokens"] == 30 * BLOCK
    assert d["incremental_tokens"] == 10 * BLOCK


async def test_stale_telemetry_applies_the_static_rule(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet, age_s=120)
    d = await route(client, fleet, prompt_tokens=60_000)
    assert d["reason"] == "telemetry_stale"
    assert d["stale"] is True
    assert d["cache_transfer"] is None


async def test_no_telemetry_at_all_is_stale(client: AsyncClient, fleet: Fleet) -> None:
    d = await route(client, fleet, prompt_tokens=2000)
    assert (d["reason"], d["stale"]) == ("telemetry_stale", True)


async def test_no_active_prfaas_instance_keeps_it_local(client: AsyncClient, fleet: Fleet) -> None:
    def take_prfaas_down() -> None:
        for inst in Instance.objects.filter(cluster__name="prfaas-x"):
            instance_update(
                instance_id=inst.pk,
                version=inst.version,
                changes={"state": InstanceState.DOWN},
                actor=CLI_ACTOR,
            )

    await sync_to_async(take_prfaas_down)()
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=60_000)
    assert (d["route"], d["reason"]) == ("local", "prfaas_unavailable")


async def test_a_new_policy_version_is_obeyed_at_once(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    assert (await route(client, fleet, prompt_tokens=20_000))["route"] == "prfaas"
    await sync_to_async(policy_create)(actor=CLI_ACTOR, thresholds={"pd-a": 30_000})
    d = await route(client, fleet, prompt_tokens=20_000)
    assert (d["route"], d["reason"], d["policy_version"]) == ("local", "below_threshold", 1)
    assert d["threshold"] == 30_000


# --- the paper's scarce and abundant rules (section 4.2) ----------------------------------------


async def test_abundant_bandwidth_uses_the_prfaas_cache_and_moves_it(
    client: AsyncClient, fleet: Fleet
) -> None:
    """l_prefix = max(l_prfaas, l_pd): the PrfaaS hit brings the request under t; the cache
    lives where prefill does not run, so a cross-cluster transfer is asked for."""
    await telemetry(client, fleet, link_gbps=1.0)
    hashes = chain(40)
    await kv_stored(client, fleet, "prfaas-x-p0", hashes[:36])
    d = await route(client, fleet, prompt_tokens=40 * BLOCK, block_hashes=hashes)
    assert d["route"] == "local"
    assert d["incremental_tokens"] == 4 * BLOCK
    transfer = d["cache_transfer"]
    assert transfer is not None
    assert (transfer["source_cluster"], transfer["target_cluster"]) == ("prfaas-x", "pd-a")
    assert transfer["tokens"] == 36 * BLOCK


async def test_scarce_bandwidth_judges_by_the_local_cache_only(
    client: AsyncClient, fleet: Fleet
) -> None:
    """l_total - l_pd against t: the PrfaaS hit does not pull the request local, no cache
    moves, and the offload reuses the PrfaaS cache where it is."""
    await telemetry(client, fleet, link_gbps=0.9 * LINK_GBPS)
    hashes = chain(80)
    await kv_stored(client, fleet, "prfaas-x-p0", hashes[:70])
    d = await route(client, fleet, prompt_tokens=80 * BLOCK, block_hashes=hashes)
    assert d["cache_transfer"] is None
    assert d["route"] == "prfaas"
    assert d["prefill"]["instance"] == "prfaas-x-p0"
    assert d["cached_tokens"] == 70 * BLOCK


async def test_scarce_bandwidth_still_uses_a_local_hit(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet, link_gbps=0.9 * LINK_GBPS)
    hashes = chain(40)
    await kv_stored(client, fleet, "pd-a-p0", hashes[:36])
    d = await route(client, fleet, prompt_tokens=40 * BLOCK, block_hashes=hashes)
    assert (d["route"], d["reason"]) == ("local", "cache_affinity")
    assert d["prefill"]["instance"] == "pd-a-p0"
    assert d["cache_transfer"] is None


async def test_degraded_index_entries_are_trusted_less_and_visible(
    client: AsyncClient, fleet: Fleet
) -> None:
    await telemetry(client, fleet)
    hashes = chain(40)
    stored = {"seq": 0, "batch": [time.time(), [["BlockStored", hashes[:36], None, [], BLOCK]]]}
    gap = {"seq": 5, "batch": {"ts": time.time(), "events": []}}
    response = await post(
        client, "/kv-events", {"instance": "pd-a-p0", "batches": [stored, gap]}, fleet.agent
    )
    body = response.json()
    assert (body["state"], body["missed_batches"]) == ("degraded", 4)
    d = await route(client, fleet, prompt_tokens=40 * BLOCK, block_hashes=hashes)
    assert d["cached_tokens"] < 36 * BLOCK
    listing = await client.get("/api/v1/prefix-index", headers=fleet.read)
    states = {s["instance"]: s for s in listing.json()}
    assert states["pd-a-p0"]["state"] == "degraded" and states["pd-a-p0"]["gaps"] == 1
    assert states["pd-a-p1"]["state"] == "exact"


# --- batch, policy, recent decisions, metrics ----------------------------------------------------


async def test_batch_decides_every_request_in_order(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    requests = [
        {"origin": "pd-a", "prompt_tokens": n, "request_id": f"r{n}"} for n in (500, 60_000)
    ]
    response = await post(client, "/route/batch", {"requests": requests}, fleet.router)
    assert response.status_code == 200
    got = response.json()["decisions"]
    assert [(d["request_id"], d["route"]) for d in got] == [("r500", "local"), ("r60000", "prfaas")]


async def test_batch_error_names_the_failing_request(client: AsyncClient, fleet: Fleet) -> None:
    requests = [{"origin": "pd-a", "prompt_tokens": 10}, {"origin": "nowhere", "prompt_tokens": 10}]
    response = await post(client, "/route/batch", {"requests": requests}, fleet.router)
    assert response.status_code == 404
    assert response.json() == {
        "detail": "requests[1]: unknown origin cluster 'nowhere'",
        "code": "unknown_origin",
    }


async def test_policy_has_an_etag_and_answers_304(client: AsyncClient, fleet: Fleet) -> None:
    first = await client.get("/api/v1/policy", headers=fleet.router)
    assert first.status_code == 200
    body = first.json()
    assert body["policy"]["thresholds"] == {"pd-a": DEFAULT_THRESHOLD_TOKENS}
    etag = first.headers["ETag"]
    again = await client.get("/api/v1/policy", headers={**fleet.router, "If-None-Match": etag})
    assert again.status_code == 304
    await sync_to_async(policy_create)(actor=CLI_ACTOR, thresholds={"pd-a": 12_000})
    changed = await client.get("/api/v1/policy", headers={**fleet.router, "If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["ETag"] != etag


async def test_recent_decisions_and_metrics_show_why(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    await route(client, fleet, prompt_tokens=60_000, request_id="why-me")
    recent = (await client.get("/api/v1/decisions/recent?limit=5", headers=fleet.read)).json()
    assert recent[0]["inputs"]["request_id"] == "why-me"
    assert recent[0]["decision"]["reason"] == "above_threshold"
    # Written within ROUTE_RECORD_FLUSH_S; a scrape in this very moment waits for none.
    await decisions.route_records_flush()
    text = (await client.get("/metrics")).content.decode()
    assert 'prfaas_decisions_total{reason="above_threshold",route="prfaas"} 1.0' in text
    assert 'prfaas_decision_latency_seconds_count{mode="single"} 1.0' in text
    assert 'prfaas_link_utilisation{source="prfaas-x",target="pd-a"} 0.01' in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make setup)")
async def test_metrics_pass_promtool_check(client: AsyncClient, fleet: Fleet) -> None:
    await telemetry(client, fleet)
    await route(client, fleet, prompt_tokens=60_000, request_id="lint-me")
    await route(client, fleet, prompt_tokens=100, request_id="lint-me-too")
    await decisions.route_records_flush()
    text = (await client.get("/metrics")).content
    assert b"prfaas_decisions_total" in text and b"prfaas_link_inflight_bytes" in text
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == b"", "promtool's lint found problems"


# --- bad input -----------------------------------------------------------------------------------


# Bad route inputs and what each gets: (body, status, code, a part of the detail).
BAD_ROUTE_INPUTS: list[tuple[Any, int, str, str]] = [
    ({"origin": "pd-a", "prompt_tokens": -5}, 422, "invalid", "prompt_tokens"),
    ({"origin": "pd-a", "prompt_tokens": 0}, 422, "invalid", "prompt_tokens"),
    ({"origin": "pd-a", "prompt_tokens": 10**12}, 422, "invalid", "prompt_tokens"),
    ({"origin": "pd-a", "prompt_tokens": "many"}, 422, "invalid", "prompt_tokens"),
    (
        {"origin": "pd-a", "prompt_tokens": 10, "cached_tokens": {"pd-a": -1}},
        422,
        "invalid",
        "cached_tokens",
    ),
    ({"origin": "nowhere", "prompt_tokens": 10}, 404, "unknown_origin", "nowhere"),
    ({"origin": "prfaas-x", "prompt_tokens": 10}, 422, "invalid_origin", "prfaas"),
    (
        {"origin": "pd-a", "prompt_tokens": 10, "block_hashes": ["xyz"]},
        422,
        "invalid",
        "block_hashes",
    ),
    (
        {"origin": "pd-a", "prompt_tokens": 10, "block_hashes": [2**64]},
        422,
        "invalid",
        "block_hashes",
    ),
    (
        {"origin": "pd-a", "prompt_tokens": 10, "block_hashes": [1.5]},
        422,
        "invalid",
        "block_hashes",
    ),
    ({"prompt_tokens": 10}, 422, "invalid", "origin"),
]


@pytest.mark.parametrize(("body", "status", "code", "detail_part"), BAD_ROUTE_INPUTS)
async def test_bad_route_input_gets_a_clear_error(
    client: AsyncClient, fleet: Fleet, body: Any, status: int, code: str, detail_part: str
) -> None:
    response = await post(client, "/route", body, fleet.router)
    assert response.status_code == status, response.content
    got = response.json()
    assert set(got) == {"detail", "code"}
    assert got["code"] == code
    assert detail_part in got["detail"]


async def test_cached_counts_beyond_the_prompt_are_capped(
    client: AsyncClient, fleet: Fleet
) -> None:
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=20_000, cached_tokens={"pd-a": 50_000})
    assert d["route"] == "local"
    assert d["cached_tokens"] < 20_000 and d["incremental_tokens"] >= 1


async def test_oversized_body_gets_413(client: AsyncClient, fleet: Fleet) -> None:
    body = {
        "origin": "pd-a",
        "prompt_tokens": 10,
        "block_hashes": [f"{i:016x}" for i in range(20_000)],
    }
    response = await post(client, "/route", body, fleet.router)
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"


async def test_a_batch_over_1000_requests_is_refused(client: AsyncClient, fleet: Fleet) -> None:
    requests = [{"origin": "pd-a", "prompt_tokens": 1}] * 1001
    response = await post(client, "/route/batch", {"requests": requests}, fleet.router)
    assert response.status_code == 422
    assert "requests" in response.json()["detail"]


async def test_wrong_scope_gets_403_with_the_shape(client: AsyncClient, fleet: Fleet) -> None:
    response = await post(client, "/route", {"origin": "pd-a", "prompt_tokens": 10}, fleet.agent)
    assert response.status_code == 403
    assert response.json()["code"] == "forbidden"
    response = await post(client, "/telemetry", {"idempotency_key": "k"}, fleet.router)
    assert response.status_code == 403


# --- link budget under concurrency --------------------------------------------------------------


@pytest.fixture
def uvicorn_two_workers(
    transactional_db: None, route_state_clean: None, settings: Any
) -> Iterator[tuple[str, Fleet]]:
    """The real app under uvicorn with 2 worker processes, on the test database."""
    from django.db import connection

    # Reservations expire at their transfer's predicted end (a few seconds here): a burst
    # slower than that on a loaded machine would see early ones released and the bytes
    # rightly reserved again. Slow prefill makes every hold outlast the burst, so the sum of
    # the burst's reservations is what is in flight at once.
    fleet = _fleet(budget_bytes=6 * 2**30, slowdown=50.0)
    served = control_plane_serve(connection.settings_dict, settings.REDIS_URL, workers=2)
    with served as (base, _):
        yield base, fleet


def test_concurrent_long_requests_never_reserve_more_than_the_budget(
    uvicorn_two_workers: tuple[str, Fleet], redis_client: redis.Redis
) -> None:
    base, fleet = uvicorn_two_workers

    async def run() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as http:
            ts = time.time()
            samples = {
                "idempotency_key": "budget-telemetry",
                "instances": [
                    {"instance": n, "ts": ts}
                    for n in (
                        "pd-a-p0",
                        "pd-a-p1",
                        "pd-a-d0",
                        "pd-a-d1",
                        "prfaas-x-p0",
                        "prfaas-x-p1",
                    )
                ],
            }
            r = await http.post("/api/v1/telemetry", json=samples, headers=fleet.agent)
            assert r.status_code == 200, r.text
            # Both workers build their snapshot and token cache before the burst.
            for _ in range(16):
                short = {"origin": "pd-a", "prompt_tokens": 100}
                r = await http.post("/api/v1/route", json=short, headers=fleet.router)
                assert r.json()["route"] == "local"
            responses = await asyncio.gather(
                *(
                    http.post(
                        "/api/v1/route",
                        json={"origin": "pd-a", "prompt_tokens": 100_000, "request_id": f"c{i}"},
                        headers=fleet.router,
                    )
                    for i in range(200)
                )
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses[:3]]
        return [r.json() for r in responses]

    got = asyncio.run(run())
    offloaded = [d for d in got if d["route"] == "prfaas"]
    kept = [d for d in got if d["route"] == "local"]
    reserved = sum(d["reservation"]["bytes"] for d in offloaded)
    assert offloaded, "some long requests must be offloaded"
    assert reserved <= fleet.budget_bytes
    assert int(redis_client.get(reservation_keys("prfaas-x->pd-a")[2]) or 0) <= fleet.budget_bytes
    assert kept and all(d["reason"] == "link_congested" for d in kept)
    assert len(offloaded) + len(kept) == 200
    # Refused when decided or when reserved, each says which link's budget kept it local; the
    # traffic store counts both per link (the overview's "kept local by the link guard").
    refusal = {"source": "prfaas-x", "target": "pd-a", "cause": "budget"}
    assert all(d["link_refusal"] == refusal for d in kept), kept[:2]
    assert all(d["link_refusal"] is None for d in offloaded)

    def counted() -> traffic.TrafficWindow:
        return traffic.traffic_window_read("pd-a", time.time() - 120, time.time() + 1)

    wait_for("the route records", lambda: counted().arrivals >= 216, timeout_s=10)
    window = counted()
    assert window.link_offloads == {"prfaas-x->pd-a": len(offloaded)}
    assert window.link_refusals == {"prfaas-x->pd-a": {"budget": len(kept)}}


# --- Redis stopped and restarted mid-run ----------------------------------------------------------


async def test_route_survives_redis_going_away_and_recovers(
    client: AsyncClient, fleet: Fleet, own_redis: RedisServer, settings: Any
) -> None:
    settings.REDIS_URL = own_redis.url
    await telemetry(client, fleet)
    assert (await route(client, fleet, prompt_tokens=60_000))["reason"] == "above_threshold"

    own_redis.stop()
    for _ in range(3):
        # A hang would trip wait_for; the answer itself must be the snapshot's static rule.
        d = await asyncio.wait_for(route(client, fleet, prompt_tokens=60_000), timeout=10)
        assert d["reason"] == "telemetry_stale" and d["stale"] is True

    own_redis.start()
    await asyncio.sleep(decisions.REDIS_BACKOFF_S + 0.1)
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=60_000)
    assert (d["route"], d["reason"]) == ("prfaas", "above_threshold")


async def test_route_and_ingest_carry_on_when_redis_loses_its_scripts_mid_run(
    client: AsyncClient, fleet: Fleet, own_redis: RedisServer, settings: Any
) -> None:
    settings.REDIS_URL = own_redis.url
    hashes = chain(40)
    await telemetry(client, fleet)
    await kv_stored(client, fleet, "pd-a-p1", hashes[:10])
    assert (await route(client, fleet, prompt_tokens=60_000))["reason"] == "above_threshold"
    server = redis.Redis(port=own_redis.port)

    # A failover or SCRIPT FLUSH: the same server, its script cache empty, before each step.
    server.script_flush()
    await kv_stored(client, fleet, "pd-a-p1", hashes[:30])  # ingest: the apply script
    server.script_flush()
    await telemetry(client, fleet)
    d = await route(client, fleet, prompt_tokens=40 * BLOCK, block_hashes=hashes)
    # The match script saw the 30 blocks stored after the flush: nothing was decided stale.
    assert (d["route"], d["reason"], d["stale"]) == ("local", "cache_affinity", False)
    assert d["cached_tokens"] == 30 * BLOCK
    server.script_flush()
    d = await route(client, fleet, prompt_tokens=60_000, request_id="after-flush")
    assert (d["route"], d["reason"], d["stale"]) == ("prfaas", "above_threshold", False)
    link = link_key("prfaas-x", "pd-a")
    held = telemetry_store.link_reserved_bytes(link, client=server)
    assert held >= d["reservation"]["bytes"] > 0  # the reservation script ran

    server.script_flush()
    outcome = {
        "decision": d,
        "decided_by": "control_plane",
        "origin": "pd-a",
        "prompt_tokens": 60_000,
        "route": d["route"],
        "reason": d["reason"],
        "prefill": {"cluster": d["prefill"]["cluster"], "instance": d["prefill"]["instance"]},
        "decode": {"cluster": d["decode"]["cluster"], "instance": d["decode"]["instance"]},
        "incremental_tokens": d["incremental_tokens"],
        "cached_tokens": 0,
        "output_tokens": 8,
        "observed_ttft_s": 2.0,
        "transfer": "finished",
        "transfer_bytes": d["reservation"]["bytes"],
        "status": "ok",
        "ts": time.time(),
        "request_id": "after-flush",
    }
    answer = await post(client, "/outcomes", {"outcomes": [outcome]}, fleet.router)
    assert answer.status_code == 200, answer.content
    # The release and counters scripts ran: the reservation is freed.
    assert (
        telemetry_store.link_reserved_bytes(link, client=server) == held - d["reservation"]["bytes"]
    )


async def test_route_keeps_its_snapshot_when_the_database_is_unreachable(
    client: AsyncClient, fleet: Fleet
) -> None:
    from django.db import connections

    from scheduling import snapshot as snapshot_module

    await telemetry(client, fleet)
    before = await route(client, fleet, prompt_tokens=60_000)
    port: dict[str, Any] = {}

    # Connections are per thread: touch the one the snapshot rebuild will use.
    def break_database() -> None:
        conn = connections["default"]
        port["saved"] = conn.settings_dict["PORT"]
        conn.close()
        conn.settings_dict["PORT"] = "1"  # nothing listens there: connecting fails at once

    def repair_database() -> None:
        conn = connections["default"]
        conn.close()
        conn.settings_dict["PORT"] = port["saved"]

    await sync_to_async(break_database)()
    try:
        # An inventory change announced meanwhile makes every process try to rebuild.
        await sync_to_async(snapshot_module.snapshot_version_bump)()
        after = await route(client, fleet, prompt_tokens=60_000)
    finally:
        await sync_to_async(repair_database)()
    assert (after["route"], after["reason"]) == (before["route"], before["reason"])
    assert after["policy_version"] == before["policy_version"]


@pytest.mark.parametrize(
    "hashes",
    [
        [0, 7, (1 << 64) - 1],
        [-1, -(1 << 63), 5],
        ["00000000000000ff", "0x" + "ab" * 32, 9],
    ],
)
def test_block_hashes_in_any_encoding_travel_as_the_index_keys(hashes: list[int | str]) -> None:
    body = json.dumps({"origin": "pd-a", "prompt_tokens": 10, "block_hashes": hashes}).encode()
    [item] = route_body_decode(body, batch=False)
    assert item.chain == b"".join(bytes.fromhex(block_hash_key(h)) for h in hashes)


def test_a_block_hash_beyond_64_bits_is_named_in_the_error() -> None:
    body = json.dumps(
        {"requests": [{"origin": "pd-a", "prompt_tokens": 10, "block_hashes": [1, 1 << 64]}]}
    ).encode()
    with pytest.raises(Invalid) as err:
        route_body_decode(body, batch=True)
    assert "requests[0].block_hashes[1]" in err.value.detail


# --- the prefix index read is bounded (issue 33) ------------------------------------------------

# Holds the Redis node that serves KEYS[1] for ARGV[1] microseconds: a slow shard (on a single
# Redis, the whole server).
_BUSY_LUA = """
local t0 = redis.call('TIME')
local start = t0[1] * 1000000 + t0[2]
while true do
  local t = redis.call('TIME')
  if t[1] * 1000000 + t[2] - start > tonumber(ARGV[1]) then return 1 end
end
"""


async def test_a_slow_index_shard_costs_the_decision_its_hits_not_its_deadline(
    client: AsyncClient, fleet: Fleet, redis_client: redis.Redis, settings: Any
) -> None:
    # The live state read just before stays in use meanwhile: only the index read meets the
    # slow node.
    settings.LIVE_STATE_MAX_AGE_S = 10
    settings.LIVE_STATE_REFRESH_S = 10
    settings.PREFIX_READ_DEADLINE_S = 0.02
    await telemetry(client, fleet)
    # Short enough to stay local with or without hits: nothing to reserve on the slow node.
    hashes = chain(12)
    await kv_stored(client, fleet, "pd-a-p1", hashes[:10])
    d = await route(client, fleet, prompt_tokens=12 * BLOCK, block_hashes=hashes)
    assert d["cached_tokens"] == 10 * BLOCK and d["prefill"]["instance"] == "pd-a-p1"
    assert "prefix_unavailable" not in d

    group = prefix_instance_prefix("pd-a-p1", prefix_index.prefix_index_groups())
    busy = asyncio.create_task(asyncio.to_thread(redis_client.eval, _BUSY_LUA, 1, group, 800_000))
    await asyncio.sleep(0.2)  # the script is running
    d = await route(client, fleet, prompt_tokens=12 * BLOCK, block_hashes=hashes)
    assert d["prefix_unavailable"] is True
    assert d["cached_tokens"] == 0
    assert d["stale"] is False  # decided on live state, without the slow shard's hits
    await busy

    async def counted() -> float:
        body = (await client.get("/metrics")).content.decode()
        line = next(x for x in body.splitlines() if x.startswith("prfaas_prefix_unavailable"))
        return float(line.split()[-1])

    for _ in range(100):
        if await counted() >= 1:
            break
        await asyncio.sleep(0.1)
    assert await counted() >= 1
