"""Reason codes: why a routing decision went where it went (one per decision).

The codes are part of the API (``reason`` of a decision, metrics labels); the descriptions are
what the docs and the operator UI show next to them.
"""

from __future__ import annotations


class Reason:
    """Reason codes: why a decision went where it went (one per decision)."""

    BELOW_THRESHOLD = "below_threshold"
    ABOVE_THRESHOLD = "above_threshold"
    LINK_CONGESTED = "link_congested"
    PRFAAS_BACKLOG = "prfaas_backlog"
    CACHE_AFFINITY = "cache_affinity"
    TELEMETRY_STALE = "telemetry_stale"
    PRFAAS_UNAVAILABLE = "prfaas_unavailable"
    ORIGIN_UNAVAILABLE = "origin_unavailable"
    NO_DECODE_CAPACITY = "no_decode_capacity"


REASON_DESCRIPTIONS: dict[str, str] = {
    Reason.BELOW_THRESHOLD: "local: the prompt (minus nothing or little cached) is not above the "
    "threshold; it would stay local even without any prefix cache",
    Reason.ABOVE_THRESHOLD: "prfaas: the incremental length is above the effective threshold "
    "and a linked PrfaaS cluster had link and queue headroom",
    Reason.LINK_CONGESTED: "local: the request would have been offloaded, but the link is "
    "congested (the threshold was raised by egress congestion, the link is saturated, or its "
    "in-flight KV budget has no room for this request's bytes)",
    Reason.PRFAAS_BACKLOG: "local: the request would have been offloaded, but the PrfaaS queue "
    "is backed up (the threshold was raised by PrfaaS backlog, or the backlog is above the "
    "hard limit guards.prfaas_backlog_reject_s)",
    Reason.CACHE_AFFINITY: "local: the prompt is above the threshold but a cached prefix "
    "(local, or moved from a PrfaaS cluster by a cache transfer) brings the incremental "
    "length under it",
    Reason.TELEMETRY_STALE: "live state is missing or older than guards.stale_after_s: the "
    "policy's static rule was applied (or everything kept local, guards.stale_mode='local')",
    Reason.PRFAAS_UNAVAILABLE: "local: the request is above the threshold but no PrfaaS "
    "cluster linked to the origin has an active prefill instance",
    Reason.ORIGIN_UNAVAILABLE: "prfaas: the origin has no active prefill instance, so the "
    "prefill was offloaded whatever its length (also the code of RouteUnavailable when no "
    "prefill can run anywhere)",
    Reason.NO_DECODE_CAPACITY: "code of RouteUnavailable: the origin has no active decode "
    "instance, so the request cannot be served",
}
REASONS = tuple(REASON_DESCRIPTIONS)
