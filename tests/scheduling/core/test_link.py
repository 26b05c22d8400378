"""The one link model: the router's admission rule and defaults, and the planner's prediction
of refusals (stochastic knapsack, saturation, crowding behind a queued PrfaaS pool)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from scheduling.core import routing
from scheduling.core.link import (
    DEFAULT_ABUNDANT_UTILISATION,
    DEFAULT_LINK_BUDGET_SECONDS,
    DEFAULT_TARGET_UTILISATION,
    OffloadMix,
    PoolCrowd,
    link_admissible_rate,
    link_admits,
    link_budget_bytes,
    link_mean_refusal,
    link_never_fits,
    link_outlook,
    link_refusal,
    link_target_utilisation,
    transfer_excess_s,
)


def erlang_b(servers: int, offered: float) -> float:
    terms = [offered**k / math.factorial(k) for k in range(servers + 1)]
    return terms[-1] / sum(terms)


def one_kind(kv: float, hold_s: float, prefill_s: float | None = None) -> OffloadMix:
    return OffloadMix(
        np.array([[1.0]]),
        np.array([kv]),
        np.array([hold_s if prefill_s is None else prefill_s]),
        np.array([hold_s]),
    )


def test_the_defaults_are_the_routers() -> None:
    assert link_budget_bytes(10.0) == int(10e9 / 8 * DEFAULT_LINK_BUDGET_SECONDS)
    assert link_budget_bytes(10.0, 123) == 123
    assert link_budget_bytes(0.0) == 0
    assert (
        link_target_utilisation()
        == DEFAULT_TARGET_UTILISATION
        == routing.RouteGuards().scarce_utilisation
    )
    assert routing.RouteGuards().abundant_utilisation == DEFAULT_ABUNDANT_UTILISATION
    assert link_target_utilisation(0.5) == 0.5
    with pytest.raises(ValueError, match="within"):
        link_target_utilisation(1.5)
    # The router reads its budget from the same place.
    assert routing.Link("a", "b", 10.0).budget == link_budget_bytes(10.0)
    assert routing.Link("a", "b", 10.0, kv_budget_bytes=7).budget == 7


def test_admission_needs_room_in_the_budget_and_a_link_below_saturation() -> None:
    assert link_admits(0.5, 1_000, 500, 2_000)
    assert link_admits(0.5, 1_500, 500, 2_000)  # exactly full is still within
    assert not link_admits(0.5, 1_600, 500, 2_000)
    assert not link_admits(1.0, 0, 1, 2_000)


def test_a_request_bigger_than_the_budget_is_admitted_alone_on_an_idle_link() -> None:
    assert link_admits(0.0, 0, 3_000, 2_000)
    assert not link_admits(0.0, 1, 3_000, 2_000)  # anything reserved: refused
    assert not link_admits(1.0, 0, 3_000, 2_000)  # a saturated link takes nothing
    # While it holds the link, nothing else fits.
    assert not link_admits(0.0, 3_000, 1, 2_000)
    # A link whose budget is 0 takes nothing, idle or not.
    assert not link_admits(0.0, 0, 1, 0)
    # So the planner counts as never carried only what a link without a budget is offered.
    assert link_never_fits([1.0, 3.0], 2.0).tolist() == [False, False]
    assert link_never_fits([1.0, 3.0], 0.0).tolist() == [True, True]


def test_one_kind_of_request_is_refused_as_erlangs_loss_formula_says() -> None:
    # Two fit in the budget (2.5 GB of 1 GB requests), each held 3 s: Erlang B with 2 servers.
    for rate in (0.01, 0.05, 0.1):
        refused = float(link_refusal(rate, one_kind(1e9, 3.0), 0.0, 100.0, 2.5e9)[0, 0])
        assert refused == pytest.approx(erlang_b(2, 3.0 * rate), rel=0.02)


def test_a_request_larger_than_the_budget_is_refused_unless_the_link_is_idle() -> None:
    # 1 GB requests (two fit in 2.5 GB) and 3 GB ones (admitted only alone), each held 2 s: the
    # stochastic knapsack's product form over the states {0, 1, 2 small} and {1 big}.
    mix = OffloadMix(
        np.array([[0.5, 0.5]]), np.array([1e9, 3e9]), np.array([2.0, 2.0]), np.array([2.0, 2.0])
    )
    for rate in (0.01, 0.1, 0.5):
        small = big = 0.5 * rate * 2.0  # erlangs of each kind
        states = {"idle": 1.0, "one": small, "two": small**2 / 2, "big": big}
        total = sum(states.values())
        refused = link_refusal(rate, mix, 0.0, 100.0, 2.5e9)[0]
        assert refused[1] == pytest.approx(1 - states["idle"] / total, rel=0.03)
        assert refused[0] == pytest.approx((states["two"] + states["big"]) / total, rel=0.03)
        assert refused[1] > refused[0]


def test_a_link_that_one_transfer_saturates_refuses_while_it_streams() -> None:
    # 8 GB streamed over 2 s on a 10 Gbps (1.25 GB/s) link takes 6.4 s at full rate: the router
    # sees it saturated for that long, whatever the budget.
    mix = one_kind(8e9, 6.4, prefill_s=2.0)
    rate = 0.01
    refused = float(link_refusal(rate, mix, 0.0, 10.0, 1e12)[0, 0])
    assert refused == pytest.approx(1 - math.exp(-rate * 6.4), rel=0.05)


def pool(queue_mean: float, queue_var: float) -> PoolCrowd:
    """A pool of 3 busy prefills on average (the link's share of its arrivals: 1/4)."""
    return PoolCrowd(
        rate=np.array([0.4]),
        in_system_mean=np.array([3.0 + queue_mean]),
        in_system_var=np.array([1.0 + queue_var]),
        busy_mean=np.array([3.0]),
        busy_var=np.array([1.0]),
        queue_mean=np.array([queue_mean]),
        queue_var=np.array([queue_var]),
    )


def test_queueing_behind_a_busy_pool_bunches_reservations_and_refuses_more() -> None:
    mix = one_kind(1e9, 3.0)
    alone = float(link_refusal(0.1, mix, 1.0, 100.0, 4.2e9)[0, 0])
    bunched = float(link_refusal(0.1, mix, 1.0, 100.0, 4.2e9, pool=pool(1.0, 15.0))[0, 0])
    assert bunched > alone > 0


def test_prefills_in_progress_do_not_bunch_reservations_only_the_queue_does() -> None:
    # A pool with nobody waiting: its prefills end independently of each other, so the
    # link's reservations come and go as if alone (Poisson), however busy the pool is.
    mix = one_kind(1e9, 3.0)
    alone = float(link_refusal(0.1, mix, 1.0, 100.0, 4.2e9)[0, 0])
    idle_queue = float(link_refusal(0.1, mix, 1.0, 100.0, 4.2e9, pool=pool(0.0, 0.0))[0, 0])
    assert idle_queue == pytest.approx(alone)


def test_the_admissible_rate_is_where_the_refusals_reach_the_target() -> None:
    mix = OffloadMix(
        np.array([[0.3, 0.5, 0.2]]),
        np.array([0.4e9, 0.9e9, 1.8e9]),
        np.array([1.0, 2.5, 6.0]),
        np.array([1.0, 2.5, 6.0]),
    )
    for target in (0.01, 0.05, 0.2):
        rate = float(link_admissible_rate(mix, 0.5, 10.0, 2.5e9, target)[0])
        assert rate > 0
        at = float(link_mean_refusal(rate, mix, 0.5, 10.0, 2.5e9)[0])
        assert at == pytest.approx(target, rel=0.08)
    # More budget (and line rate) admits more.
    thin = float(link_admissible_rate(mix, 0.5, 10.0, 2.5e9, 0.05)[0])
    wide = float(link_admissible_rate(mix, 0.5, 20.0, 5e9, 0.05)[0])
    assert wide > thin
    assert link_admissible_rate(mix, 0.5, 0.0, 0.0, 0.05)[0] == 0.0


def test_a_transfer_outlasts_its_prefill_only_when_the_link_is_slower_than_it() -> None:
    # 1 GB over 2 s streams at 4 Gbps: hidden on an idle 10 Gbps link, 2 s late on a 2 Gbps one.
    assert transfer_excess_s(1e9, 2.0, 10.0, 0.0)[()] == 0.0
    assert transfer_excess_s(1e9, 2.0, 2.0, 0.0)[()] == pytest.approx(2.0)
    # Sharing the link fairly at 50% utilisation halves what this transfer gets.
    assert transfer_excess_s(1e9, 2.0, 2.0, 0.5)[()] == pytest.approx(6.0)
    assert math.isinf(transfer_excess_s(1e9, 2.0, 0.0, 0.0)[()])


def test_a_transfer_bigger_than_the_budget_streams_alone_at_the_full_line() -> None:
    # The router admits it only on a link nobody else reserves (link_admits).
    both = transfer_excess_s(np.array([1e9, 3e9]), np.array([2.0, 2.0]), 2.0, 0.5, 2e9)
    assert both[0] == pytest.approx(6.0)  # fits the budget: shares the line
    assert both[1] == pytest.approx(10.0)  # 3 GB at the full 2 Gbps, not at half of it
    assert link_admits(0.0, 0.0, 3e9, 2e9) and not link_admits(0.0, 1.0, 3e9, 2e9)


def moving_first(mix: OffloadMix, nbytes: float, seconds: float) -> OffloadMix:
    """``mix`` whose every kind first moves a prefix of ``nbytes`` for ``seconds``."""
    kinds = len(mix.kv_bytes)
    return replace(mix, move_bytes=np.full(kinds, nbytes), move_s=np.full(kinds, seconds))


def test_moving_a_prefix_first_reserves_more_for_longer_and_is_refused_more() -> None:
    plain = one_kind(1e9, 3.0, prefill_s=2.0)
    moving = moving_first(plain, 1e9, 0.5)
    alone = float(link_refusal(0.3, plain, 0.5, 25.0, 6e9)[0, 0])
    moved = float(link_refusal(0.3, moving, 0.5, 25.0, 6e9)[0, 0])
    assert moved > alone > 0


def test_a_moving_prefix_streams_at_the_line_rate_and_leaves_the_link_less_often_abundant() -> None:
    plain = one_kind(1e9, 3.0, prefill_s=2.0)
    moving = moving_first(plain, 1e9, 0.5)
    calm = link_outlook(0.3, plain, 0.5, 25.0, 6e9)
    busy = link_outlook(0.3, moving, 0.5, 25.0, 6e9)
    # 1 GB over 2 s streams at 0.16 of a 25 Gbps line: it takes seven at once to saturate it.
    assert float(calm.saturated[0]) < 1e-3
    assert float(busy.saturated[0]) > 0.05
    assert float(busy.abundant[0]) < float(calm.abundant[0]) <= 1.0
    # While the egress is abundant, fewer transfers are in flight: the budget is emptier.
    assert float(busy.refused_calm[0, 0]) < float(busy.budget_block[0, 0])
    # Refused when there is no room or the line is saturated: their union, on one joint law.
    block, saturated = float(busy.budget_block[0, 0]), float(busy.saturated[0])
    assert max(block, saturated) < float(busy.refusal()[0, 0]) < block + saturated


def test_with_a_line_no_stream_can_fill_the_guard_is_the_budgets_knapsack() -> None:
    # Streams at under a hundredth of a 10 Tbps line: only the budget refuses, and the joint
    # law gives what the knapsack alone does (Kaufman-Roberts), kind by kind.
    mix = OffloadMix(
        np.array([[0.5, 0.3, 0.2]]),
        np.array([0.4e9, 1.0e9, 2.0e9]),
        np.array([1.0, 2.0, 4.0]),
        np.array([1.5, 3.0, 5.0]),
    )
    out = link_outlook(1.0, mix, 0.5, 10_000.0, 2.5e9)
    assert float(out.saturated[0]) == 0.0
    np.testing.assert_allclose(out.refusal(), out.budget_block, atol=1e-12)
    np.testing.assert_allclose(
        out.refusal(), link_refusal(1.0, mix, 0.5, 10_000.0, 2.5e9), atol=1e-12
    )
    assert 0.05 < float(out.refusal()[0, 2]) < 1.0


def test_streams_the_budget_cannot_hold_together_never_saturate_the_line() -> None:
    # 1 GB streamed over its 1.8 s prefill runs at 0.44 of a 10 Gbps line: three at once
    # saturate it. A 2.5 GB budget never holds three; a 3.5 GB one does.
    mix = one_kind(1e9, 2.5, prefill_s=1.8)
    two = link_outlook(1.0, mix, 0.0, 10.0, 2.5e9)
    assert float(two.saturated[0]) == 0.0
    assert float(two.refusal()[0, 0]) == pytest.approx(float(two.budget_block[0, 0]))
    three = link_outlook(1.0, mix, 0.0, 10.0, 3.5e9)
    assert float(three.saturated[0]) > 0.05
    # Three in flight fill the line and leave no room for a fourth: one cause, counted once.
    assert float(three.refusal()[0, 0]) == pytest.approx(float(three.budget_block[0, 0]))
