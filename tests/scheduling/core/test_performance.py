"""The performance model: tables, KV size and throughput (Eqs. 1-2), decode capacity, and exact
length statistics (checked against the paper's numbers and against independent integration)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from scheduling.core.performance import (
    MIB,
    DiscreteLengths,
    LengthDistribution,
    Table,
    TruncatedLognormal,
    cluster_egress_gbps,
    decode_rate_per_instance,
    expectation,
    kv_bytes,
    length_distribution,
    length_split,
    phi_kv_gbps,
    transfer_seconds,
    weighted_quantile,
)
from scheduling.core.scenario import EmpiricalDist, FixedDist, LognormalDist

H200 = Table.from_points([[1024, 0.44], [8192, 0.72], [32768, 1.84], [131072, 7.40]])
KV = Table.from_points([[1024, 190.8], [8192, 308.9], [32768, 701.3], [131072, 2316.3]])
PAPER_LENGTHS = TruncatedLognormal(9.90, 1.00, 128, 131072)


def test_a_table_interpolates_between_points_and_extends_the_end_segments() -> None:
    t = Table.from_points([[0, 1.0], [10, 2.0], [20, 4.0]])
    assert t([5, 10, 15]).tolist() == [1.5, 2.0, 3.0]
    assert float(t(-10)) == pytest.approx(0.0)  # first segment's slope, 0.1 per token
    assert float(t(30)) == pytest.approx(6.0)  # last segment's slope, 0.2 per token


def test_a_one_point_table_is_constant() -> None:
    assert Table.from_points([[100, 3.0]])([0, 100, 1e6]).tolist() == [3.0, 3.0, 3.0]


def test_a_table_refuses_unsorted_or_empty_points() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        Table.from_points([[10, 1.0], [5, 2.0]])
    with pytest.raises(ValueError, match="at least one point"):
        Table((), ())


def test_kv_size_is_in_bytes_with_mib_of_two_to_the_twenty() -> None:
    assert float(kv_bytes(KV, 32768)) == pytest.approx(701.3 * 2**20)
    assert MIB == 1_048_576


def test_phi_kv_reproduces_the_papers_table_5() -> None:
    published = {1024: 3.61, 8192: 3.59, 32768: 3.19, 131072: 2.62}
    got = phi_kv_gbps(KV, H200, list(published))
    for (tokens, gbps), value in zip(published.items(), got, strict=True):
        assert value == pytest.approx(gbps, rel=0.01), tokens


def test_cluster_egress_is_instances_times_phi_kv() -> None:
    assert float(cluster_egress_gbps(4, KV, H200, 32768)) == pytest.approx(4 * 3.1972, rel=1e-3)
    # docs/paper.md 2.5: 64 instances of Ring-2.5-1T-like hardware at 2.59 Gbps give 166 Gbps.
    flat = Table.from_points([[1, 1.0]])
    kv = Table.from_points([[1, 2.59e9 / 8 / MIB]])
    assert float(cluster_egress_gbps(64, kv, flat, 1)) == pytest.approx(165.76)


def test_transfer_over_a_down_link_never_finishes() -> None:
    assert math.isinf(float(transfer_seconds(KV, 1024, 0.0)))
    assert float(transfer_seconds(KV, 1024, 100.0)) == pytest.approx(190.8 * MIB * 8 / 100e9)


def test_decode_capacity_matches_the_papers_reconstruction() -> None:
    # docs/paper.md 7.2: BS_max 20, T_decode 25 ms, 1024 output tokens -> 0.78125 req/s per instance.
    assert decode_rate_per_instance(20, 0.025, 1024) == pytest.approx(0.78125)
    assert math.isinf(decode_rate_per_instance(20, 0.025, 0))


def test_truncated_lognormal_statistics_match_the_paper() -> None:
    split = length_split(PAPER_LENGTHS, [19400])
    assert split.p[0] == pytest.approx(0.4957, abs=1e-4)
    assert split.l_long[0] == pytest.approx(45046, abs=1)
    assert split.l_short[0] == pytest.approx(10224, abs=1)
    assert PAPER_LENGTHS.mean == pytest.approx(27486, abs=1)
    assert float(PAPER_LENGTHS.quantile(0.9)) == pytest.approx(62410, abs=1)


def test_truncated_lognormal_agrees_with_direct_numerical_integration() -> None:
    d = TruncatedLognormal(8.7, 1.3, 200, 50_000)
    dist = stats.lognorm(s=1.3, scale=math.exp(8.7))
    mass = dist.cdf(50_000) - dist.cdf(200)
    for t in (150.0, 1_000.0, 6_000.0, 49_000.0):
        lo = max(t, 200.0)
        p = (dist.cdf(50_000) - dist.cdf(lo)) / mass
        above = integrate.quad(lambda x: x * dist.pdf(x), lo, 50_000, limit=200)[0] / mass
        split = length_split(d, [t])
        assert split.p[0] == pytest.approx(p, rel=1e-9)
        assert split.l_long[0] == pytest.approx(above / p, rel=1e-7)


def test_length_statistics_are_vectorised_over_thresholds() -> None:
    ts = np.array([1_000.0, 10_000.0, 19_400.0, 60_000.0])
    split = length_split(PAPER_LENGTHS, ts)
    assert split.p.shape == (4,)
    assert np.all(np.diff(split.p) < 0)
    assert np.all(split.l_long > ts)
    assert np.all(split.l_short <= ts)


def test_a_threshold_beyond_the_support_offloads_all_or_nothing() -> None:
    split = length_split(PAPER_LENGTHS, [100, 131072])
    assert split.p.tolist() == [1.0, 0.0]
    assert np.isnan(split.l_short[0]) and np.isnan(split.l_long[1])
    assert split.l_long[0] == pytest.approx(PAPER_LENGTHS.mean)
    assert split.l_short[1] == pytest.approx(PAPER_LENGTHS.mean)


def test_discrete_lengths_are_exact() -> None:
    d = DiscreteLengths.from_points([(10, 1), (20, 1), (30, 2)])
    split = length_split(d, [5, 10, 25, 30])
    assert split.p.tolist() == [1.0, 0.75, 0.5, 0.0]
    assert split.l_long[1] == pytest.approx(80 / 3)
    assert split.l_short[2] == pytest.approx(15.0)
    assert d.mean == pytest.approx(22.5)
    assert float(d.quantile(0.5)) == 20.0
    assert float(d.quantile(0.9)) == 30.0


def test_discrete_lengths_merge_repeated_points_and_refuse_bad_weights() -> None:
    assert DiscreteLengths.from_points([(5, 1), (5, 2)]).weights == (3.0,)
    with pytest.raises(ValueError, match="not all zero"):
        DiscreteLengths((1.0,), (0.0,))


def test_a_fixed_length_is_either_offloaded_or_not() -> None:
    d = length_distribution(FixedDist(1000))
    split = length_split(d, [999, 1000])
    assert split.p.tolist() == [1.0, 0.0]
    assert split.l_long[0] == 1000 and split.l_short[1] == 1000


def test_every_scenario_distribution_becomes_a_length_distribution() -> None:
    dists = [
        length_distribution(LognormalDist(9.9, 1.0, 128, 131072)),
        length_distribution(FixedDist(5)),
        length_distribution(EmpiricalDist(((1.0, 1.0), (3.0, 1.0)))),
    ]
    assert all(isinstance(d, LengthDistribution) for d in dists)
    assert [round(d.mean, 3) for d in dists] == [round(PAPER_LENGTHS.mean, 3), 5.0, 2.0]


def test_a_prefix_hit_fraction_scales_every_length() -> None:
    d = length_distribution(LognormalDist(9.9, 1.0, 128, 131072), scale=0.5)
    assert d.mean == pytest.approx(PAPER_LENGTHS.mean / 2)
    assert d.support == (64, 65536)
    with pytest.raises(ValueError, match="positive"):
        length_distribution(FixedDist(5), scale=0)


def test_expectations_integrate_over_the_distribution() -> None:
    assert expectation(PAPER_LENGTHS, lambda x: x) == pytest.approx(PAPER_LENGTHS.mean, rel=1e-4)
    # docs/paper.md 7.5: the naive baseline's mean TTFT is E[T_H200(L)] = 1.687 s.
    assert expectation(PAPER_LENGTHS, H200) == pytest.approx(1.687, abs=0.002)


def test_weighted_quantile_takes_the_smallest_value_reaching_the_level() -> None:
    values = np.array([3.0, 1.0, 2.0])
    weights = np.array([0.2, 0.5, 0.3])
    assert weighted_quantile(values, weights, 0.5) == 1.0
    assert weighted_quantile(values, weights, 0.8) == 2.0
    assert weighted_quantile(values, weights, 0.9) == 3.0
