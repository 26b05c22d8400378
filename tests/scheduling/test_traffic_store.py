"""The traffic store: per-minute counts and the incremental-length histogram, read as windows."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest
import redis

from clusters.live import telemetry
from controlplane.redis_scripts import pipeline_run
from scheduling import traffic
from scheduling.rebalance.inputs import window_from_traffic
from scheduling.traffic import TrafficRecord


def record(ts: float, route: str, incr: int, reason: str, origin: str = "pd-a") -> TrafficRecord:
    return TrafficRecord(origin, ts, route, reason, incr, cached_tokens=100, output_tokens=10)


def test_bins_are_log_spaced_and_cover_every_length() -> None:
    edges = traffic.BIN_EDGES
    assert edges[0] == 0 and edges[1] == 64
    assert all(b > a for a, b in itertools.pairwise(edges))
    assert traffic.length_bin(0) == 0
    assert traffic.length_bin(64) == 1
    assert traffic.length_bin(10**9) == len(edges) - 1


def test_counting_a_decision_without_its_record_adds_the_same_fields() -> None:
    by_record, by_count = traffic.TrafficAggregate(), traffic.TrafficAggregate()
    decisions = [
        ("pd-a", 120.0, "prfaas", "above_threshold", 30_000, 512, 40),
        ("pd-a", 130.0, "local", "cache_affinity", 0, 1024, None),
        ("pd-a", 200.0, "local", "below_threshold", 100, 0, 0),
    ]
    for origin, ts, route, reason, incr, cached, out in decisions:
        by_record.add(TrafficRecord(origin, ts, route, reason, incr, cached, out))
        by_count.count(origin, ts, route, reason, incr, cached, out)

    assert by_count.fields == by_record.fields
    first_minute = by_count.fields[traffic.traffic_key("pd-a", 2)]
    assert first_minute == {
        "arrivals": 2,
        f"h:{traffic.length_bin(30_000)}": 1,
        f"h:{traffic.length_bin(0)}": 1,
        "r:above_threshold": 1,
        "r:cache_affinity": 1,
        "cache_hit_tokens": 1536,
        "incremental_tokens": 30_000,
        "offloads": 1,
        "output_tokens": 40,
        "output_known": 1,
    }
    # Nothing is written for what adds nothing: no cached tokens, no output tokens.
    second_minute = by_count.fields[traffic.traffic_key("pd-a", 3)]
    assert "cache_hit_tokens" not in second_minute and "output_tokens" not in second_minute
    assert second_minute["output_known"] == 1


def test_window_sums_minutes_of_one_cluster_only(redis_client: redis.Redis) -> None:
    base = 1_700_000_040.0  # a minute boundary
    pipe = redis_client.pipeline()
    for rec in [
        record(base + 1, "local", 100, "below_threshold"),
        record(base + 61, "prfaas", 30_000, "above_threshold"),
        record(base + 121, "prfaas", 30_000, "above_threshold"),
        record(base + 61, "prfaas", 30_000, "above_threshold", origin="pd-b"),
    ]:
        traffic.traffic_record_queue(pipe, rec, json.dumps({"reason": rec.reason}))
    pipe.execute()

    window = traffic.traffic_window_read("pd-a", base, base + 120)
    assert (window.minutes, window.arrivals, window.offloads) == (2, 2, 1)
    assert window.reasons == {"below_threshold": 1, "above_threshold": 1}
    assert window.histogram[traffic.length_bin(100)] == 1
    assert window.histogram[traffic.length_bin(30_000)] == 1
    assert sum(window.histogram) == window.arrivals
    assert window.cache_hit_tokens == 200 and window.output_tokens == 20
    assert window.offload_fraction == 0.5
    assert len(traffic.recent_decisions_read(10)) == 4


def test_many_reservations_in_one_call_take_turns_per_link(redis_client: redis.Redis) -> None:
    base = time.time() // 60 * 60  # reservations are read against now
    # An expired holder on L is swept by the same call that reserves again.
    assert telemetry.link_reserve("L", "old", 900, end_ts=base - 1, budget_bytes=1000, now=base - 5)
    items = [
        telemetry.Reservation(link, f"{link}-{i}", 400, base + 600, 1000)
        for i in range(3)
        for link in ("L", "M")
    ]
    raws = pipeline_run(
        redis_client, lambda pipe: telemetry.link_reserve_many_queue(pipe, items, base)
    )
    flat = telemetry.link_reserve_many_parse(items, raws)
    # Per link in call order: 400, 800, then refused at 800 (each sees the ones before it).
    assert flat == [1, 400, 1, 400, 1, 800, 1, 800, 0, 800, 0, 800]
    assert telemetry.link_reserved_bytes("L") == 800 and telemetry.link_reserved_bytes("M") == 800
    # Every key the call wrote still expires.
    for key in redis_client.scan_iter("live:*"):
        assert redis_client.ttl(key) > 0, key


def test_the_rebalancers_window_reads_its_rate_in_the_fleets_clock(
    redis_client: redis.Redis, settings: Any
) -> None:
    """The router counts arrivals per wall second; an emulated fleet running four times faster
    than the wall clock serves them in a quarter of the time its capacities assume."""
    start = (int(time.time()) // 60 - 3) * 60
    pipe = redis_client.pipeline()
    for i in range(240):
        traffic.traffic_record_queue(
            pipe, record(start + i / 2, "local", 3000, "below_threshold"), None
        )
    pipe.execute()
    raw = traffic.traffic_window_read("pd-a", start, start + 120)
    settings.FLEET_CLOCK_SPEED = 1.0
    wall = window_from_traffic(raw, recorder_seen_at=start + 120, default_output_tokens=512)
    assert wall.arrival_rate == pytest.approx(2.0) and raw.arrival_rate == pytest.approx(2.0)
    settings.FLEET_CLOCK_SPEED = 4.0
    fleet = window_from_traffic(raw, recorder_seen_at=start + 120, default_output_tokens=512)
    assert fleet.arrival_rate == pytest.approx(0.5)
    assert raw.arrival_rate == pytest.approx(0.5)
    assert fleet.coverage == wall.coverage  # what the recorder wrote does not change
