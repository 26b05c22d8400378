"""Telemetry and KV-event endpoints with real Redis: idempotency, both vLLM encodings, gaps,
and every bad input answered with the error shape."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
import redis
from django.test import Client

from clusters.live import prefix_index, telemetry
from clusters.live.keys import prefix_instance_prefix
from clusters.models import InstanceRole
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksStored
from scheduling.core.service_levels import TTFT_BUCKETS_S, ttft_bucket
from tests.factories import (
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    PrfaasClusterFactory,
    api_token,
    bearer,
)
from tests.fleet.captured import CapturedFrame
from tests.support.servers import free_port


@pytest.fixture
def agent(db: None, redis_client: redis.Redis, route_state_clean: None) -> dict[str, str]:
    # vLLM on CPU caches 32-token blocks: the profile says so (the captured frames use it)
    pd = ClusterFactory(name="pd-a", model__block_tokens=32)
    pf = PrfaasClusterFactory(name="prfaas-x", model=pd.model)
    InstanceFactory(cluster=pd, name="pd-a-p0", role=InstanceRole.PREFILL)
    InstanceFactory(cluster=pd, name="pd-a-d0", role=InstanceRole.DECODE)
    LinkFactory(source=pf, target=pd)
    return bearer(api_token("agent")[1])


def post(path: str, body: Any, headers: dict[str, str]) -> Any:
    return Client().post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", headers=headers
    )


def test_a_telemetry_batch_sent_twice_is_stored_once(agent: dict[str, str]) -> None:
    now = time.time()
    first = {
        "idempotency_key": "agent-7/42",
        "instances": [{"instance": "pd-a-p0", "ts": now, "queue_depth": 3, "kv_usage": 0.4}],
        "links": [
            {
                "source": "prfaas-x",
                "target": "pd-a",
                "ts": now,
                "bytes_sent": 10**9,
                "interval_s": 2,
            }
        ],
    }
    r1 = post("/telemetry", first, agent)
    assert r1.status_code == 200 and r1.json()["stored"] is True
    again = {**first, "instances": [{"instance": "pd-a-p0", "ts": now, "queue_depth": 99}]}
    r2 = post("/telemetry", again, agent)
    assert r2.status_code == 200 and r2.json()["stored"] is False
    assert telemetry.instance_states_read(["pd-a-p0"])["pd-a-p0"].queue_depth == 3
    assert telemetry.link_states_read(["prfaas-x->pd-a"])["prfaas-x->pd-a"].gbps == pytest.approx(
        4.0
    )


def test_service_counters_in_telemetry_are_kept_per_pd_cluster_and_exported(
    agent: dict[str, str],
) -> None:
    buckets = [0] * (len(TTFT_BUCKETS_S) + 1)
    buckets[ttft_bucket(0.3)] = 7
    counters: dict[str, Any] = {
        "cluster": "pd-a",
        "ts": time.time(),
        "arrivals": 9,
        "first_tokens": 7,
        "ttft_buckets": buckets,
        "ttft_sum_s": 2.1,
    }
    response = post("/telemetry", {"idempotency_key": "agent-7/43", "clusters": [counters]}, agent)
    assert response.status_code == 200, response.content
    (stored,) = telemetry.service_counters_read().values()
    assert stored[1:4] == [9, 7, buckets]
    metrics = Client().get("/metrics").content.decode()
    assert 'prfaas_cluster_requests_total{cluster="pd-a"} 9.0' in metrics
    assert 'prfaas_cluster_ttft_seconds_sum{cluster="pd-a"} 2.1' in metrics
    short = {**counters, "ttft_buckets": [1, 2]}
    refused = post("/telemetry", {"idempotency_key": "agent-7/44", "clusters": [short]}, agent)
    assert refused.status_code == 422 and "ttft_buckets" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("body", "status", "detail_part"),
    [
        ({"instances": []}, 422, "idempotency_key"),
        ({"idempotency_key": "k", "instances": [{"instance": "ghost", "ts": 1.0}]}, 404, "ghost"),
        ({"idempotency_key": "k", "instances": [{"instance": "pd-a-p0", "ts": -1}]}, 422, "ts"),
        (
            {
                "idempotency_key": "k",
                "instances": [{"instance": "pd-a-p0", "ts": 1, "kv_usage": 2}],
            },
            422,
            "kv_usage",
        ),
        (
            {
                "idempotency_key": "k",
                "instances": [{"instance": "pd-a-p0", "ts": 1, "running": -1}],
            },
            422,
            "running",
        ),
        (
            {
                "idempotency_key": "k",
                "links": [
                    {
                        "source": "pd-a",
                        "target": "prfaas-x",
                        "ts": 1,
                        "bytes_sent": 1,
                        "interval_s": 1,
                    }
                ],
            },
            404,
            "unknown link",
        ),
        (
            {
                "idempotency_key": "k",
                "links": [
                    {
                        "source": "prfaas-x",
                        "target": "pd-a",
                        "ts": 1,
                        "bytes_sent": 1,
                        "interval_s": 0,
                    }
                ],
            },
            422,
            "interval_s",
        ),
    ],
)
def test_bad_telemetry_gets_a_clear_error_and_stores_nothing(
    agent: dict[str, str], body: Any, status: int, detail_part: str
) -> None:
    response = post("/telemetry", body, agent)
    assert response.status_code == status, response.content
    got = response.json()
    assert set(got) == {"detail", "code"} and detail_part in got["detail"]
    assert telemetry.instance_states_read(["pd-a-p0"]) == {}


def test_samples_stamped_in_the_future_are_taken_as_now(agent: dict[str, str]) -> None:
    before = time.time()
    body = {"idempotency_key": "skewed", "instances": [{"instance": "pd-a-p0", "ts": 9e12}]}
    assert post("/telemetry", body, agent).status_code == 200
    stamped = telemetry.instance_states_read(["pd-a-p0"])["pd-a-p0"].ts
    assert before <= stamped <= time.time()


def test_kv_events_in_both_encodings_feed_the_prefix_index(agent: dict[str, str]) -> None:
    digest = "ab" * 24 + f"{2:016x}"  # a 32-byte digest whose low 64 bits are 2
    array_form = [time.time(), [["BlockStored", [1, digest], None, [], 32, None, "GPU"]]]
    map_form = {
        "ts": time.time(),
        "events": [{"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2}],
    }
    body = {
        "instance": "pd-a-p0",
        "batches": [{"seq": 0, "batch": array_form}, {"seq": 1, "batch": map_form}],
    }
    response = post("/kv-events", body, agent)
    assert response.status_code == 200, response.content
    assert response.json()["applied"] == 2 and response.json()["state"] == "exact"
    chain = [prefix_index.block_hash_key(h) for h in (1, 2, 3, 4)]
    assert prefix_index.prefix_match(chain, 32).tokens_by_instance == {"pd-a-p0": 96}

    removed = {"seq": 2, "batch": [time.time(), [["BlockRemoved", [2]]]]}
    post("/kv-events", {"instance": "pd-a-p0", "batches": [removed]}, agent)
    assert prefix_index.prefix_match(chain, 32).tokens_by_instance == {"pd-a-p0": 32}


def test_a_sequence_gap_degrades_the_instance_until_cleared(agent: dict[str, str]) -> None:
    def batch(seq: int, *events: Any) -> dict[str, Any]:
        return {"seq": seq, "batch": [time.time(), list(events)]}

    post(
        "/kv-events",
        {"instance": "pd-a-p0", "batches": [batch(0, ["BlockStored", [1], None, [], 32])]},
        agent,
    )
    gap = post("/kv-events", {"instance": "pd-a-p0", "batches": [batch(3)]}, agent).json()
    assert (gap["state"], gap["missed_batches"]) == ("degraded", 2)
    dup = post("/kv-events", {"instance": "pd-a-p0", "batches": [batch(3)]}, agent).json()
    assert dup["duplicates"] == 1
    cleared = post(
        "/kv-events", {"instance": "pd-a-p0", "batches": [batch(4, ["AllBlocksCleared"])]}, agent
    )
    assert cleared.json()["state"] == "exact"


@pytest.mark.parametrize(
    ("body", "status", "detail_part"),
    [
        ({"instance": "ghost", "batches": [{"seq": 0, "batch": [0, []]}]}, 404, "ghost"),
        ({"instance": "pd-a-p0", "batches": []}, 422, "batches"),
        ({"instance": "pd-a-p0", "batches": [{"seq": -1, "batch": [0, []]}]}, 422, "seq"),
        ({"instance": "pd-a-p0", "batches": [{"batch": [0]}]}, 422, "batches[0].batch"),
        (
            {"instance": "pd-a-p0", "batches": [{"batch": [0, [["BlockStored", "x"]]]}]},
            422,
            "block_hashes",
        ),
        (
            {"instance": "pd-a-p0", "batches": [{"batch": [0, [["BlockStored", ["zz"]]]]}]},
            422,
            "block_hashes[0]",
        ),
        ({"instance": "pd-a-p0", "batches": [{"batch": [0, [42]]}]}, 422, "events[0]"),
        ({"instance": "pd-a-p0", "batches": [{"batch": {"ts": "now", "events": []}}]}, 422, "ts"),
    ],
)
def test_bad_kv_events_get_a_clear_error(
    agent: dict[str, str], body: Any, status: int, detail_part: str
) -> None:
    response = post("/kv-events", body, agent)
    assert response.status_code == status, response.content
    got = response.json()
    assert set(got) == {"detail", "code"} and detail_part in got["detail"]


def test_unknown_event_types_from_newer_engines_are_skipped(agent: dict[str, str]) -> None:
    body = {"instance": "pd-a-p0", "batches": [{"seq": 0, "batch": [0, [["BlockPromoted", [1]]]]}]}
    response = post("/kv-events", body, agent)
    assert response.status_code == 200 and response.json()["applied"] == 1


def test_an_engine_with_another_block_size_is_refused_naming_both(agent: dict[str, str]) -> None:
    batch = [time.time(), [{"type": "BlockStored", "block_hashes": [1], "block_size": 16}]]
    body = {"instance": "pd-a-p0", "batches": [{"seq": 0, "batch": batch}]}
    response = post("/kv-events", body, agent)
    assert response.status_code == 422
    got = response.json()
    assert got["code"] == "block_size_mismatch"
    assert "16" in got["detail"] and "block_tokens 32" in got["detail"]
    assert prefix_index.prefix_index_states(["pd-a-p0"])[0].blocks == 0


def post_msgpack(
    body: Any, headers: dict[str, str], content_type: str = "application/msgpack"
) -> Any:
    return Client().post(
        "/api/v1/kv-events/msgpack",
        data=msgspec.msgpack.encode(body),
        content_type=content_type,
        headers=headers,
    )


def test_real_vllm_frames_feed_the_index_through_the_msgpack_endpoint(
    agent: dict[str, str], captured_frames: list[CapturedFrame]
) -> None:
    """Frames of a real vLLM 0.32 (int hashes): request A's 11 blocks, its 12th block, then
    request B sharing the first 11: the index holds 13 blocks, and A's chain matches 12."""
    int_frames = [f for f in captured_frames if f.section in "ABC"]
    body = {"instance": "pd-a-p0", "batches": [[f.seq, f.payload] for f in int_frames]}
    response = post_msgpack(body, agent)
    assert response.status_code == 200, response.content
    assert response.json()["applied"] == 3
    a_chain = [prefix_index.block_hash_key(h) for h in int_frames[0].decoded_hashes()]
    a_chain.append(prefix_index.block_hash_key(int_frames[1].decoded_hashes()[0]))
    assert prefix_index.prefix_match(a_chain, 32).tokens_by_instance == {"pd-a-p0": 12 * 32}
    assert prefix_index.prefix_index_states(["pd-a-p0"])[0].blocks == 13


def test_digest_hashes_fold_to_the_int_hashes_of_the_same_blocks(
    agent: dict[str, str], captured_frames: list[CapturedFrame]
) -> None:
    by_section = {f.section: f for f in captured_frames}
    body = {"instance": "pd-a-p0", "batches": [[0, by_section["D"].payload]]}
    assert post_msgpack(body, agent).status_code == 200
    int_chain = [prefix_index.block_hash_key(h) for h in by_section["A"].decoded_hashes()]
    assert prefix_index.prefix_match(int_chain, 32).tokens_by_instance == {"pd-a-p0": 11 * 32}


@pytest.mark.parametrize(
    ("data", "content_type", "status", "detail_part"),
    [
        (
            msgspec.msgpack.encode({"instance": "pd-a-p0", "batches": [[0, b"\xc1"]]}),
            None,
            422,
            "batches[0].batch",
        ),
        (b"\x93", None, 422, "body"),
        (
            msgspec.msgpack.encode({"instance": "ghost", "batches": [[0, b"\x92\x00\x90"]]}),
            None,
            404,
            "ghost",
        ),
        (msgspec.msgpack.encode({"instance": "pd-a-p0", "batches": []}), None, 422, "batches"),
        (b"{}", "application/json", 415, "application/msgpack"),
    ],
)
def test_bad_msgpack_bodies_get_a_clear_error(
    agent: dict[str, str], data: bytes, content_type: str | None, status: int, detail_part: str
) -> None:
    response = Client().post(
        "/api/v1/kv-events/msgpack",
        data=data,
        content_type=content_type or "application/msgpack",
        headers=agent,
    )
    assert response.status_code == status, response.content
    got = response.json()
    assert set(got) == {"detail", "code"} and detail_part in got["detail"]


def test_kv_events_while_redis_is_away_get_503_to_retry(
    agent: dict[str, str], settings: Any
) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings.REDIS_CLUSTER_URL = ""  # live state on that Redis, whatever the session has
    batch = [time.time(), [{"type": "BlockStored", "block_hashes": [1], "block_size": 32}]]
    response = post("/kv-events", {"instance": "pd-a-p0", "batches": [{"batch": batch}]}, agent)
    assert response.status_code == 503, response.content
    assert response.json()["code"] == "live_store_unavailable"


# --- the largest bodies the limits allow (issue 13: ingest cost linear in the post) ----------


def largest_telemetry(limit: int, key: str) -> bytes:
    """1,000 link samples of an hour each (the limits' worst case, once 0.2 s apiece), then
    instance samples up to the body limit."""
    now = time.time()
    links = [
        {
            "source": "prfaas-x",
            "target": "pd-a",
            "ts": now - 3600 * i,
            "bytes_sent": 450 * 10**9,
            "interval_s": 3600,
        }
        for i in range(1_000)
    ]
    body: dict[str, Any] = {"idempotency_key": key, "links": links, "instances": []}
    sample = {"instance": "pd-a-p0", "ts": now, "queue_depth": 7}
    room = limit - len(json.dumps(body, separators=(",", ":")))
    body["instances"] = [sample] * (room // (len(json.dumps(sample, separators=(",", ":"))) + 1))
    return json.dumps(body, separators=(",", ":")).encode()


def largest_kv_frames(limit: int) -> tuple[bytes, int]:
    """``/kv-events/msgpack`` batches of one BlockStored of 16 blocks, up to the body limit."""
    batches: list[tuple[int, bytes]] = []
    block = 0
    while True:
        event = BlocksStored(list(range(block, block + 16)), 32, medium="GPU")
        batches.append((len(batches), kv_vllm.batch_encode([event], time.time())))
        body = msgspec.msgpack.encode({"instance": "pd-a-p0", "batches": batches})
        if len(body) > limit:
            batches.pop()
            return msgspec.msgpack.encode({"instance": "pd-a-p0", "batches": batches}), block
        block += 16


def test_the_largest_telemetry_body_allowed_is_applied_and_one_byte_more_is_413(
    agent: dict[str, str], settings: Any
) -> None:
    limit = settings.API_MAX_BODY_BYTES
    body = largest_telemetry(limit, "big-1")
    assert limit - 200 < len(body) <= limit
    response = Client().post(
        "/api/v1/telemetry", data=body, content_type="application/json", headers=agent
    )
    assert response.status_code == 200, response.content
    assert response.json()["links"] == 1_000 and response.json()["stored"] is True
    assert telemetry.instance_states_read(["pd-a-p0"])["pd-a-p0"].queue_depth == 7
    # the newest sample's hour is there, at 1 Gbps (450 GB over 3600 s)
    now = time.time()
    series = telemetry.link_bandwidth_series("prfaas-x->pd-a", now - 600, now)
    assert series and all(g == pytest.approx(1.0) for _, g in series)

    too_big = body[:-1] + b" " * (limit - len(body) + 1) + b"}"
    refused = Client().post(
        "/api/v1/telemetry", data=too_big, content_type="application/json", headers=agent
    )
    assert refused.status_code == 413
    assert set(refused.json()) == {"detail", "code"}
    assert refused.json()["code"] == "payload_too_large"


def test_more_samples_or_a_longer_interval_than_the_limits_is_a_422(agent: dict[str, str]) -> None:
    link = {"source": "prfaas-x", "target": "pd-a", "ts": 1.0, "bytes_sent": 1, "interval_s": 1}
    many = post("/telemetry", {"idempotency_key": "m", "links": [link] * 1_001}, agent)
    assert many.status_code == 422 and set(many.json()) == {"detail", "code"}
    long = post(
        "/telemetry", {"idempotency_key": "l", "links": [{**link, "interval_s": 3601}]}, agent
    )
    assert long.status_code == 422 and "interval_s" in long.json()["detail"]
    assert telemetry.link_states_read(["prfaas-x->pd-a"]) == {}


def test_the_largest_kv_events_body_allowed_is_applied_and_one_byte_more_is_413(
    agent: dict[str, str], settings: Any
) -> None:
    limit = settings.API_MAX_BODY_BYTES
    body, blocks = largest_kv_frames(limit)
    response = Client().post(
        "/api/v1/kv-events/msgpack", data=body, content_type="application/msgpack", headers=agent
    )
    assert response.status_code == 200, response.content
    assert response.json()["applied"] == blocks // 16
    assert prefix_index.prefix_index_states(["pd-a-p0"])[0].blocks == blocks
    refused = Client().post(
        "/api/v1/kv-events/msgpack",
        data=body + b"\x00" * (limit - len(body) + 1),
        content_type="application/msgpack",
        headers=agent,
    )
    assert refused.status_code == 413 and refused.json()["code"] == "payload_too_large"


@pytest.mark.parametrize("seq", [2**53, 2**63, 2**64 - 1])
def test_a_sequence_number_beyond_2_53_is_refused_in_both_encodings_and_nothing_degrades(
    agent: dict[str, str], seq: int
) -> None:
    as_json = {"instance": "pd-a-p0", "batches": [{"seq": seq, "batch": [0, []]}]}
    refused = post("/kv-events", as_json, agent)
    assert refused.status_code == 422 and "seq" in refused.json()["detail"]
    frames = {"instance": "pd-a-p0", "batches": [[seq, kv_vllm.batch_encode([], 0.0)]]}
    refused = post_msgpack(frames, agent)
    assert refused.status_code == 422 and "seq" in refused.json()["detail"]
    state = prefix_index.prefix_index_states(["pd-a-p0"])[0]
    assert (state.state, state.last_seq) == ("exact", None)
    largest = {"instance": "pd-a-p0", "batches": [{"seq": 2**53 - 1, "batch": [0, []]}]}
    assert post("/kv-events", largest, agent).status_code == 200
    assert prefix_index.prefix_index_states(["pd-a-p0"])[0].last_seq == 2**53 - 1


def test_telemetry_while_redis_is_away_is_a_json_503(agent: dict[str, str], settings: Any) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.REDIS_CLUSTER_URL = ""  # live state on that Redis, whatever the session has
    body = {"idempotency_key": "away", "instances": [{"instance": "pd-a-p0", "ts": time.time()}]}
    response = post("/telemetry", body, agent)
    assert response.status_code == 503, response.content
    assert set(response.json()) == {"detail", "code"}
    assert response.json()["code"] == "live_store_unavailable"


def test_all_blocks_cleared_on_400k_entries_answers_2xx_and_is_swept_in_bounded_steps(
    agent: dict[str, str], redis_client: redis.Redis
) -> None:
    """Issue 13: the clear deleted 400,000 records in one script (Redis held 1.5 s, the post
    answered 500 although applied). Now the entries vanish at once and are swept later."""
    n = 400_000
    for start in range(0, n, 10_000):
        keys = b"".join((start + k + 1).to_bytes(8, "big") for k in range(10_000))
        prefix_index.kv_batch_apply("pd-a-p0", None, [prefix_index.StoredBlocks(keys)], cap=n + 1)
    first = [prefix_index.block_hash_key(b) for b in (1, 2, 3)]
    assert prefix_index.prefix_match(first, 32).tokens_by_instance == {"pd-a-p0": 96}

    clear = {"instance": "pd-a-p0", "batches": [{"seq": 0, "batch": [0, [["AllBlocksCleared"]]]}]}
    response = post("/kv-events", clear, agent)
    assert response.status_code == 200, response.content
    assert (response.json()["applied"], response.json()["state"]) == (1, "exact")
    assert prefix_index.prefix_match(first, 32).tokens_by_instance == {}
    assert prefix_index.prefix_index_states(["pd-a-p0"])[0].blocks == 0
    group = prefix_instance_prefix("pd-a-p0", prefix_index.prefix_index_groups())
    assert redis_client.llen(f"{group}graveyard") > 0  # the records wait for the sweeper

    steps = 0
    while prefix_index.prefix_index_sweep(budget=50_000):
        steps += 1
    assert steps >= n // 50_000 - 2  # bounded steps, not one long script
    assert redis_client.llen(f"{group}graveyard") == 0
    assert not redis_client.keys(f"{group}gy:[0-9]*".replace("{", "\\{").replace("}", "\\}"))
    buckets = redis_client.scan_iter("pfx:*h:*", count=1000)
    assert all(redis_client.hlen(key) == 0 for key in buckets)
    # a block the instance stores again is its own, once
    again = {
        "instance": "pd-a-p0",
        "batches": [{"seq": 1, "batch": [0, [["BlockStored", [1], None, [], 32]]]}],
    }
    assert post("/kv-events", again, agent).status_code == 200
    assert prefix_index.prefix_match(first[:1], 32).tokens_by_instance == {"pd-a-p0": 32}
