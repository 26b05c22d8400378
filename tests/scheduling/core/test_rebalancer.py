"""The rebalancer's pure decision: holds and their reasons, proposals that match the planner,
bounded steps, instance choice, and anti-flapping over hours of noisy or drifting traffic."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from scheduling.core import rebalancer as rb
from scheduling.core.kinds import InstanceRole
from scheduling.core.performance import TruncatedLognormal
from scheduling.core.planner import FleetSpec, fleet_from_scenario, plan_fleet
from scheduling.core.scenario import scenario_load

CLUSTER = "pd-h20"
PERIOD = 600.0
T = TypeVar("T")


def must(value: T | None) -> T:
    assert value is not None
    return value


@pytest.fixture(scope="module")
def fleet(scenarios_dir: Path) -> FleetSpec:
    return fleet_from_scenario(scenario_load(scenarios_dir / "paper-case-study.yaml"))


def lengths(rng: np.random.Generator, mu: float, n: int) -> np.ndarray:
    x = rng.lognormal(mu, 1.0, size=3 * n + 10)
    return x[(x >= 128) & (x <= 131072)][:n]


def window(
    rng: np.random.Generator, mu: float, now: float, *, rate: float = 2.6, output: float = 1024
) -> rb.TrafficSummary:
    n = int(rng.poisson(rate * PERIOD))
    return rb.window_from_lengths(
        lengths(rng, mu, n).tolist(),
        start_s=now - PERIOD,
        end_s=now,
        bin_edges=rb.DEFAULT_BIN_EDGES,
        output_tokens_mean=output,
    )


def fleet_view(
    n_p: int, n_d: int, now: float, loads: dict[str, float] | None = None
) -> tuple[rb.InstanceView, ...]:
    loads = loads or {}
    return tuple(
        rb.InstanceView(
            name=f"{CLUSTER}-{i}",
            role=InstanceRole.PREFILL if i < n_p else InstanceRole.DECODE,
            state="active",
            load=loads.get(f"{CLUSTER}-{i}", 1.0),
            seen_at=now,
        )
        for i in range(n_p + n_d)
    )


def decide(fleet, win, views, threshold, *, now, guards=None, history=None) -> rb.RebalanceDecision:
    return rb.rebalance_decide(
        rb.RebalanceInput(
            cluster=CLUSTER,
            now=now,
            window=win,
            instances=views,
            threshold=threshold,
            guards=guards or rb.RebalanceGuards(persist_ticks=1),
            history=history or rb.History(),
        ),
        rb.FleetPlanner(fleet, CLUSTER),
    )


# --- proposals ------------------------------------------------------------------------------


def test_drifted_traffic_gives_the_planners_threshold_and_split_for_that_window(fleet):
    now = 10 * PERIOD
    win = window(np.random.default_rng(3), 10.2, now)
    # Tuned for the first hour of drift.yaml (mu 9.3): 2 prefill, 6 decode, low threshold.
    d = decide(fleet, win, fleet_view(2, 6, now), 8500, now=now)
    assert d.action == "propose", d.detail
    expected = plan_fleet(
        rb.fleet_for_cluster(fleet, CLUSTER, 8),
        rb.DiscreteLengths.from_points(win.incremental_tokens),
        1024.0,
        split_bounds={CLUSTER: (3, 3)},  # one role change per plan on 8 instances
    ).cluster(CLUSTER)
    assert must(d.proposed).setting == rb.Setting(
        expected.threshold_tokens, expected.n_p, expected.n_d
    )
    assert must(d.gain) >= 0.05
    assert must(d.proposed).capacity_rps > must(d.current).capacity_rps
    assert [(c.from_role, c.to_role) for c in d.role_changes] == [("decode", "prefill")]


def test_role_changes_pick_the_least_loaded_instance(fleet):
    now = 10 * PERIOD
    win = window(np.random.default_rng(4), 10.2, now)
    loads = {f"pd-h20-{i}": 5.0 for i in range(8)} | {"pd-h20-6": 0.5, "pd-h20-3": 2.0}
    d = decide(fleet, win, fleet_view(2, 6, now, loads=loads), 8500, now=now)
    assert d.action == "propose"
    assert [c.instance for c in d.role_changes] == ["pd-h20-6"]


def test_draining_down_and_warming_instances_are_never_flipped():
    now = 10 * PERIOD
    views = list(fleet_view(2, 6, now, loads={"pd-h20-3": 0, "pd-h20-4": 0, "pd-h20-5": 0}))
    views[3] = replace(views[3], state="draining")
    views[4] = replace(views[4], state="down")
    views[5] = replace(views[5], warming_up=True)
    views[7] = replace(views[7], load=None)  # unknown load goes last
    chosen = rb.choose_role_changes(views, InstanceRole.DECODE, InstanceRole.PREFILL, 3)
    assert [c.instance for c in chosen] == ["pd-h20-2", "pd-h20-6", "pd-h20-7"]
    assert len(rb.choose_role_changes(views, InstanceRole.DECODE, InstanceRole.PREFILL, 10)) == 3


def test_a_big_move_is_made_in_steps_of_at_most_ten_percent_of_the_cluster(fleet):
    now = 10 * PERIOD
    big = replace(fleet, pd=(replace(fleet.pd[0], instances=40),))
    win = window(np.random.default_rng(5), 10.2, now, rate=12)
    d = decide(big, win, fleet_view(4, 36, now), 8500, now=now)
    assert d.action == "propose"
    assert must(d.target).setting.n_p - 4 > 4  # the optimum is further away than one step
    assert must(d.proposed).setting.n_p == 8
    assert len(d.role_changes) == 4


def test_role_floors_and_ceilings_bound_the_split(fleet):
    now = 10 * PERIOD
    win = window(np.random.default_rng(6), 10.2, now)
    d = decide(
        fleet,
        win,
        fleet_view(2, 6, now),
        8500,
        now=now,
        guards=rb.RebalanceGuards(persist_ticks=1, max_prefill=2),
    )
    assert must(d.target).setting.n_p == 2
    impossible = rb.RebalanceGuards(min_prefill=5, min_decode=5)
    d = decide(fleet, win, fleet_view(2, 6, now), 8500, now=now, guards=impossible)
    assert (d.action, d.reason) == ("hold", rb.HOLD_INFEASIBLE)


def test_the_planners_own_optimum_is_already_optimal(fleet):
    now = 10 * PERIOD
    win = window(np.random.default_rng(7), 9.9, now)
    first = decide(fleet, win, fleet_view(4, 4, now), 19400, now=now)
    best = must(first.target).setting
    d = decide(fleet, win, fleet_view(best.n_p, best.n_d, now), best.threshold, now=now)
    assert (d.action, d.reason, d.role_changes) == ("hold", rb.HOLD_ALREADY_OPTIMAL, ())


def test_a_gain_inside_the_dead_band_changes_nothing(fleet):
    now = 10 * PERIOD
    win = window(np.random.default_rng(8), 10.2, now)
    d0 = decide(fleet, win, fleet_view(2, 6, now), 8500, now=now)
    wide = rb.RebalanceGuards(persist_ticks=1, dead_band=must(d0.gain) + 0.01)
    d = decide(fleet, win, fleet_view(2, 6, now), 8500, now=now, guards=wide)
    assert (d.action, d.reason, d.role_changes) == ("hold", rb.HOLD_DEAD_BAND, ())
    assert d.gain == pytest.approx(d0.gain)


# --- holds on data that cannot be trusted ---------------------------------------------------


def good(now: float) -> rb.TrafficSummary:
    return window(np.random.default_rng(9), 10.2, now)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda w, now: None, rb.HOLD_MISSING_METRICS),
        (lambda w, now: replace(w, arrivals=math.nan), rb.HOLD_INVALID_METRICS),
        (lambda w, now: replace(w, output_tokens_mean=math.nan), rb.HOLD_INVALID_METRICS),
        (
            lambda w, now: replace(w, incremental_tokens=((1000.0, math.inf),)),
            rb.HOLD_INVALID_METRICS,
        ),
        (lambda w, now: replace(w, cache_hit_tokens=-5.0), rb.HOLD_INVALID_METRICS),
        (lambda w, now: replace(w, recorder_seen_at=now - 3600), rb.HOLD_STALE_METRICS),
        (lambda w, now: replace(w, recorder_seen_at=None), rb.HOLD_MISSING_METRICS),
        (lambda w, now: replace(w, samples=2), rb.HOLD_MISSING_METRICS),
        (lambda w, now: replace(w, incremental_tokens=()), rb.HOLD_MISSING_METRICS),
        (lambda w, now: replace(w, output_tokens_mean=None), rb.HOLD_MISSING_METRICS),
        (lambda w, now: replace(w, arrivals=40, offloads=0), rb.HOLD_WINDOW_TOO_SMALL),
    ],
    ids=[
        "no-window",
        "nan-arrivals",
        "nan-output",
        "inf-histogram",
        "negative",
        "stale-recorder",
        "recorder-never-seen",
        "half-the-minutes-missing",
        "no-histogram",
        "no-output",
        "too-few-requests",
    ],
)
def test_untrustworthy_windows_hold_with_their_reason_and_change_nothing(fleet, mutate, reason):
    now = 10 * PERIOD
    d = decide(fleet, mutate(good(now), now), fleet_view(2, 6, now), 8500, now=now)
    assert (d.action, d.reason) == ("hold", reason), d.detail
    assert d.role_changes == ()
    assert d.detail


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"seen_at": None, "load": None}, rb.HOLD_MISSING_METRICS),
        ({"load": math.nan}, rb.HOLD_INVALID_METRICS),
        ({"seen_at": 0.0}, rb.HOLD_STALE_METRICS),
        ({"warming_up": True}, rb.HOLD_WARMING_UP),
    ],
    ids=["no-telemetry", "nan-load", "stale-telemetry", "warming-up"],
)
def test_untrustworthy_instances_hold_with_their_reason(fleet, change, reason):
    now = 10 * PERIOD
    views = list(fleet_view(2, 6, now))
    views[4] = replace(views[4], **change)
    d = decide(fleet, good(now), tuple(views), 8500, now=now)
    assert (d.action, d.reason, d.role_changes) == ("hold", reason, ())
    assert "pd-h20-4" in d.detail


def test_true_zero_traffic_is_not_missing_data(fleet):
    now = 10 * PERIOD
    empty = rb.window_from_lengths(
        [],
        start_s=now - PERIOD,
        end_s=now,
        bin_edges=rb.DEFAULT_BIN_EDGES,
        output_tokens_mean=None,
    )
    d = decide(fleet, empty, fleet_view(2, 6, now), 8500, now=now)
    assert (d.action, d.reason) == ("hold", rb.HOLD_NO_TRAFFIC)
    stale = replace(empty, recorder_seen_at=now - 3600)
    assert decide(fleet, stale, fleet_view(2, 6, now), 8500, now=now).reason == (
        rb.HOLD_STALE_METRICS
    )


def test_unknown_guard_overrides_are_refused_by_name():
    with pytest.raises(ValueError, match="dead_bnad"):
        rb.RebalanceGuards().with_overrides({"dead_bnad": 0.1})
    assert rb.RebalanceGuards().with_overrides({"dead_band": 0.1}).dead_band == 0.1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"persist_ticks": 1.5}, "persist_ticks: must be a whole number"),
        ({"min_prefill": True}, "min_prefill: must be a whole number"),
        ({"dead_band": "5%"}, "dead_band: must be a number"),
        ({"dead_band": None}, "dead_band: must be a number"),
        ({"cooldown_s": -1}, "cooldown_s: must be a finite number >= 0"),
        ({"dead_band": math.nan}, "dead_band: must be a finite number"),
        ({"max_change_fraction": 2}, "max_change_fraction: must be between 0 and 1"),
    ],
)
def test_guard_overrides_of_the_wrong_kind_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        rb.RebalanceGuards().with_overrides(overrides)


def test_role_ceilings_may_be_unbounded():
    assert (
        rb.RebalanceGuards().with_overrides({"max_prefill": None, "max_decode": 6}).max_decode == 6
    )


def test_at_most_max_one_or_ten_percent_role_changes():
    g = rb.RebalanceGuards()
    assert [g.max_changes(n) for n in (1, 8, 10, 19, 20, 45)] == [1, 1, 1, 1, 2, 4]


# --- anti-flapping --------------------------------------------------------------------------


def test_a_gain_below_urgent_must_persist_for_two_ticks(fleet):
    now = 10 * PERIOD
    guards = rb.RebalanceGuards(urgent_gain=10.0)
    history = rb.History()
    first = decide(fleet, good(now), fleet_view(2, 6, now), 8500, now=now, guards=guards)
    assert first.reason == rb.HOLD_AWAITING_PERSISTENCE
    history = rb.history_after(history, first, now, applied=False)
    later = now + PERIOD
    win = window(np.random.default_rng(10), 10.2, later)
    second = decide(
        fleet, win, fleet_view(2, 6, later), 8500, now=later, guards=guards, history=history
    )
    assert second.action == "propose"


def test_cool_down_and_reversal_limits_hold(fleet):
    now = 10 * PERIOD
    applied = rb.History(last_applied_at=now - 60)
    d = decide(fleet, good(now), fleet_view(2, 6, now), 8500, now=now, history=applied)
    assert d.reason == rb.HOLD_COOLDOWN
    # The split just went down (prefill -> decode); going back up within the hour is held.
    recent = rb.History(last_split_change=rb.Change(now - 1800, -1))
    d = decide(fleet, good(now), fleet_view(2, 6, now), 8500, now=now, history=recent)
    assert (d.reason, d.split_direction) == (rb.HOLD_REVERSAL_LIMITED, 1)
    old = rb.History(last_split_change=rb.Change(now - 7200, -1))
    assert decide(fleet, good(now), fleet_view(2, 6, now), 8500, now=now, history=old).action == (
        "propose"
    )


def drive(fleet, seed, mu_at, *, hours, noise, start, guards=None):
    """Tick the pure logic every 10 minutes over ``hours``; apply every proposal at once."""
    rng = np.random.default_rng(seed)
    guards = guards or rb.RebalanceGuards()
    threshold, n_p = start
    history = rb.History()
    ticks = []
    for k in range(1, int(hours * 3600 / PERIOD) + 1):
        now = k * PERIOD
        jitter = lambda: 1 + rng.uniform(-noise, noise)  # noqa: E731
        n = int(rng.poisson(2.6 * jitter() * PERIOD))
        xs = lengths(rng, mu_at(now - PERIOD / 2), n) * (1 + rng.uniform(-noise, noise, n))
        win = rb.window_from_lengths(
            xs.tolist(),
            start_s=now - PERIOD,
            end_s=now,
            bin_edges=rb.DEFAULT_BIN_EDGES,
            output_tokens_mean=1024 * jitter(),
        )
        views = tuple(
            replace(v, load=float(rng.uniform(0, 4))) for v in fleet_view(n_p, 8 - n_p, now)
        )
        d = decide(fleet, win, views, threshold, now=now, guards=guards, history=history)
        history = rb.history_after(history, d, now, applied=d.action == "propose")
        if d.action == "propose":
            threshold, n_p = must(d.proposed).setting.threshold, must(d.proposed).setting.n_p
        ticks.append((now, d, threshold, n_p))
    return ticks


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_constant_traffic_with_twenty_percent_noise_does_not_flap(fleet, seed):
    nominal = plan_fleet(fleet, TruncatedLognormal(9.9, 1.0, 128, 131072), 1024.0).cluster(CLUSTER)
    ticks = drive(
        fleet,
        seed,
        lambda t: 9.9,
        hours=6,
        noise=0.2,
        start=(nominal.threshold_tokens, nominal.n_p),
    )
    flaps = rb.reversals_per_hour((now, d) for now, d, _, _ in ticks)
    assert all(count <= 1 for count in flaps.values())
    for _, d, _, _ in ticks:
        if d.gain is not None and d.gain < rb.RebalanceGuards().dead_band:
            assert d.action == "hold" and d.role_changes == ()
    changes = sum(1 for _, d, _, _ in ticks if d.action == "propose")
    assert changes <= 6  # at most one an hour on average over 36 ticks


def test_noise_inside_the_dead_band_changes_nothing_at_all(fleet):
    nominal = plan_fleet(fleet, TruncatedLognormal(9.9, 1.0, 128, 131072), 1024.0).cluster(CLUSTER)
    for seed in (0, 1):
        ticks = drive(
            fleet,
            seed,
            lambda t: 9.9,
            hours=6,
            noise=0.2,
            start=(nominal.threshold_tokens, nominal.n_p),
            guards=rb.RebalanceGuards(dead_band=0.5),
        )
        assert [d.action for _, d, _, _ in ticks] == ["hold"] * len(ticks)
        assert all(d.gain is None or d.gain < 0.5 for _, d, _, _ in ticks)


def drift_mu(t: float) -> float:
    """drift.yaml: an hour at mu 9.3, a 3-hour ramp to 10.2, then 10.2."""
    if t < 3600:
        return 9.3
    if t < 4 * 3600:
        return 9.3 + 0.9 * (t - 3600) / 10800
    return 10.2


@pytest.mark.parametrize("seed", [0, 1])
def test_threshold_and_split_follow_drift_within_two_ticks_after_it_settles(fleet, seed):
    first_hour = plan_fleet(fleet, TruncatedLognormal(9.3, 1.0, 128, 131072), 1024.0).cluster(
        CLUSTER
    )
    settled = plan_fleet(fleet, TruncatedLognormal(10.2, 1.0, 128, 131072), 1024.0).cluster(CLUSTER)
    ticks = drive(
        fleet,
        seed,
        drift_mu,
        hours=6,
        noise=0.0,
        start=(first_hour.threshold_tokens, first_hour.n_p),
    )
    settle = 4 * 3600 + PERIOD  # the first window wholly after the ramp
    after = [t for t in ticks if t[0] >= settle + 2 * PERIOD]
    for _, _, threshold, n_p in after:
        assert n_p == settled.n_p
        # the window's histogram has ~19%-wide bins: the threshold is known to within one bin
        assert abs(threshold - settled.threshold_tokens) / settled.threshold_tokens < 0.2
    assert first_hour.n_p != settled.n_p  # the drift really moved the optimum


def test_where_the_controller_removes_the_highest_ordinal_only_those_instances_are_chosen():
    views = [
        rb.InstanceView(f"decode-{k}", InstanceRole.DECODE, "active", load=float(10 - k), ordinal=k)
        for k in range(4)
    ]
    # decode-0 is the idlest, but shrinking the role would remove decode-3 and then decode-2.
    views[0] = rb.InstanceView("decode-0", InstanceRole.DECODE, "active", load=0.0, ordinal=0)
    chosen = rb.choose_role_changes(views, InstanceRole.DECODE, InstanceRole.PREFILL, 2)
    assert [c.instance for c in chosen] == ["decode-3", "decode-2"]


def test_a_draining_highest_ordinal_blocks_the_choice_and_a_down_one_is_skipped():
    views = [
        rb.InstanceView(f"decode-{k}", InstanceRole.DECODE, "active", ordinal=k) for k in range(3)
    ]
    draining = [*views[:2], rb.InstanceView("decode-2", InstanceRole.DECODE, "draining", ordinal=2)]
    assert rb.choose_role_changes(draining, InstanceRole.DECODE, InstanceRole.PREFILL, 1) == ()
    down = [*views[:2], rb.InstanceView("decode-2", InstanceRole.DECODE, "down", ordinal=2)]
    assert [
        c.instance
        for c in rb.choose_role_changes(down, InstanceRole.DECODE, InstanceRole.PREFILL, 1)
    ] == ["decode-1"]
