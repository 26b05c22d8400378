"""The gateway's own ``/metrics`` (Prometheus conventions: ``_total`` counters, ``_seconds``
histograms, base units), in a registry of its own so that nothing else leaks in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

REQUESTS = Counter(
    "prfaas_gateway_requests",
    "Requests answered, by API endpoint, served route and status",
    ["endpoint", "route", "status"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "prfaas_gateway_decisions",
    "Decisions carried out, by route and reason (after any fallback)",
    ["route", "reason"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "prfaas_gateway_errors",
    "Failures by kind: prefill_failed, decode_failed, retried, fallback_local, "
    "cache_transfer_failed, client_disconnect, queue_full, reservation_refused, "
    "reservation_unavailable, control_plane_unreachable, bad_request",
    ["kind"],
    registry=REGISTRY,
)
TTFT = Histogram(
    "prfaas_gateway_ttft_seconds",
    "Arrival to first token (first streamed chunk; the prefill's answer when not streamed)",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "prfaas_gateway_itl_seconds",
    "Time between streamed chunks of one answer",
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
DURATION = Histogram(
    "prfaas_gateway_request_seconds",
    "Arrival to the last byte of the answer",
    ["route"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
STEP = Histogram(
    "prfaas_gateway_step_seconds",
    "Steps: prefill (whole answer), decode (to its headers), cache_transfer (upstream); "
    "hash (the prompt's block hashes, in the gateway)",
    ["step"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
LOOP_LAG = Histogram(
    "prfaas_gateway_event_loop_lag_seconds",
    "How late the event loop ran a timer due every 20 ms (work that held the loop: every "
    "request in the process waited as long)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
    registry=REGISTRY,
)
EJECTIONS = Counter(
    "prfaas_gateway_ejections",
    "Engines ejected after failing or hanging (outlier detection), by instance",
    ["instance"],
    registry=REGISTRY,
)
INFLIGHT = Gauge("prfaas_gateway_inflight_requests", "Requests being served now", registry=REGISTRY)
WAITING = Gauge(
    "prfaas_gateway_waiting_requests", "Requests queued for a serving slot", registry=REGISTRY
)
DEGRADED = Gauge(
    "prfaas_gateway_degraded",
    "1 while the control plane refuses this gateway's token (/health says degraded)",
    registry=REGISTRY,
)
LIVE_AGE = Gauge(
    "prfaas_gateway_live_state_age_seconds",
    "Age of the live state decisions use (-1: none fetched yet)",
    registry=REGISTRY,
)
OUTCOMES_PENDING = Gauge(
    "prfaas_gateway_outcomes_pending",
    "Outcomes not yet sent to the control plane",
    registry=REGISTRY,
)
OUTCOMES_REJECTED = Counter(
    "prfaas_gateway_outcomes_rejected",
    "Outcomes the control plane refused one by one, by its code (their reservations are "
    "released all the same)",
    ["code"],
    registry=REGISTRY,
)
OUTCOMES_DROPPED = Counter(
    "prfaas_gateway_outcomes_dropped",
    "Outcomes dropped (buffer full while the control plane was away, or refused)",
    registry=REGISTRY,
)
