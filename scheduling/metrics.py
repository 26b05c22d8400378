"""``GET /metrics``: Prometheus text for decisions, decision latency, links and the prefix index.

Counters live in Redis, not in process memory, so the numbers are right with any number of
web workers (each worker adds to the same hashes in its write pipeline; any worker renders).

Key layout:

``metrics:decisions``         HASH  ``{route}|{reason}`` -> decisions
``metrics:latency:{mode}``    HASH  ``b{i}`` -> API calls whose decision latency fell in
                                    bucket ``i`` of ``LATENCY_BUCKETS_S`` (not cumulative),
                                    ``sum`` (seconds), ``count``; ``mode`` is single|batch
``metrics:route_errors``      HASH  error code -> refused route calls
``metrics:prefix``            HASH  ``unavailable`` -> decisions made without (some of) their
                                    prefix hits: the index read passed
                                    ``PREFIX_READ_DEADLINE_S`` or a shard failed
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from clusters.live import prefix_index, telemetry
from controlplane.redis_connection import redis_async, redis_sync
from scheduling.core.service_levels import TTFT_BUCKETS_S
from scheduling.snapshot import snapshot_cached, snapshot_refresh

DECISIONS_KEY = "metrics:decisions"
ROUTE_ERRORS_KEY = "metrics:route_errors"
PREFIX_KEY = "metrics:prefix"
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
MODES = ("single", "batch")


def latency_key(mode: str) -> str:
    return f"metrics:latency:{mode}"


def latency_increments(
    mode: str, seconds: float
) -> tuple[list[tuple[str, str, int, int]], list[tuple[str, str, float, int]]]:
    """One observation of an API call's decision latency, as integer and float
    ``(key, field, incr, 0)`` rows (for :func:`clusters.live.scripts.counters_queue`)."""
    key = latency_key(mode)
    bucket = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
    return [(key, f"b{bucket}", 1, 0), (key, "count", 1, 0)], [(key, "sum", seconds, 0)]


def prefix_unavailable_increment(n: int) -> tuple[str, str, int, int]:
    return (PREFIX_KEY, "unavailable", n, 0)


def decision_increments(
    counts: Mapping[tuple[str, str], int],
) -> list[tuple[str, str, int, int]]:
    """Decision counts by ``(route, reason)``, as ``(key, field, incr, 0)`` rows."""
    return [(DECISIONS_KEY, f"{route}|{reason}", n, 0) for (route, reason), n in counts.items()]


async def route_error_count_async(code: str, timeout_s: float) -> None:
    """Count a refused route call (best effort: metrics never fail a request)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(redis_async().hincrby(ROUTE_ERRORS_KEY, code, 1), timeout_s)


# Collectors other modules add to /metrics (e.g. scheduling.outcomes), registered when they
# are imported: this module need not import them.
_COLLECTORS: list[Callable[[], Any]] = []


def collector_register(factory: Callable[[], Any]) -> None:
    """Add a collector (made per scrape by ``factory``) to ``GET /metrics``."""
    _COLLECTORS.append(factory)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class LiveCollector:
    """Reads the counters and live state from Redis at scrape time."""

    def collect(self) -> Iterator[Metric]:
        r = redis_sync()
        decisions = CounterMetricFamily(
            "prfaas_decisions", "Routing decisions by route and reason", labels=["route", "reason"]
        )
        for field, value in sorted(r.hgetall(DECISIONS_KEY).items()):
            route, _, reason = _text(field).partition("|")
            decisions.add_metric([route, reason], float(value))
        yield decisions

        errors = CounterMetricFamily(
            "prfaas_route_errors", "Route calls refused, by error code", labels=["code"]
        )
        for field, value in sorted(r.hgetall(ROUTE_ERRORS_KEY).items()):
            errors.add_metric([_text(field)], float(value))
        yield errors

        yield CounterMetricFamily(
            "prfaas_prefix_unavailable",
            "Decisions made without (some of) their prefix hits: the index read passed "
            "PREFIX_READ_DEADLINE_S or a shard of it failed",
            value=float(r.hget(PREFIX_KEY, "unavailable") or 0),
        )

        latency = HistogramMetricFamily(
            "prfaas_decision_latency_seconds",
            "Time from request arrival to decision, per API call",
            labels=["mode"],
        )
        for mode in MODES:
            raw = {_text(k): v for k, v in r.hgetall(latency_key(mode)).items()}
            cumulative = 0.0
            buckets: list[tuple[str, float]] = []
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                cumulative += float(raw.get(f"b{i}", 0))
                buckets.append((repr(bound), cumulative))
            cumulative += float(raw.get(f"b{len(LATENCY_BUCKETS_S)}", 0))
            buckets.append(("+Inf", cumulative))
            latency.add_metric([mode], buckets, sum_value=float(raw.get("sum", 0)))
        yield latency

        snap = snapshot_cached()
        if snap is None:
            try:
                snap = snapshot_refresh()
            except Exception:
                snap = None
        util = GaugeMetricFamily(
            "prfaas_link_utilisation",
            "Latest link egress over capacity (0..1+)",
            labels=["source", "target"],
        )
        egress = GaugeMetricFamily(
            "prfaas_link_egress_gbps", "Latest link egress, Gbps", labels=["source", "target"]
        )
        inflight = GaugeMetricFamily(
            "prfaas_link_inflight_bytes",
            "KV bytes reserved in flight on the link",
            labels=["source", "target"],
        )
        budget = GaugeMetricFamily(
            "prfaas_link_inflight_budget_bytes",
            "In-flight KV budget of the link",
            labels=["source", "target"],
        )
        if snap is not None and snap.link_keys:
            states = telemetry.link_states_read(snap.link_keys)
            for (source, target), key in zip(snap.link_pairs, snap.link_keys, strict=True):
                spec = snap.topology.link_by_pair[(source, target)]
                state = states.get(key)
                gbps = state.gbps if state else 0.0
                util.add_metric([source, target], gbps / spec.gbps if spec.gbps > 0 else 0.0)
                egress.add_metric([source, target], gbps)
                inflight.add_metric([source, target], float(state.reserved_bytes if state else 0))
                budget.add_metric([source, target], float(spec.budget))
        yield util
        yield egress
        yield inflight
        yield budget

        # The engines' (or the emulator's) per-PD-cluster service counters, as reported.
        requests = CounterMetricFamily(
            "prfaas_cluster_requests", "Requests arrived per PD cluster", labels=["cluster"]
        )
        ttft = HistogramMetricFamily(
            "prfaas_cluster_ttft_seconds",
            "Time to first token per PD cluster, as the engines report it",
            labels=["cluster"],
        )
        for cluster, counters in sorted(telemetry.service_counters_read().items()):
            requests.add_metric([cluster], float(counters[1]))
            cumulative, buckets = 0.0, []
            for bound, count in zip((*TTFT_BUCKETS_S, math.inf), counters[3], strict=True):
                cumulative += float(count)
                buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
            ttft.add_metric([cluster], buckets, sum_value=float(counters[4]))
        yield requests
        yield ttft

        size = GaugeMetricFamily(
            "prfaas_prefix_index_entries",
            "Prefix-index entries (blocks and linear checkpoints) per instance",
            labels=["instance", "state"],
        )
        total = 0
        degraded = 0
        for st in prefix_index.prefix_index_states(client=r):
            size.add_metric([st.instance, st.state], float(st.blocks + st.checkpoints))
            total += st.blocks + st.checkpoints
            degraded += st.state == "degraded"
        yield size
        yield GaugeMetricFamily(
            "prfaas_prefix_index_fleet_entries",
            "Prefix-index entries, all instances together",
            value=total,
        )
        yield GaugeMetricFamily(
            "prfaas_prefix_index_degraded_instances",
            "Instances whose KV-event stream showed a sequence gap",
            value=degraded,
        )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition of the control plane's live numbers (no secrets; no auth)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector())
    for factory in _COLLECTORS:
        registry.register(factory())
    try:
        body = generate_latest(registry)
    except Exception as exc:  # Redis down: say so rather than a 500 page
        return HttpResponse(
            f"# live state unavailable: {type(exc).__name__}\n",
            status=503,
            content_type=CONTENT_TYPE_LATEST,
        )
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
