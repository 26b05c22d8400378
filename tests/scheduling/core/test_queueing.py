"""Queueing approximations: exact where the theory is exact (M/M/c, M/G/1 means), and the
TTFT law of a service time plus waits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduling.core.queueing import (
    TtftPart,
    Wait,
    erlang_c,
    mgc_crowd,
    mgc_mean_wait,
    mgc_wait,
    moments,
    ttft_mean,
    ttft_quantile,
    wait_sum_cdf,
    wait_transient,
)


def mmc_law(rate: float, servers: int, n_max: int = 600) -> np.ndarray:
    a = rate
    rho = a / servers
    head = [a**n / math.factorial(n) for n in range(servers)]
    tail0 = a**servers / math.factorial(servers)
    p0 = 1 / (sum(head) + tail0 / (1 - rho))
    return np.array(
        [p0 * (head[n] if n < servers else tail0 * rho ** (n - servers)) for n in range(n_max)]
    )


def test_erlang_c_and_the_mmc_wait_are_exact() -> None:
    # M/M/2 at rho = 0.5: P(wait) = 1/3, E[W] = P(wait) / (c mu - lambda) = 1/3.
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    wait = mgc_wait(1.0, 1.0, 1.0, 2)
    assert wait.p_wait == pytest.approx(1 / 3) and wait.mean_s == pytest.approx(1 / 3)
    assert erlang_c(4, 4.0) == 1.0 and not mgc_wait(4.0, 1.0, 1.0, 4).stable


def test_one_server_gives_the_pollaczek_khinchine_mean() -> None:
    # M/D/1 at rho = 0.8: E[W] = rho E[S] / (2 (1 - rho)) = 2 s.
    assert mgc_wait(0.8, 1.0, 0.0, 1).mean_s == pytest.approx(2.0)
    assert mgc_mean_wait([0.8, 0.4], [1.0, 1.0], [0.0, 0.0], 1) == pytest.approx([2.0, 1 / 3])


def test_the_crowd_at_a_station_matches_mmc_exactly() -> None:
    law = mmc_law(3.2, 4)
    n = np.arange(len(law))
    crowd = mgc_crowd(3.2, 1.0, 1.0, 4)
    assert crowd.in_system_mean == pytest.approx(float(np.dot(n, law)))
    assert crowd.in_system_var == pytest.approx(float(np.dot(n * n, law) - np.dot(n, law) ** 2))
    assert crowd.busy_mean == pytest.approx(3.2)
    queued = np.maximum(n - 4, 0)
    assert crowd.queue_mean == pytest.approx(float(np.dot(queued, law)))
    assert crowd.queue_var == pytest.approx(
        float(np.dot(queued * queued, law) - np.dot(queued, law) ** 2)
    )


def test_a_sum_of_two_waits_has_the_hypoexponential_law() -> None:
    rng = np.random.default_rng(1)
    size = 200_000
    wa = np.where(rng.random(size) < 0.6, rng.exponential(2.0, size), 0.0)
    wb = np.where(rng.random(size) < 0.3, rng.exponential(0.5, size), 0.0)
    for y in (0.0, 0.5, 2.0, 6.0):
        got = float(wait_sum_cdf(y, 0.6, 0.6 * 2.0, 0.3, 0.3 * 0.5))
        assert got == pytest.approx(float(np.mean(wa + wb <= y)), abs=0.005)


def test_the_ttft_quantile_of_one_length_is_its_prefill_plus_the_wait_quantile() -> None:
    wait = Wait(p_wait=0.5, mean_s=1.0, rho=0.7)  # exponential of mean 2 s half the time
    part = TtftPart(np.array([1.0]), np.array([3.0]), wait, Wait(0.0, 0.0, 0.0))
    # P(W > x) = 0.5 exp(-x / 2) = 0.1 at x = 2 ln 5.
    assert ttft_quantile([part], 0.9) == pytest.approx(3.0 + 2 * math.log(5), rel=1e-3)
    assert ttft_mean([part]) == pytest.approx(4.0)
    unstable = TtftPart(np.array([1.0]), np.array([3.0]), Wait(1.0, math.inf, 1.2), wait)
    assert math.isinf(ttft_mean([unstable])) and math.isinf(ttft_quantile([unstable], 0.9))


def test_moments_of_a_discrete_law() -> None:
    mean, scv = moments([1.0, 3.0], [1.0, 1.0])
    assert mean == 2.0 and scv == pytest.approx(0.25)
    assert moments([1.0], [0.0]) == (0.0, 0.0)


def mm1_waits(rho: float, duration_s: float, backlog_s: float, seed: int) -> tuple[float, float]:
    """Monte Carlo of an M/M/1 queue (unit service) by Lindley's recursion, 4,000 runs that
    start with ``backlog_s`` of work: the mean wait of the arrivals within ``duration_s``,
    and of those arriving near its end."""
    rng = np.random.default_rng(seed)
    runs, n = 4000, int(rho * duration_s * 1.5) + 50
    gaps = rng.exponential(1 / rho, (runs, n))
    service = rng.exponential(1.0, (runs, n))
    at = np.cumsum(gaps, axis=1) - gaps[:, :1]
    w = np.zeros((runs, n))
    w[:, 0] = backlog_s
    for k in range(1, n):
        w[:, k] = np.maximum(0.0, w[:, k - 1] + service[:, k - 1] - gaps[:, k])
    return float(w[at < duration_s].mean()), float(w[np.abs(at - duration_s) < 2].mean())


@pytest.mark.parametrize(("rho", "duration_s"), [(0.9, 100.0), (0.95, 200.0), (0.98, 100.0)])
def test_a_stretch_from_an_empty_station_waits_as_a_simulated_queue_does(
    rho: float, duration_s: float
) -> None:
    steady = mgc_wait(rho, 1.0, 1.0, 1)
    lived, end = wait_transient(steady, duration_s)
    simulated, simulated_end = mm1_waits(rho, duration_s, 0.0, seed=7)
    # Far below the steady state (19 s at 0.95), as the queue has not built yet.
    assert lived.mean_s < 0.6 * steady.mean_s
    assert lived.mean_s == pytest.approx(simulated, rel=0.12)
    assert end == pytest.approx(simulated_end, rel=0.12)
    assert (lived.p_wait, lived.rho) == (steady.p_wait, steady.rho)


def test_a_backlog_above_the_steady_state_drains_at_the_spare_capacity() -> None:
    steady = mgc_wait(0.9, 1.0, 1.0, 1)  # 9 s
    lived, end = wait_transient(steady, 100.0, backlog_s=40.0)
    simulated, simulated_end = mm1_waits(0.9, 100.0, 40.0, seed=11)
    assert lived.mean_s == pytest.approx(35.0)  # 40 s draining at 0.1 s per second
    assert end == pytest.approx(30.0)
    assert lived.mean_s == pytest.approx(simulated, rel=0.1)
    assert end == pytest.approx(simulated_end, rel=0.1)


def test_a_stretch_that_lasts_keeps_the_steady_wait() -> None:
    steady = mgc_wait(0.95, 1.0, 1.0, 1)
    assert wait_transient(steady, 0.0) == (steady, steady.mean_s)
    assert wait_transient(steady, math.inf) == (steady, steady.mean_s)
    odd = Wait(0.5, 1.0, 0.0)  # a mean without a load: nothing to relax, kept as it is
    assert wait_transient(odd, 10.0) == (odd, 1.0)
    long, end = wait_transient(steady, 1e7)
    assert long.mean_s == pytest.approx(steady.mean_s, rel=0.01)
    assert end == pytest.approx(steady.mean_s, rel=1e-3)


def test_an_unstable_stretch_keeps_an_infinite_wait_and_grows_its_backlog() -> None:
    over = mgc_wait(1.2, 1.0, 1.0, 1)
    lived, end = wait_transient(over, 50.0, backlog_s=5.0)
    assert not lived.stable and math.isinf(lived.mean_s)
    assert end == pytest.approx(5.0 + 0.2 * 50.0)
