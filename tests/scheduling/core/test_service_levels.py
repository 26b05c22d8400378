"""Service levels from cumulative counters: rate over the window, quantiles from the buckets."""

from __future__ import annotations

import numpy as np
import pytest

from scheduling.core.service_levels import (
    TTFT_BUCKETS_S,
    ServiceCounters,
    histogram_quantile,
    service_level,
    ttft_bucket,
)


def _counters(ts: float, arrivals: int, ttfts: list[float]) -> ServiceCounters:
    buckets = [0] * (len(TTFT_BUCKETS_S) + 1)
    for t in ttfts:
        buckets[ttft_bucket(t)] += 1
    return ServiceCounters("pd", ts, arrivals, len(ttfts), tuple(buckets), sum(ttfts))


def test_the_window_rate_is_the_arrivals_between_two_reports_over_their_time() -> None:
    level = service_level(_counters(100.0, 40, []), _counters(160.0, 640, [0.3] * 10))
    assert level is not None
    assert level.rate_rps == pytest.approx(10.0)
    assert level.first_tokens == 10


def test_a_fleet_clock_faster_than_the_reports_reads_the_rate_in_fleet_seconds() -> None:
    # An emulated fleet four times faster: 600 arrivals in 60 wall seconds are 240 fleet s.
    level = service_level(_counters(100.0, 40, []), _counters(160.0, 640, [0.3] * 10), 4.0)
    assert level is not None
    assert level.rate_rps == pytest.approx(2.5)


def test_quantiles_of_the_buckets_are_close_to_those_of_the_samples() -> None:
    rng = np.random.default_rng(7)
    samples = list(rng.lognormal(mean=0.0, sigma=0.6, size=20_000))
    level = service_level(_counters(0.0, 0, []), _counters(60.0, 20_000, samples))
    assert level is not None
    for q, got in ((0.5, level.ttft_p50_s), (0.9, level.ttft_p90_s), (0.99, level.ttft_p99_s)):
        assert got == pytest.approx(float(np.quantile(samples, q)), rel=0.12), q


def test_counters_that_went_back_make_no_window() -> None:
    assert service_level(_counters(0.0, 100, [1.0]), _counters(60.0, 10, [])) is None
    assert service_level(_counters(60.0, 0, []), _counters(60.0, 10, [])) is None


def test_an_empty_histogram_has_no_quantile_and_the_top_bucket_reads_as_its_bound() -> None:
    assert histogram_quantile([0] * (len(TTFT_BUCKETS_S) + 1), 0.9) is None
    top = [0] * len(TTFT_BUCKETS_S) + [5]
    assert histogram_quantile(top, 0.5) == TTFT_BUCKETS_S[-1]
