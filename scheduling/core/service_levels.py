"""Service levels of a PD cluster: request rate and TTFT quantiles from cumulative counters.

Engines (and the fleet emulator standing in for them) report, per PD cluster, cumulative
counters as Prometheus histograms do: requests arrived, requests that got their first token,
and first tokens per TTFT bucket (``TTFT_BUCKETS_S``, upper bounds; one more bucket for above
the last). Two reports make a window: the rate is the arrivals between them over the time
between them, the quantiles come from the bucket counts between them, interpolated linearly
inside a bucket as Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Upper bounds in seconds (vLLM's time_to_first_token buckets, up to 80 s); the last bucket
# counts everything above the last bound.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 80.0,
)  # fmt: skip


def ttft_bucket(seconds: float) -> int:
    """Index of the bucket holding ``seconds`` (the last index: above every bound)."""
    return bisect.bisect_left(TTFT_BUCKETS_S, seconds)


@dataclass(frozen=True)
class ServiceCounters:
    """One report of a PD cluster's cumulative counters at ``ts`` (unix seconds)."""

    cluster: str
    ts: float
    arrivals: int
    first_tokens: int
    ttft_buckets: tuple[int, ...]  # per bucket, not cumulative; len(TTFT_BUCKETS_S) + 1
    ttft_sum_s: float = 0.0  # of every first token's TTFT


@dataclass(frozen=True)
class ServiceLevel:
    """What a PD cluster served between two reports."""

    cluster: str
    start: float
    end: float
    rate_rps: float
    first_tokens: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None


def histogram_quantile(counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile of per-bucket counts over ``TTFT_BUCKETS_S`` (None: no count)."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(TTFT_BUCKETS_S):
                return TTFT_BUCKETS_S[-1]  # above the last bound: the bound is all we know
            low = TTFT_BUCKETS_S[i - 1] if i > 0 else 0.0
            return low + (TTFT_BUCKETS_S[i] - low) * (rank - seen) / n
        seen += n
    return TTFT_BUCKETS_S[-1]


def service_level(
    then: ServiceCounters, now: ServiceCounters, clock_speed: float = 1.0
) -> ServiceLevel | None:
    """The window between two reports of one cluster (None: no time between them, or the
    counters went back: the reporter restarted). ``clock_speed``: fleet seconds per second of
    the reports' clock (the rate reads in the fleet's clock, like the TTFTs)."""
    span = now.ts - then.ts
    if span <= 0 or not math.isfinite(span) or now.arrivals < then.arrivals:
        return None
    if len(now.ttft_buckets) != len(then.ttft_buckets):
        return None
    delta = [b - a for a, b in zip(then.ttft_buckets, now.ttft_buckets, strict=True)]
    if any(d < 0 for d in delta):
        return None
    return ServiceLevel(
        cluster=now.cluster,
        start=then.ts,
        end=now.ts,
        rate_rps=(now.arrivals - then.arrivals) / span / clock_speed,
        first_tokens=now.first_tokens - then.first_tokens,
        ttft_p50_s=histogram_quantile(delta, 0.5),
        ttft_p90_s=histogram_quantile(delta, 0.9),
        ttft_p99_s=histogram_quantile(delta, 0.99),
    )
