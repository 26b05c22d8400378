"""The pure routing decision: the paper's rules, every reason code, guards and invariants.

No Django, no Redis: the router is a pure function of plain dataclasses, so these tests
build a small fleet in memory (the paper's case-study hardware) and read the decisions.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.core.routing import (
    REASON_DESCRIPTIONS,
    REASONS,
    ClusterSpec,
    ControlSignals,
    ControlState,
    DecodeProfile,
    InstanceLoad,
    InstanceSpec,
    Link,
    LinkLoad,
    LinkRefusal,
    LinkReservation,
    LiveState,
    ModelSpec,
    PiecewiseLinear,
    PolicySnapshot,
    PrefixMatch,
    Reason,
    RouteDecision,
    RouteGuards,
    RouteInputError,
    RouteRequest,
    RouteUnavailable,
    RoutingPolicy,
    SnapshotFormatError,
    Topology,
    control_initial,
    control_signals,
    control_update,
    decision_from_dict,
    decision_to_dict,
    link_abundant_at,
    link_scarce_at,
    live_is_stale,
    policy_snapshot_from_dict,
    policy_snapshot_to_dict,
    reservation_fits,
    route_decide,
    route_decide_many,
    route_fallback_local,
    route_fallback_local_many,
)

H200 = ((1024, 0.44), (8192, 0.72), (32768, 1.84), (131072, 7.40))
H20 = (
    (1024, 0.603),
    (4096, 1.007),
    (8192, 1.554),
    (16384, 2.679),
    (32768, 5.046),
    (65536, 10.254),
    (131072, 22.565),
)
KV_MIB = ((1024, 190.8), (8192, 308.9), (32768, 701.3), (131072, 2316.3))
PD = "pd-h20"
PF = "prfaas-h200"
PF2 = "prfaas-b"
T = 19400
LINK = (PF, PD)


def make_topology(
    *,
    n_prfaas: int = 4,
    n_prefill: int = 3,
    n_decode: int = 5,
    prfaas_clusters: tuple[str, ...] = (PF,),
    links: bool = True,
    budget: int | None = None,
    states: dict[str, str] | None = None,
) -> Topology:
    states = states or {}
    clusters = [ClusterSpec(PD, "pd", H20, "H20", decode=DecodeProfile(20, 0.025))]
    instances = []
    link_specs = []
    for c in prfaas_clusters:
        clusters.append(ClusterSpec(c, "prfaas", H200, "H200"))
        for i in range(n_prfaas):
            name = f"{c}-p{i}"
            instances.append(
                InstanceSpec(name, c, "prefill", states.get(name, "active"), f"http://{name}")
            )
        if links:
            link_specs.append(Link(c, PD, 100.0, 10.0, budget))
    for i in range(n_prefill):
        name = f"pd-p{i}"
        instances.append(
            InstanceSpec(name, PD, "prefill", states.get(name, "active"), f"http://{name}")
        )
    for i in range(n_decode):
        name = f"pd-d{i}"
        instances.append(
            InstanceSpec(name, PD, "decode", states.get(name, "active"), f"http://{name}")
        )
    return Topology(
        ModelSpec("internal-1t-hybrid", 512, KV_MIB),
        tuple(clusters),
        tuple(instances),
        tuple(link_specs),
    )


def make_policy(**guards: object) -> RoutingPolicy:
    return RoutingPolicy(version=7, thresholds={PD: T}, guards=RouteGuards(**guards))  # type: ignore[arg-type]


def fresh(**kwargs: object) -> LiveState:
    return LiveState(now=1000.0, telemetry_at=999.0, **kwargs)  # type: ignore[arg-type]


def req(prompt: int, *matches: PrefixMatch, **kw: object) -> RouteRequest:
    return RouteRequest(PD, prompt, tuple(matches), **kw)  # type: ignore[arg-type]


SCARCE = fresh(links={LINK: LinkLoad(egress_gbps=90.0)})
ABUNDANT = fresh(links={LINK: LinkLoad(egress_gbps=10.0)})


# --------------------------------------------------------------------------------------
# One test per reason code
# --------------------------------------------------------------------------------------


def test_a_short_prompt_stays_local_below_threshold() -> None:
    d = route_decide(req(1000), make_policy(), make_topology(), fresh())
    assert d.route == "local"
    assert d.reason == Reason.BELOW_THRESHOLD
    assert d.prefill.cluster == PD and d.decode.cluster == PD
    assert d.incremental_tokens == 1000 and d.cached_tokens == 0
    assert d.threshold == T and d.policy_version == 7
    assert d.cache_transfer is None and d.reservation is None


def test_a_long_prompt_is_offloaded_above_threshold_and_reserves_its_kv_bytes() -> None:
    topo = make_topology()
    d = route_decide(req(30000), make_policy(), topo, fresh())
    assert d.route == "prfaas"
    assert d.reason == Reason.ABOVE_THRESHOLD
    assert d.prefill.cluster == PF and d.prefill.endpoint == f"http://{d.prefill.instance}"
    assert d.decode.cluster == PD
    assert d.reservation == LinkReservation(PF, PD, topo.kv_transfer_bytes(30000, 0))
    assert d.kv_bytes == math.ceil(topo.kv_bytes(30000))
    assert d.ttft_estimate_s.prfaas is not None
    # H200 prefill is faster than H20 even with the RTT, as in the paper's case study.
    assert d.ttft_estimate_s.prfaas is not None
    assert d.ttft_estimate_s.prfaas < d.ttft_estimate_s.local


def test_a_local_prefix_hit_keeps_a_long_prompt_local_by_cache_affinity() -> None:
    d = route_decide(
        req(30000, PrefixMatch(PD, 20480, "pd-p1")), make_policy(), make_topology(), SCARCE
    )
    assert d.route == "local"
    assert d.reason == Reason.CACHE_AFFINITY
    assert d.prefill.instance == "pd-p1"
    assert d.cached_tokens == 20480 and d.incremental_tokens == 9520


def test_a_full_link_budget_keeps_the_request_local_as_link_congested() -> None:
    topo = make_topology(budget=10**9)
    live = fresh(links={LINK: LinkLoad(egress_gbps=10.0, inflight_bytes=10**9 - 1000)})
    d = route_decide(req(30000), make_policy(), topo, live)
    assert d.route == "local"
    assert d.reason == Reason.LINK_CONGESTED
    assert d.reservation is None
    assert d.link_refusal == LinkRefusal(PF, PD, "budget")


def test_a_request_bigger_than_the_budget_is_offloaded_alone_on_an_idle_link() -> None:
    # Issue 28, item 2: the KV of 30,000 tokens does not fit a 0.5 GB budget at all.
    topo = make_topology(budget=5 * 10**8)
    need = topo.kv_transfer_bytes(30000, 0)
    assert need > 5 * 10**8
    idle = fresh(links={LINK: LinkLoad(egress_gbps=0.0, inflight_bytes=0)})
    d = route_decide(req(30000), make_policy(), topo, idle)
    assert (d.route, d.reason) == ("prfaas", Reason.ABOVE_THRESHOLD)
    assert d.reservation == LinkReservation(PF, PD, need)
    assert reservation_fits(d.reservation, topo, idle)
    # One byte reserved by anything else: refused, kept local, as the server's reservation.
    busy = fresh(links={LINK: LinkLoad(egress_gbps=0.0, inflight_bytes=1)})
    d = route_decide(req(30000), make_policy(), topo, busy)
    assert (d.route, d.reason) == ("local", Reason.LINK_CONGESTED)
    assert d.link_refusal == LinkRefusal(PF, PD, "budget")
    assert not reservation_fits(LinkReservation(PF, PD, need), topo, busy)
    # In a batch the first takes the idle link and holds it alone: the second stays local.
    batch = route_decide_many(
        [req(30000, request_id="a"), req(30000, request_id="b")], make_policy(), topo, idle
    )
    assert [d.route for d in batch] == ["prfaas", "local"]


def test_a_saturated_link_keeps_the_request_local_as_link_congested() -> None:
    live = fresh(links={LINK: LinkLoad(egress_gbps=100.0)})
    d = route_decide(req(30000), make_policy(), make_topology(), live)
    assert (d.route, d.reason) == ("local", Reason.LINK_CONGESTED)
    assert d.link_refusal == LinkRefusal(PF, PD, "saturation")


def test_a_threshold_raised_by_link_congestion_keeps_the_request_local_as_link_congested() -> None:
    control = ControlState(threshold_factor=2.0, congested_since=990.0, scarce=True, cause="link")
    live = fresh(links={LINK: LinkLoad(egress_gbps=90.0)}, control={PD: control})
    d = route_decide(req(30000), make_policy(), make_topology(), live)
    assert (d.route, d.reason) == ("local", Reason.LINK_CONGESTED)
    assert d.threshold == 2 * T
    assert d.link_refusal == LinkRefusal(PF, PD, "saturation")
    # Above the raised threshold it is offloaded again.
    d = route_decide(req(50000), make_policy(), make_topology(), live)
    assert (d.route, d.reason) == ("prfaas", Reason.ABOVE_THRESHOLD)
    assert d.link_refusal is None


def test_a_threshold_raised_by_prfaas_backlog_keeps_the_request_local_as_prfaas_backlog() -> None:
    control = ControlState(
        threshold_factor=1.5, congested_since=990.0, scarce=True, cause="backlog"
    )
    busy = {f"{PF}-p{i}": InstanceLoad(queued_prefill_s=6.0) for i in range(4)}
    live = fresh(instances=busy, control={PD: control})
    d = route_decide(req(25000), make_policy(), make_topology(), live)
    assert (d.route, d.reason) == ("local", Reason.PRFAAS_BACKLOG)


def test_a_backlog_raised_threshold_still_offloads_what_would_start_sooner_on_prfaas() -> None:
    control = ControlState(
        threshold_factor=1.5, congested_since=990.0, scarce=True, cause="backlog"
    )
    busy = {f"{PF}-p{i}": InstanceLoad(queued_prefill_s=6.0) for i in range(4)}
    # The local prefill queue is longer still: waiting behind PrfaaS's backlog is faster.
    local_busy = {f"pd-p{i}": InstanceLoad(queued_prefill_s=30.0) for i in range(3)}
    live = fresh(instances={**busy, **local_busy}, control={PD: control})
    d = route_decide(req(25000), make_policy(), make_topology(), live)
    assert (d.route, d.reason) == ("prfaas", Reason.ABOVE_THRESHOLD)
    assert d.ttft_estimate_s.prfaas is not None
    assert d.ttft_estimate_s.prfaas < d.ttft_estimate_s.local


def test_a_backlog_above_the_hard_limit_keeps_even_very_long_prompts_local() -> None:
    busy = {f"{PF}-p{i}": InstanceLoad(queued_prefill_s=60.0) for i in range(4)}
    d = route_decide(req(120000), make_policy(), make_topology(), fresh(instances=busy))
    assert (d.route, d.reason) == ("local", Reason.PRFAAS_BACKLOG)
    assert d.ttft_estimate_s.prfaas is not None and d.ttft_estimate_s.prfaas > 60.0


def test_stale_live_state_applies_the_static_rule_and_says_telemetry_stale() -> None:
    stale = LiveState(now=1000.0, stale=True)
    long = route_decide(req(30000), make_policy(), make_topology(), stale)
    short = route_decide(req(3000), make_policy(), make_topology(), stale)
    assert (long.route, long.reason, long.stale) == ("prfaas", Reason.TELEMETRY_STALE, True)
    assert (short.route, short.reason) == ("local", Reason.TELEMETRY_STALE)


def test_no_linked_prfaas_cluster_keeps_a_long_prompt_local_as_prfaas_unavailable() -> None:
    d = route_decide(req(30000), make_policy(), make_topology(links=False), fresh())
    assert (d.route, d.reason) == ("local", Reason.PRFAAS_UNAVAILABLE)
    assert d.ttft_estimate_s.prfaas is None


def test_a_prfaas_cluster_with_no_active_instance_counts_as_unavailable() -> None:
    states = {f"{PF}-p0": "down", f"{PF}-p1": "draining", f"{PF}-p2": "down"}
    live = fresh(instances={f"{PF}-p3": InstanceLoad(state="down")})
    d = route_decide(req(30000), make_policy(), make_topology(states=states), live)
    assert (d.route, d.reason) == ("local", Reason.PRFAAS_UNAVAILABLE)


def test_an_origin_without_active_prefill_offloads_whatever_the_length() -> None:
    states = {f"pd-p{i}": "down" for i in range(3)}
    d = route_decide(req(500), make_policy(), make_topology(states=states), fresh())
    assert (d.route, d.reason) == ("prfaas", Reason.ORIGIN_UNAVAILABLE)
    assert d.decode.cluster == PD


def test_an_origin_without_prefill_and_without_prfaas_is_unavailable() -> None:
    states = {f"pd-p{i}": "down" for i in range(3)}
    with pytest.raises(RouteUnavailable) as err:
        route_decide(req(500), make_policy(), make_topology(states=states, links=False), fresh())
    assert err.value.code == Reason.ORIGIN_UNAVAILABLE


def test_an_origin_without_active_decode_has_no_decode_capacity() -> None:
    states = {f"pd-d{i}": "draining" for i in range(5)}
    with pytest.raises(RouteUnavailable) as err:
        route_decide(req(500), make_policy(), make_topology(states=states), fresh())
    assert err.value.code == Reason.NO_DECODE_CAPACITY
    assert "decode" in str(err.value)


def test_every_reason_code_has_a_description() -> None:
    assert set(REASONS) == set(REASON_DESCRIPTIONS)
    assert all(REASON_DESCRIPTIONS[r] for r in REASONS)


# --------------------------------------------------------------------------------------
# The paper's scarce and abundant rules (section 4.2), cache hits on each side
# --------------------------------------------------------------------------------------


def test_scarce_bandwidth_ignores_a_prfaas_hit_for_the_decision_but_uses_it_to_compute() -> None:
    d = route_decide(
        req(30000, PrfaasHit := PrefixMatch(PF, 20480, f"{PF}-p2")),
        make_policy(),
        make_topology(),
        SCARCE,
    )
    # l_total - l_pd = 30000 > t: offload, though l_total - l_prfaas would be below t.
    assert d.route == "prfaas" and d.reason == Reason.ABOVE_THRESHOLD
    assert d.prefill.instance == PrfaasHit.instance
    assert d.cached_tokens == 20480 and d.incremental_tokens == 9520
    assert d.cache_transfer is None


def test_scarce_bandwidth_with_a_short_local_hit_offloads_without_any_cache_transfer() -> None:
    d = route_decide(
        req(60000, PrefixMatch(PD, 20480, "pd-p0")), make_policy(), make_topology(), SCARCE
    )
    assert d.route == "prfaas"
    assert d.cache_transfer is None
    assert d.incremental_tokens == 60000
    # Only the KV the PD cluster lacks crosses the link.
    topo = make_topology()
    assert d.kv_bytes == topo.kv_transfer_bytes(60000, 20480) < topo.kv_bytes(60000)


def test_abundant_bandwidth_moves_a_longer_prfaas_prefix_to_the_local_prefill() -> None:
    topo = make_topology()
    d = route_decide(req(30000, PrefixMatch(PF, 20480, f"{PF}-p2")), make_policy(), topo, ABUNDANT)
    # l_total - max(l_prfaas, l_pd) = 9520 <= t: local, and the cache moves PrfaaS -> PD.
    assert (d.route, d.reason) == ("local", Reason.CACHE_AFFINITY)
    assert d.cached_tokens == 20480
    ct = d.cache_transfer
    assert ct is not None
    assert (ct.source_cluster, ct.source_instance) == (PF, f"{PF}-p2")
    assert (ct.target_cluster, ct.target_instance) == (PD, d.prefill.instance)
    assert ct.bytes == topo.prefix_bytes(20480)
    assert d.reservation == LinkReservation(PF, PD, ct.bytes)


def test_abundant_bandwidth_moves_a_longer_pd_prefix_to_the_prfaas_prefill() -> None:
    topo = make_topology()
    d = route_decide(req(60000, PrefixMatch(PD, 20480, "pd-p1")), make_policy(), topo, ABUNDANT)
    assert (d.route, d.reason) == ("prfaas", Reason.ABOVE_THRESHOLD)
    ct = d.cache_transfer
    assert ct is not None
    assert (ct.source_cluster, ct.source_instance, ct.target_cluster) == (PD, "pd-p1", PF)
    assert ct.target_instance == d.prefill.instance
    assert d.cached_tokens == 20480
    assert d.reservation is not None
    assert d.reservation.bytes == ct.bytes + topo.kv_transfer_bytes(60000, 20480)


def test_abundant_bandwidth_with_a_longer_local_hit_stays_local_without_transfer() -> None:
    d = route_decide(
        req(30000, PrefixMatch(PD, 20480, "pd-p0"), PrefixMatch(PF, 4096, f"{PF}-p0")),
        make_policy(),
        make_topology(),
        ABUNDANT,
    )
    assert (d.route, d.reason) == ("local", Reason.CACHE_AFFINITY)
    assert d.cache_transfer is None and d.prefill.instance == "pd-p0"


def test_a_prfaas_prefix_that_does_not_fit_the_link_budget_stays_put() -> None:
    topo = make_topology(budget=10**8)  # less than the 20480-token prefix
    assert topo.prefix_bytes(20480) > 10**8
    d = route_decide(req(30000, PrefixMatch(PF, 20480, f"{PF}-p2")), make_policy(), topo, ABUNDANT)
    assert (d.route, d.reason) == ("local", Reason.LINK_CONGESTED)
    assert d.cache_transfer is None and d.reservation is None and d.cached_tokens == 0
    assert d.link_refusal is None  # a prefix that could not move: no offload was refused


def test_a_degraded_prfaas_entry_is_never_transferred() -> None:
    d = route_decide(
        req(30000, PrefixMatch(PF, 20480, f"{PF}-p2", exact=False)),
        make_policy(),
        make_topology(),
        ABUNDANT,
    )
    assert d.route == "prfaas" and d.cache_transfer is None
    # ... and is believed only in part (degraded_match_factor, whole blocks).
    assert d.cached_tokens == 10240


def test_cache_transfers_can_be_switched_off_by_policy() -> None:
    d = route_decide(
        req(30000, PrefixMatch(PF, 20480, f"{PF}-p2")),
        make_policy(allow_cache_transfer=False),
        make_topology(),
        ABUNDANT,
    )
    assert d.route == "prfaas" and d.cache_transfer is None


def test_a_cluster_wide_cache_pool_hit_counts_for_any_instance() -> None:
    d = route_decide(req(30000, cached_tokens={PD: 25600}), make_policy(), make_topology(), fresh())
    assert (d.route, d.reason, d.cached_tokens) == ("local", Reason.CACHE_AFFINITY, 25600)


def test_utilisation_between_the_guards_keeps_the_latched_mode() -> None:
    live = fresh(links={LINK: LinkLoad(egress_gbps=70.0)})
    hit = PrefixMatch(PF, 20480, f"{PF}-p2")
    latched_scarce = replace(live, control={PD: ControlState(scarce=True)})
    latched_abundant = replace(live, control={PD: ControlState(scarce=False)})
    topo, pol = make_topology(), make_policy()
    assert route_decide(req(30000, hit), pol, topo, latched_scarce).route == "prfaas"
    assert route_decide(req(30000, hit), pol, topo, latched_abundant).route == "local"


# --------------------------------------------------------------------------------------
# Placement: cache-affine, least backlog, never draining or down
# --------------------------------------------------------------------------------------


def test_prefill_goes_to_the_cache_holder_unless_its_backlog_outweighs_the_hit() -> None:
    topo, pol = make_topology(), make_policy()
    hit = PrefixMatch(PD, 8192, "pd-p2")
    idle = route_decide(req(12000, hit), pol, topo, fresh())
    assert idle.prefill.instance == "pd-p2"
    busy = fresh(instances={"pd-p2": InstanceLoad(queue_depth=3, queued_prefill_tokens=60000)})
    moved = route_decide(req(12000, hit), pol, topo, busy)
    assert moved.prefill.instance != "pd-p2"
    assert moved.cached_tokens == 0


def test_prefill_prefers_the_least_backlogged_instance() -> None:
    loads = {
        "pd-p0": InstanceLoad(queued_prefill_s=3.0),
        "pd-p1": InstanceLoad(queued_prefill_s=0.5),
        "pd-p2": InstanceLoad(queued_prefill_s=2.0),
    }
    d = route_decide(req(4000), make_policy(), make_topology(), fresh(instances=loads))
    assert d.prefill.instance == "pd-p1"
    assert d.ttft_estimate_s.local == pytest.approx(0.5 + make_topology().prefill_seconds(PD, 4000))


def test_decode_goes_to_the_least_loaded_instance_with_kv_room() -> None:
    loads = {
        "pd-d0": InstanceLoad(running=3, kv_usage=0.2),
        "pd-d1": InstanceLoad(running=1, kv_usage=0.97),
        "pd-d2": InstanceLoad(running=2, kv_usage=0.5),
        "pd-d3": InstanceLoad(running=5),
        "pd-d4": InstanceLoad(running=2, kv_usage=0.4),
    }
    d = route_decide(req(4000), make_policy(), make_topology(), fresh(instances=loads))
    assert d.decode.instance == "pd-d4"


def test_draining_and_down_instances_are_never_chosen_even_when_idle_and_cached() -> None:
    states = {"pd-p0": "draining", f"{PF}-p0": "down", "pd-d0": "down"}
    topo = make_topology(states=states)
    loads = {
        "pd-p1": InstanceLoad(queued_prefill_s=50.0, state="down"),
        "pd-p2": InstanceLoad(queued_prefill_s=9.0),
        f"{PF}-p1": InstanceLoad(state="draining"),
        "pd-d1": InstanceLoad(state="draining"),
    }
    matches = (PrefixMatch(PD, 20480, "pd-p0"), PrefixMatch(PF, 20480, f"{PF}-p0"))
    for prompt in (1000, 30000, 90000):
        d = route_decide(req(prompt, *matches), make_policy(), topo, fresh(instances=loads))
        assert d.prefill.instance in {"pd-p2", f"{PF}-p2", f"{PF}-p3"}
        assert d.decode.instance in {"pd-d2", "pd-d3", "pd-d4"}
        assert d.cached_tokens == 0


def test_a_prefix_cached_on_a_draining_or_down_instance_does_not_count() -> None:
    topo = make_topology(states={"pd-p0": "draining"})
    live = fresh(instances={f"{PF}-p0": InstanceLoad(state="down")}, links=ABUNDANT.links)
    # Would be local by cache affinity if the draining holder's prefix counted.
    d = route_decide(req(30000, PrefixMatch(PD, 20480, "pd-p0")), make_policy(), topo, live)
    assert (d.route, d.reason, d.cached_tokens) == ("prfaas", Reason.ABOVE_THRESHOLD, 0)
    # A down PrfaaS holder is never the source of a cache transfer.
    d = route_decide(req(30000, PrefixMatch(PF, 20480, f"{PF}-p0")), make_policy(), topo, live)
    assert d.route == "prfaas" and d.cache_transfer is None and d.cached_tokens == 0


# --------------------------------------------------------------------------------------
# Link budget and batches
# --------------------------------------------------------------------------------------


def test_a_batch_of_long_requests_never_reserves_more_than_the_link_budget() -> None:
    budget = 20 * 10**9
    topo = make_topology(budget=budget)
    inflight = 3 * 10**9
    live = fresh(links={LINK: LinkLoad(egress_gbps=10.0, inflight_bytes=inflight)})
    decisions = route_decide_many(
        [req(100000, request_id=f"r{i}") for i in range(200)], make_policy(), topo, live
    )
    reserved = sum(d.reservation.bytes for d in decisions if d.reservation is not None)
    offloaded = [d for d in decisions if d.route == "prfaas"]
    kept = [d for d in decisions if d.route == "local"]
    assert inflight + reserved <= budget
    assert offloaded and kept
    assert {d.reason for d in kept} == {Reason.LINK_CONGESTED}
    # Each offload reserved exactly its KV bytes; no local decision reserved anything.
    assert all(d.reservation is None for d in kept)
    # The next one would not have fit.
    assert inflight + reserved + topo.kv_transfer_bytes(100000, 0) > budget


def test_a_batch_spreads_its_own_work_over_instances() -> None:
    decisions = route_decide_many(
        [req(8000, request_id=f"r{i}") for i in range(12)], make_policy(), make_topology(), fresh()
    )
    prefill = {d.prefill.instance for d in decisions}
    decode = {d.decode.instance for d in decisions}
    assert prefill == {"pd-p0", "pd-p1", "pd-p2"}
    assert len(decode) == 5


def test_a_batch_decides_like_single_calls_except_for_the_load_it_adds_itself() -> None:
    topo, pol = make_topology(), make_policy()
    requests = [req(1000), req(30000, PrefixMatch(PD, 20480, "pd-p1"))]
    batch = route_decide_many(requests, pol, topo, fresh())
    single = [route_decide(r, pol, topo, fresh()) for r in requests]
    assert batch[0] == single[0]
    # The second request sees the decode slot the first one took.
    assert batch[1].decode.instance != batch[0].decode.instance
    assert replace(batch[1], decode=single[1].decode) == single[1]


@settings(max_examples=60, deadline=None)
@given(
    backlogs=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]), min_size=8, max_size=8),
    busy=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    items=st.lists(
        st.tuples(
            st.integers(600, 19000), st.none() | st.tuples(st.integers(0, 7), st.integers(1, 30))
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_each_decision_of_a_batch_picks_what_finishes_first_after_the_batchs_own_bookings(
    backlogs: list[float], busy: list[int], items: list[tuple[int, tuple[int, int] | None]]
) -> None:
    # What a batch keeps of its pools (the least loaded entry, as work is booked) must give
    # every decision the pick a full scan would, however the bookings reorder the pools.
    topo = make_topology(n_prefill=8, n_decode=6)
    loads = {f"pd-p{i}": InstanceLoad(queued_prefill_s=b) for i, b in enumerate(backlogs)}
    loads |= {f"pd-d{i}": InstanceLoad(running=r) for i, r in enumerate(busy)}
    # Each request's prefix, as {instance: cached tokens} (at most prompt - 1 counts).
    held = [{f"pd-p{h[0]}": min(h[1] * 512, prompt - 1)} if h else {} for prompt, h in items]
    requests = [
        req(prompt, *(PrefixMatch(PD, h[1] * 512, f"pd-p{h[0]}") for h in [hit] if h))
        for prompt, hit in items
    ]
    decisions = route_decide_many(requests, make_policy(), topo, fresh(instances=loads))
    backlog = {f"pd-p{i}": b for i, b in enumerate(backlogs)}
    slots = {f"pd-d{i}": float(r) for i, r in enumerate(busy)}
    for (prompt, _), cached, d in zip(items, held, decisions, strict=True):
        assert d.route == "local"
        cost = {
            n: backlog[n] + topo.prefill_seconds(PD, prompt - cached.get(n, 0)) for n in backlog
        }
        assert cost[d.prefill.instance] == pytest.approx(min(cost.values()), abs=1e-12)
        if not cached:  # the first of the least backlogged, as a scan in pool order finds
            assert d.prefill.instance == min(backlog, key=lambda n: (backlog[n], int(n[4:])))
        assert d.cached_tokens == cached.get(d.prefill.instance, 0)
        backlog[d.prefill.instance] += topo.prefill_seconds(PD, prompt - d.cached_tokens)
        assert d.decode.instance == min(slots, key=lambda n: (slots[n], int(n[4:])))
        slots[d.decode.instance] += 1.0


def test_reservation_fits_checks_the_live_in_flight_bytes() -> None:
    topo = make_topology(budget=1000)
    live = fresh(links={LINK: LinkLoad(inflight_bytes=600)})
    assert reservation_fits(LinkReservation(PF, PD, 400), topo, live)
    assert not reservation_fits(LinkReservation(PF, PD, 401), topo, live)
    assert not reservation_fits(LinkReservation("nowhere", PD, 1), topo, live)


def test_the_default_link_budget_is_a_few_seconds_of_line_rate() -> None:
    assert Link(PF, PD, 100.0).budget == int(100e9 / 8 * 2.0)
    assert Link(PF, PD, 100.0, kv_budget_bytes=5).budget == 5


def test_the_local_fallback_keeps_the_prfaas_estimate_and_says_link_congested() -> None:
    topo, pol = make_topology(), make_policy()
    request = req(30000, PrefixMatch(PF, 20480, f"{PF}-p1"))
    offload = route_decide(request, pol, topo, SCARCE)
    assert offload.route == "prfaas"
    d = route_fallback_local(request, pol, topo, SCARCE, original=offload)
    assert (d.route, d.reason) == ("local", Reason.LINK_CONGESTED)
    assert d.link_refusal == LinkRefusal(PF, PD, "budget")  # the reservation was refused
    assert d.cache_transfer is None and d.reservation is None
    assert d.ttft_estimate_s.prfaas == offload.ttft_estimate_s.prfaas
    assert d.incremental_tokens == 30000


def test_batch_fallbacks_are_local_spread_and_none_where_not_needed() -> None:
    topo, pol = make_topology(), make_policy()
    requests = [req(30000 + i, request_id=f"r{i}") for i in range(6)] + [req(100)]
    decisions = route_decide_many(requests, pol, topo, fresh())
    originals = [d if d.reservation is not None else None for d in decisions]
    assert originals[-1] is None and all(o is not None for o in originals[:-1])
    fallbacks = route_fallback_local_many(requests, originals, pol, topo, fresh())
    assert fallbacks[-1] is None
    local = [f for f in fallbacks if f is not None]
    assert len(local) == 6
    assert all(
        (f.route, f.reason, f.reservation) == ("local", "link_congested", None) for f in local
    )
    assert {f.link_refusal for f in local} == {LinkRefusal(PF, PD, "budget")}
    assert {f.prefill.instance for f in local} == {"pd-p0", "pd-p1", "pd-p2"}
    assert [f.request_id for f in local] == [f"r{i}" for i in range(6)]


def test_a_batch_fallback_is_none_when_the_origin_has_no_prefill() -> None:
    topo = make_topology(states={f"pd-p{i}": "down" for i in range(3)})
    request = req(500)
    offload = route_decide(request, make_policy(), topo, fresh())
    assert offload.reason == Reason.ORIGIN_UNAVAILABLE
    assert route_fallback_local_many([request], [offload], make_policy(), topo, fresh()) == [None]
    with pytest.raises(RouteUnavailable):
        route_fallback_local(request, make_policy(), topo, fresh(), original=offload)
    with pytest.raises(ValueError, match="same length"):
        route_fallback_local_many([request], [], make_policy(), topo, fresh())


def test_a_control_factor_below_one_never_lowers_the_threshold() -> None:
    assert ControlState(threshold_factor=0.5).effective_threshold(T) == T
    assert ControlState(threshold_factor=2.0).effective_threshold(T) == 2 * T


# --------------------------------------------------------------------------------------
# Several PrfaaS clusters
# --------------------------------------------------------------------------------------


def two_prfaas() -> Topology:
    return make_topology(prfaas_clusters=(PF, PF2))


def test_with_two_prfaas_clusters_the_faster_predicted_ttft_wins() -> None:
    idle = route_decide(req(40000), make_policy(), two_prfaas(), fresh())
    assert idle.prefill.cluster == PF2  # a tie breaks by name
    busy = {f"{PF2}-p{i}": InstanceLoad(queued_prefill_s=3.0) for i in range(4)}
    d = route_decide(req(40000), make_policy(), two_prfaas(), fresh(instances=busy))
    assert d.route == "prfaas" and d.prefill.cluster == PF
    assert d.reservation is not None and d.reservation.source == PF
    assert d.ttft_estimate_s.prfaas is not None
    assert d.ttft_estimate_s.prfaas < idle.ttft_estimate_s.prfaas + 3.0  # type: ignore[operator]


def test_with_two_prfaas_clusters_a_full_link_sends_the_request_over_the_other() -> None:
    topo = make_topology(prfaas_clusters=(PF, PF2), budget=10**10)
    live = fresh(links={LINK: LinkLoad(inflight_bytes=10**10)})
    d = route_decide(req(40000), make_policy(), topo, live)
    assert d.prefill.cluster == PF2


def test_with_two_prfaas_clusters_a_down_one_is_skipped() -> None:
    states = {f"{PF}-p{i}": "down" for i in range(4)}
    topo = make_topology(prfaas_clusters=(PF, PF2), states=states)
    d = route_decide(req(40000, PrefixMatch(PF, 30000, f"{PF}-p0")), make_policy(), topo, fresh())
    assert d.prefill.cluster == PF2


def test_a_prefix_one_prfaas_cluster_can_move_keeps_the_request_local_over_offloading() -> None:
    live = fresh(links={LINK: LinkLoad(egress_gbps=5.0), (PF2, PD): LinkLoad(egress_gbps=95.0)})
    d = route_decide(
        req(30000, PrefixMatch(PF, 20480, f"{PF}-p0")), make_policy(), two_prfaas(), live
    )
    assert (d.route, d.reason) == ("local", Reason.CACHE_AFFINITY)
    assert d.cache_transfer is not None and d.cache_transfer.source_cluster == PF


# --------------------------------------------------------------------------------------
# Stale live state
# --------------------------------------------------------------------------------------


def test_old_telemetry_counts_as_stale() -> None:
    guards = RouteGuards(stale_after_s=5.0)
    assert not live_is_stale(LiveState(now=100.0, telemetry_at=96.0), guards)
    assert live_is_stale(LiveState(now=100.0, telemetry_at=94.0), guards)
    assert live_is_stale(LiveState(now=100.0, stale=True), guards)
    d = route_decide(req(30000), make_policy(), make_topology(), LiveState(now=100, telemetry_at=1))
    assert d.reason == Reason.TELEMETRY_STALE


def test_the_static_rule_uses_the_local_cache_only_the_base_threshold_and_no_transfer() -> None:
    control = ControlState(threshold_factor=3.0, congested_since=0.0, cause="link")
    stale = LiveState(now=1000.0, stale=True, control={PD: control})
    local_hit = route_decide(
        req(30000, PrefixMatch(PD, 20480, "pd-p1")), make_policy(), make_topology(), stale
    )
    assert (local_hit.route, local_hit.cached_tokens, local_hit.threshold) == ("local", 20480, T)
    far_hit = route_decide(
        req(30000, PrefixMatch(PF, 20480, f"{PF}-p1")), make_policy(), make_topology(), stale
    )
    assert far_hit.route == "prfaas" and far_hit.cache_transfer is None
    assert far_hit.reason == Reason.TELEMETRY_STALE


def test_stale_mode_local_keeps_everything_local() -> None:
    pol = make_policy(stale_mode="local")
    stale = LiveState(now=1000.0, stale=True)
    for prompt in (10, 30000, 130000):
        d = route_decide(req(prompt), pol, make_topology(), stale)
        assert (d.route, d.reason) == ("local", Reason.TELEMETRY_STALE)


def test_stale_decisions_spread_over_instances_by_request() -> None:
    stale = LiveState(now=1000.0, stale=True)
    decisions = [
        route_decide(req(1000, request_id=f"r{i}"), make_policy(), make_topology(), stale)
        for i in range(40)
    ]
    assert len({d.prefill.instance for d in decisions}) == 3
    assert len({d.decode.instance for d in decisions}) == 5


# --------------------------------------------------------------------------------------
# Short-term control: hysteresis
# --------------------------------------------------------------------------------------

HOT = ControlSignals(egress_utilisation=0.9, prfaas_backlog_s=0.0)
BACKED_UP = ControlSignals(egress_utilisation=0.1, prfaas_backlog_s=10.0)
BAND = ControlSignals(egress_utilisation=0.7, prfaas_backlog_s=0.0)
CLEAR = ControlSignals(egress_utilisation=0.1, prfaas_backlog_s=0.0)


def test_the_threshold_rises_on_congestion_and_keeps_rising_up_to_the_cap() -> None:
    g = RouteGuards()
    s = control_update(control_initial(0.0), HOT, g, 0.0)
    assert s.threshold_factor == g.threshold_raise_factor
    assert (s.congested_since, s.scarce, s.cause) == (0.0, True, "link")
    s = control_update(s, HOT, g, g.threshold_rise_doubling_s)
    assert s.threshold_factor == pytest.approx(2 * g.threshold_raise_factor)
    s = control_update(s, HOT, g, 1000.0)
    assert s.threshold_factor == g.threshold_max_factor
    assert s.effective_threshold(T) == T * g.threshold_max_factor


def test_the_threshold_holds_between_the_guards_and_decays_once_clear() -> None:
    g = RouteGuards()
    s = control_update(control_initial(0.0), HOT, g, 0.0)
    s = control_update(s, BAND, g, 100.0)
    assert s.threshold_factor == g.threshold_raise_factor and s.scarce
    s = control_update(s, CLEAR, g, 100.0 + g.threshold_decay_half_life_s)
    assert s.threshold_factor == pytest.approx(1 + (g.threshold_raise_factor - 1) / 2)
    assert not s.scarce and s.congested_since is None
    s = control_update(s, CLEAR, g, 100.0 + 20 * g.threshold_decay_half_life_s)
    assert s.threshold_factor == 1.0


def test_control_does_not_depend_on_how_often_it_is_ticked() -> None:
    g = RouteGuards()
    start = control_update(control_initial(0.0), HOT, g, 0.0)
    once = control_update(start, HOT, g, 8.0)
    twice = control_update(control_update(start, HOT, g, 4.0), HOT, g, 8.0)
    assert once.threshold_factor == pytest.approx(twice.threshold_factor)
    fast = control_update(control_update(once, CLEAR, g, 20.0), CLEAR, g, 40.0)
    slow = control_update(once, CLEAR, g, 40.0)
    assert fast.threshold_factor == pytest.approx(slow.threshold_factor)


def test_backlog_alone_raises_the_threshold_with_backlog_as_cause() -> None:
    s = control_update(control_initial(0.0), BACKED_UP, RouteGuards(), 0.0)
    assert s.threshold_factor > 1 and s.cause == "backlog"


def test_control_signals_read_the_worst_link_and_prfaas_backlog() -> None:
    topo = two_prfaas()
    live = fresh(
        links={LINK: LinkLoad(egress_gbps=30.0), (PF2, PD): LinkLoad(egress_gbps=60.0)},
        instances={f"{PF2}-p0": InstanceLoad(queued_prefill_s=8.0)},
    )
    sig = control_signals(PD, topo, live)
    assert sig.egress_utilisation == pytest.approx(0.6)
    assert sig.prfaas_backlog_s == pytest.approx(2.0)


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (RouteRequest("atlantis", 100), "unknown_origin"),
        (RouteRequest(PF, 100), "invalid_origin"),
        (RouteRequest(PD, 0), "invalid_tokens"),
        (RouteRequest(PD, -5), "invalid_tokens"),
        (RouteRequest(PD, True), "invalid_tokens"),
    ],
)
def test_a_bad_request_is_refused_with_a_clear_code(request_: RouteRequest, code: str) -> None:
    with pytest.raises(RouteInputError) as err:
        route_decide(request_, make_policy(), make_topology(), fresh())
    assert err.value.code == code


def test_a_bad_request_in_a_batch_names_its_index_before_anything_is_decided() -> None:
    with pytest.raises(RouteInputError) as err:
        route_decide_many(
            [req(10), req(20), RouteRequest("atlantis", 5)], make_policy(), make_topology(), fresh()
        )
    assert err.value.index == 2


def test_matches_on_unknown_instances_or_beyond_the_prompt_are_not_believed() -> None:
    d = route_decide(
        req(
            3000,
            PrefixMatch(PD, 2048, "no-such-instance"),
            PrefixMatch(PD, 2048, "pd-d0"),  # a decode instance does not prefill
            PrefixMatch("atlantis", 2048),
            PrefixMatch(PD, 10**9),
        ),
        make_policy(),
        make_topology(),
        fresh(),
    )
    # The absurd pool hit is capped: at least one token is always computed.
    assert (d.cached_tokens, d.incremental_tokens) == (2999, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scarce_utilisation": 1.5}, "scarce_utilisation"),
        ({"abundant_utilisation": 0.9}, "abundant_utilisation"),
        ({"stale_mode": "yolo"}, "stale_mode"),
        ({"threshold_raise_factor": 0.5}, "threshold_raise_factor"),
        ({"threshold_decay_half_life_s": 0}, "threshold_decay_half_life_s"),
        ({"prfaas_backlog_clear_s": 9.0}, "prfaas_backlog_clear_s"),
    ],
)
def test_inconsistent_guards_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouteGuards(**kwargs)  # type: ignore[arg-type]


def test_an_inconsistent_topology_is_refused_with_the_problem_named() -> None:
    base = make_topology()
    with pytest.raises(ValueError, match="must go from a prfaas to a pd cluster"):
        Topology(base.model, base.clusters, base.instances, (Link(PD, PF, 10.0),))
    with pytest.raises(ValueError, match="unknown cluster"):
        Topology(base.model, base.clusters, (InstanceSpec("x", "nowhere", "prefill"),), ())
    with pytest.raises(ValueError, match="no decode role"):
        Topology(base.model, base.clusters, (InstanceSpec("x", PF, "decode"),), ())
    with pytest.raises(ValueError, match="state must be"):
        Topology(base.model, base.clusters, (InstanceSpec("x", PD, "prefill", "asleep"),), ())
    with pytest.raises(ValueError, match="strictly increasing"):
        Topology(ModelSpec("m", 512, ((2, 1.0), (1, 2.0))), base.clusters, (), ())


def test_tables_interpolate_and_extrapolate_the_nearest_segment() -> None:
    table = PiecewiseLinear(((1024, 0.44), (8192, 0.72), (32768, 1.84)))
    assert table.at(1024) == pytest.approx(0.44)
    assert table.at(4608) == pytest.approx(0.58)
    assert table.at(0) == pytest.approx(0.44 - 1024 * 0.28 / 7168)
    assert table.at(65536) == pytest.approx(1.84 + 32768 * 1.12 / 24576)
    assert PiecewiseLinear(((5, 2.0),)).at(10**6) == 2.0


# --------------------------------------------------------------------------------------
# Serialisation: what GET /api/v1/policy serves and the client caches
# --------------------------------------------------------------------------------------


def test_a_policy_snapshot_survives_json_and_decides_identically() -> None:
    topo = make_topology(prfaas_clusters=(PF, PF2), states={"pd-p0": "draining"})
    snap = PolicySnapshot(make_policy(stale_mode="local", prfaas_backlog_s=5.0), topo)
    data = json.loads(json.dumps(policy_snapshot_to_dict(snap)))
    back = policy_snapshot_from_dict(data)
    assert policy_snapshot_to_dict(back) == data
    assert back.policy == snap.policy
    assert back.topology.instances == topo.instances
    for r in (req(1000), req(30000), req(60000, PrefixMatch(PD, 20480, "pd-p1"))):
        for live in (fresh(), ABUNDANT, LiveState(now=0, stale=True)):
            assert route_decide(r, back.policy, back.topology, live) == route_decide(
                r, snap.policy, topo, live
            )


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda d: d["instances"][1].update(role="cook"), "role must be"),
        (lambda d: d["instances"][0].update(colour="red"), "instances[0].colour: unknown key"),
        (
            lambda d: d["clusters"][0].update(prefill_seconds=[[2, 1], [1, 2]]),
            "clusters[0].prefill_seconds[1]",
        ),
        (lambda d: d["links"][0].update(gbps="fast"), "links[0].gbps: expected a number"),
        (lambda d: d["policy"]["guards"].update(stale_mode="yolo"), "stale_mode"),
        (lambda d: d["policy"]["thresholds"].update({PD: -1}), "policy.thresholds.pd-h20"),
        (lambda d: d.pop("model"), "model: missing"),
        (lambda d: d.update(format=99), "format"),
    ],
)
def test_a_malformed_snapshot_is_refused_naming_the_key(mutate: object, path: str) -> None:
    data = policy_snapshot_to_dict(PolicySnapshot(make_policy(), make_topology()))
    mutate(data)  # type: ignore[operator]
    with pytest.raises(SnapshotFormatError) as err:
        policy_snapshot_from_dict(data)
    assert path in str(err.value)


def test_a_decision_survives_json() -> None:
    d = route_decide(
        req(60000, PrefixMatch(PD, 20480, "pd-p1")), make_policy(), make_topology(), ABUNDANT
    )
    assert d.cache_transfer is not None
    assert decision_from_dict(json.loads(json.dumps(decision_to_dict(d)))) == d
    local = route_decide(req(30000), make_policy(), make_topology(links=False), fresh())
    assert decision_from_dict(json.loads(json.dumps(decision_to_dict(local)))) == local
    refused = route_decide(
        req(30000), make_policy(), make_topology(), fresh(links={LINK: LinkLoad(egress_gbps=100.0)})
    )
    assert refused.link_refusal is not None
    assert decision_from_dict(json.loads(json.dumps(decision_to_dict(refused)))) == refused


def test_a_malformed_decision_body_is_refused() -> None:
    with pytest.raises(ValueError, match="malformed decision"):
        decision_from_dict({"route": "local"})


# --------------------------------------------------------------------------------------
# Invariants (hypothesis)
# --------------------------------------------------------------------------------------

STATES = st.sampled_from(["active", "active", "active", "draining", "down"])
MATCH_TARGETS = [PD, PF, PF2]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Topology, LiveState, RouteRequest, RoutingPolicy]:
    names = [f"{c}-p{i}" for c in (PF, PF2) for i in range(3)]
    names += [f"pd-p{i}" for i in range(3)] + [f"pd-d{i}" for i in range(5)]
    states = {n: draw(STATES) for n in names}
    topo = make_topology(
        n_prfaas=3,
        prfaas_clusters=(PF, PF2),
        states=states,
        budget=draw(st.sampled_from([None, 10**9, 10**11])),
    )
    loads = {
        n: InstanceLoad(
            queue_depth=draw(st.integers(0, 5)),
            queued_prefill_tokens=draw(st.integers(0, 200000)),
            running=draw(st.integers(0, 30)),
            kv_usage=draw(st.floats(0, 1)),
            state=draw(st.one_of(st.none(), STATES)),
        )
        for n in names
        if draw(st.booleans())
    }
    links = {
        (c, PD): LinkLoad(
            egress_gbps=draw(st.sampled_from([0.0, 5.0, 50.0, 70.0, 90.0, 110.0])),
            inflight_bytes=draw(st.sampled_from([0, 10**8, 2 * 10**10])),
        )
        for c in (PF, PF2)
    }
    control = {PD: ControlState(threshold_factor=draw(st.floats(1, 4)), scarce=draw(st.booleans()))}
    stale = draw(st.sampled_from([False, False, False, True]))
    live = LiveState(now=100.0, instances=loads, links=links, control=control, stale=stale)
    prompt = draw(st.integers(1, 200000))
    prefill_names = {
        PD: [f"pd-p{i}" for i in range(3)],
        PF: [f"{PF}-p{i}" for i in range(3)],
        PF2: [f"{PF2}-p{i}" for i in range(3)],
    }
    matches = tuple(
        PrefixMatch(
            c,
            512 * draw(st.integers(0, prompt // 512 + 2)),
            draw(st.one_of(st.none(), st.sampled_from(prefill_names[c] + ["pd-d0"]))),
            draw(st.booleans()),
        )
        for c in draw(st.lists(st.sampled_from(MATCH_TARGETS), max_size=4))
    )
    policy = make_policy(
        stale_mode=draw(st.sampled_from(["static", "local"])),
        allow_cache_transfer=draw(st.booleans()),
    )
    return topo, live, RouteRequest(PD, prompt, matches), policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_every_decision_names_active_instances_and_consistent_token_counts(
    fleet: tuple[Topology, LiveState, RouteRequest, RoutingPolicy],
) -> None:
    topo, live, request, policy = fleet
    loads = live.instances

    def active(name: str) -> bool:
        load = loads.get(name)
        state = load.state if load is not None and load.state else topo.instance_by_name[name].state
        return state == "active"

    try:
        d: RouteDecision = route_decide(request, policy, topo, live)
    except RouteUnavailable as exc:
        # Only when it is true: no active decode, or no prefill anywhere.
        role = "decode" if exc.code == Reason.NO_DECODE_CAPACITY else "prefill"
        assert exc.code in (Reason.NO_DECODE_CAPACITY, Reason.ORIGIN_UNAVAILABLE)
        assert not any(active(i.name) for i in topo.instances if i.cluster == PD and i.role == role)
        return

    assert active(d.prefill.instance) and active(d.decode.instance)
    assert topo.instance_by_name[d.prefill.instance].role == "prefill"
    assert topo.instance_by_name[d.decode.instance].cluster == PD
    assert d.incremental_tokens == request.prompt_tokens - d.cached_tokens
    assert 0 <= d.cached_tokens <= request.prompt_tokens - 1
    assert d.reason in REASONS
    expected_cluster = PD if d.route == "local" else {PF, PF2}
    assert d.prefill.cluster in (expected_cluster if d.route != "local" else {PD})
    if d.reservation is not None and not d.stale:
        assert reservation_fits(d.reservation, topo, live)
    if d.stale:
        assert d.reason == Reason.TELEMETRY_STALE and d.cache_transfer is None
    ct = d.cache_transfer
    if ct is not None:
        assert policy.guards.allow_cache_transfer
        assert ct.source_cluster != ct.target_cluster == d.prefill.cluster
        assert ct.target_instance == d.prefill.instance and ct.tokens == d.cached_tokens
        assert ct.source_instance is None or active(ct.source_instance)


# --------------------------------------------------------------------------------------
# One link model (scheduling.core.link): a link's own target utilisation
# --------------------------------------------------------------------------------------


def _with_target(target: float | None) -> Topology:
    topo = make_topology()
    links = tuple(replace(lk, target_utilisation=target) for lk in topo.links)
    return replace(topo, links=links)


def test_a_link_with_its_own_target_is_scarce_at_that_target() -> None:
    # 70 Gbps of 100: between the default guards (0.6 .. 0.8), so the latch decides; with the
    # link's own target of 0.5 it is scarce outright, and a PrfaaS hit no longer counts.
    live = replace(
        fresh(links={LINK: LinkLoad(egress_gbps=70.0)}),
        control={PD: ControlState(scarce=False)},
    )
    hit = PrefixMatch(PF, 20480, f"{PF}-p2")
    pol = make_policy()
    assert route_decide(req(30000, hit), pol, _with_target(None), live).route == "local"
    assert route_decide(req(30000, hit), pol, _with_target(0.5), live).route == "prfaas"
    assert link_scarce_at(_with_target(0.5).links[0], pol.guards) == 0.5
    assert link_abundant_at(_with_target(0.5).links[0], pol.guards) == 0.5
    assert link_scarce_at(_with_target(None).links[0], pol.guards) == pol.guards.scarce_utilisation


def test_a_target_utilisation_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="target_utilisation"):
        _with_target(1.5)


def test_a_links_target_utilisation_survives_the_snapshot_format() -> None:
    snap = PolicySnapshot(make_policy(), _with_target(0.6))
    data = json.loads(json.dumps(policy_snapshot_to_dict(snap)))
    assert data["links"][0]["target_utilisation"] == 0.6
    assert policy_snapshot_from_dict(data).topology.links[0].target_utilisation == 0.6
    plain = policy_snapshot_to_dict(PolicySnapshot(make_policy(), make_topology()))
    assert "target_utilisation" not in plain["links"][0]  # absent means the guard's
