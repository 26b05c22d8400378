"""The decision itself: candidates, estimates and the choice, for one request or a batch.

``route_decide`` and ``route_decide_many`` are the entry points (see the package docstring for
the rules); ``route_fallback_local(_many)`` turn offloads whose link reservation failed into
the local fallback. Pure: no I/O, no state kept between calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from scheduling.core.routing.candidates import (
    DecisionContext,
    PrefixHits,
    PrfaasOption,
    decode_book,
    decode_pick,
    hits_collect,
    link_admits_option,
    link_book,
    link_headroom,
    placement_of,
    prefill_book,
    prefill_pick,
    prfaas_evaluate,
    transfer_seconds,
)
from scheduling.core.routing.live import (
    ControlState,
    LiveState,
    live_is_stale,
)
from scheduling.core.routing.reasons import Reason
from scheduling.core.routing.types import (
    REFUSAL_BUDGET,
    REFUSAL_SATURATION,
    CacheTransfer,
    LinkRefusal,
    LinkReservation,
    RouteDecision,
    RouteError,
    RouteGuards,
    RouteInputError,
    RouteRequest,
    RouteUnavailable,
    RoutingPolicy,
    Topology,
    TtftEstimate,
)


def _validate(request: RouteRequest, topology: Topology) -> None:
    origin = topology.cluster_by_name.get(request.origin)
    if origin is None:
        raise RouteInputError(f"unknown origin cluster {request.origin!r}", code="unknown_origin")
    if origin.kind != "pd":
        raise RouteInputError(
            f"origin {request.origin!r} is a {origin.kind} cluster; requests arrive at pd clusters",
            code="invalid_origin",
        )
    tokens = request.prompt_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RouteInputError("prompt_tokens must be a positive integer", code="invalid_tokens")


def _local_decision(
    ctx: DecisionContext,
    request: RouteRequest,
    hits: PrefixHits,
    decode: list[Any],
    t_eff: float,
    reason: str,
    ttft_prfaas: float | None,
    stale: bool,
    mover: PrfaasOption | None = None,
    refusal: LinkRefusal | None = None,
) -> RouteDecision:
    topology = ctx.topology
    origin = request.origin
    prompt = request.prompt_tokens
    move_tokens = mover.move_out[1] if mover is not None and mover.move_out else 0
    picked = prefill_pick(ctx, origin, request, hits, move_tokens, not stale)
    if picked is None:
        raise RouteUnavailable(
            f"pd cluster {origin!r} has no active prefill instance", code=Reason.ORIGIN_UNAVAILABLE
        )
    entry, cached, compute = picked
    inst = entry[0]
    ttft = entry[1] + compute
    cache_transfer = None
    reservation = None
    if mover is not None and mover.move_out and cached == move_tokens:
        holder, tokens, nbytes = mover.move_out
        cache_transfer = CacheTransfer(mover.cluster, holder, origin, inst.name, tokens, nbytes)
        reservation = LinkReservation(mover.link.source, mover.link.target, nbytes)
        ttft += transfer_seconds(nbytes, mover.link, mover.util)
        link_book(ctx, reservation)
    prefill_book(ctx, entry, compute)
    decode_book(ctx, decode)
    return RouteDecision(
        route="local",
        prefill=placement_of(ctx.topology, inst),
        decode=placement_of(ctx.topology, decode[1]),
        incremental_tokens=prompt - cached,
        cached_tokens=cached,
        threshold=t_eff,
        policy_version=ctx.policy.version,
        reason=reason,
        ttft_estimate_s=TtftEstimate(ttft, ttft_prfaas),
        cache_transfer=cache_transfer,
        reservation=reservation,
        kv_bytes=math.ceil(topology.kv_bytes(prompt)),
        request_id=request.request_id,
        stale=stale,
        link_refusal=refusal,
    )


def _refused(option: PrfaasOption, cause: str) -> LinkRefusal:
    return LinkRefusal(option.link.source, option.link.target, cause)


def _prfaas_decision(
    ctx: DecisionContext,
    request: RouteRequest,
    opt: PrfaasOption,
    decode: list[Any],
    t_eff: float,
    reason: str,
    ttft_local: float | None,
    stale: bool,
) -> RouteDecision:
    inst = opt.entry[0]
    prompt = request.prompt_tokens
    cache_transfer = None
    if opt.move_in is not None:
        holder, tokens, nbytes = opt.move_in
        cache_transfer = CacheTransfer(
            request.origin, holder, opt.cluster, inst.name, tokens, nbytes
        )
    reservation = LinkReservation(opt.link.source, opt.link.target, opt.reserve_bytes)
    link_book(ctx, reservation)
    prefill_book(ctx, opt.entry, opt.compute)
    decode_book(ctx, decode)
    return RouteDecision(
        route="prfaas",
        prefill=placement_of(ctx.topology, inst),
        decode=placement_of(ctx.topology, decode[1]),
        incremental_tokens=prompt - opt.cached,
        cached_tokens=opt.cached,
        threshold=t_eff,
        policy_version=ctx.policy.version,
        reason=reason,
        ttft_estimate_s=TtftEstimate(ttft_local if ttft_local is not None else math.inf, opt.ttft),
        cache_transfer=cache_transfer,
        reservation=reservation,
        kv_bytes=opt.kv_bytes,
        request_id=request.request_id,
        stale=stale,
    )


def _congestion_reason(
    control: ControlState | None, options: Sequence[PrfaasOption], guards: RouteGuards
) -> str:
    """Why a raised threshold is raised: the recorded cause, else the live signals."""
    if control is not None and control.cause == "backlog":
        return Reason.PRFAAS_BACKLOG
    if control is not None and control.cause == "link":
        return Reason.LINK_CONGESTED
    if any(o.backlog >= guards.prfaas_backlog_s for o in options) and not any(
        o.util >= guards.scarce_utilisation for o in options
    ):
        return Reason.PRFAAS_BACKLOG
    return Reason.LINK_CONGESTED


def _why_local(prompt: int, decision_tokens: int, t0: float) -> str:
    """Local at the policy's own threshold: thanks to a cached prefix, or short anyway."""
    if prompt > t0 >= decision_tokens:
        return Reason.CACHE_AFFINITY
    return Reason.BELOW_THRESHOLD


def _decide(request: RouteRequest, ctx: DecisionContext, stale: bool) -> RouteDecision:
    topology = ctx.topology
    guards = ctx.policy.guards
    origin = request.origin
    prompt = request.prompt_tokens
    hits = hits_collect(request, topology, guards, ctx.live)
    t0 = ctx.policy.threshold(origin)
    control = None if stale else ctx.live.control.get(origin)
    t_eff = t0 if control is None else control.effective_threshold(t0)
    decode = decode_pick(ctx, request, guards, not stale)
    l_pd, pd_holder, pd_exact = hits.cluster_hit(origin)

    if stale and guards.stale_mode == "local":
        return _local_decision(
            ctx, request, hits, decode, t_eff, Reason.TELEMETRY_STALE, None, True
        )

    options: list[PrfaasOption] = []
    links = topology.links_into.get(origin, ())
    if links:
        # KV the decode side needs: everything but the prefix the PD cluster already holds.
        kv_need = topology.kv_transfer_bytes(prompt, l_pd)
        for link in links:
            opt = prfaas_evaluate(
                ctx, request, hits, link, l_pd, pd_holder, pd_exact, stale, kv_need
            )
            if opt is not None:
                options.append(opt)
    ttft_prfaas = min((o.ttft for o in options), default=None)

    local_pool = ctx.prefill_pool(origin)
    if not local_pool:
        # Nowhere to prefill locally: offload whatever the length, if some link has room.
        usable = [o for o in options if stale or link_admits_option(ctx, o)]
        if not usable:
            raise RouteUnavailable(
                f"pd cluster {origin!r} has no active prefill instance and no PrfaaS cluster "
                "can take the request",
                code=Reason.ORIGIN_UNAVAILABLE,
            )
        best = min(usable, key=lambda o: (o.ttft, o.cluster))
        reason = Reason.TELEMETRY_STALE if stale else Reason.ORIGIN_UNAVAILABLE
        return _prfaas_decision(ctx, request, best, decode, t_eff, reason, None, stale)

    def local(
        reason: str, mover: PrfaasOption | None = None, refusal: LinkRefusal | None = None
    ) -> RouteDecision:
        return _local_decision(
            ctx, request, hits, decode, t_eff, reason, ttft_prfaas, stale, mover, refusal
        )

    def local_ttft() -> float:
        picked = prefill_pick(ctx, origin, request, hits, 0, not stale)
        assert picked is not None
        return picked[0][1] + picked[2]

    incr_local = prompt - l_pd
    if not options:
        if incr_local > t0:
            return local(Reason.TELEMETRY_STALE if stale else Reason.PRFAAS_UNAVAILABLE)
        return local(Reason.TELEMETRY_STALE if stale else _why_local(prompt, incr_local, t0))

    # Offload only when no cluster's rule keeps it local: a prefix that one PrfaaS cluster
    # could move to the origin wins over offloading to another.
    wanting = options if min(o.decision_tokens for o in options) > t_eff else []
    # A PrfaaS backlog raises t to shed queue, not to make requests slower: a request that
    # the policy's own t would offload still goes to PrfaaS when it would start prefilling
    # there sooner than locally, backlog included (shortest expected delay). Link congestion
    # is different: there the budget, not the wait, is the limit.
    if (
        not wanting
        and not stale
        and control is not None
        and control.cause == "backlog"
        and min(o.decision_tokens for o in options) > t0
    ):
        sooner = local_ttft()
        wanting = [o for o in options if o.ttft < sooner]
    if stale:
        if wanting:
            best = min(wanting, key=lambda o: (o.ttft, o.cluster))
            return _prfaas_decision(
                ctx, request, best, decode, t_eff, Reason.TELEMETRY_STALE, local_ttft(), True
            )
        return local(Reason.TELEMETRY_STALE)

    if not wanting:
        # Staying local. With abundant bandwidth a longer exact prefix held by a PrfaaS
        # cluster is moved here (paper 3.4.3), if the link budget has room for it. (A move is
        # an optimisation the request can do without: unlike an offload, one bigger than the
        # budget is not taken even on an idle link.)
        mover: PrfaasOption | None = None
        move_tokens = 0
        for o in options:
            out = o.move_out
            if out is not None and out[1] > move_tokens and out[2] <= link_headroom(ctx, o.link):
                mover, move_tokens = o, out[1]
        if incr_local > t_eff:
            # Only a PrfaaS-held prefix keeps it local: it moves here, unless the link that
            # would carry a long enough one is full (then whatever fits still helps).
            if prompt - move_tokens <= t_eff:
                return local(Reason.CACHE_AFFINITY, mover)
            return local(Reason.LINK_CONGESTED, mover)
        best_tokens = prompt - max(l_pd, move_tokens)
        if best_tokens > t0:
            reason = _congestion_reason(control, options, guards)
            refusal = None
            if reason == Reason.LINK_CONGESTED:
                # Congestion control raised t for the egress of the busiest link.
                busiest = max(options, key=lambda o: (o.util, o.cluster))
                refusal = _refused(busiest, REFUSAL_SATURATION)
            return local(reason, mover, refusal)
        return local(_why_local(prompt, best_tokens, t0), mover)

    fits: list[PrfaasOption] = []
    blocked: list[PrfaasOption] = []
    for o in wanting:
        if o.backlog > guards.prfaas_backlog_reject_s:
            continue
        if not link_admits_option(ctx, o):
            blocked.append(o)
            continue
        fits.append(o)
    if not fits:
        if not blocked:
            return local(Reason.PRFAAS_BACKLOG)
        first = min(blocked, key=lambda o: (o.ttft, o.cluster))
        cause = REFUSAL_SATURATION if first.util >= 1.0 else REFUSAL_BUDGET
        return local(Reason.LINK_CONGESTED, refusal=_refused(first, cause))
    best = min(fits, key=lambda o: (o.ttft, o.cluster))
    return _prfaas_decision(
        ctx, request, best, decode, t_eff, Reason.ABOVE_THRESHOLD, local_ttft(), False
    )


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


def route_decide(
    request: RouteRequest, policy: RoutingPolicy, topology: Topology, live: LiveState
) -> RouteDecision:
    """Decide one request. Raises RouteInputError for a request that is wrong in itself and
    RouteUnavailable when the origin cannot serve it at all (no decode, no prefill)."""
    _validate(request, topology)
    ctx = DecisionContext(policy, topology, live, books=False)
    return _decide(request, ctx, live_is_stale(live, policy.guards))


def route_decide_many(
    requests: Sequence[RouteRequest], policy: RoutingPolicy, topology: Topology, live: LiveState
) -> list[RouteDecision]:
    """Decide a batch against one live snapshot, in order.

    The per-snapshot work (active pools, backlogs) is done once, and every decision books its
    own work (prefill seconds, decode slot, reserved link bytes) for the ones after it, so a
    batch spreads over the fleet and never reserves more than a link's budget (but for one
    request bigger than it, alone on a link the batch found idle). Every request
    is validated before any is decided; an error carries the failing ``index``.
    """
    for i, request in enumerate(requests):
        try:
            _validate(request, topology)
        except RouteError as exc:
            exc.index = i
            raise
    ctx = DecisionContext(policy, topology, live, books=len(requests) > 1)
    stale = live_is_stale(live, policy.guards)
    out: list[RouteDecision] = []
    for i, request in enumerate(requests):
        try:
            out.append(_decide(request, ctx, stale))
        except RouteError as exc:
            exc.index = i
            raise
    return out


def route_fallback_local(
    request: RouteRequest,
    policy: RoutingPolicy,
    topology: Topology,
    live: LiveState,
    *,
    reason: str = Reason.LINK_CONGESTED,
    original: RouteDecision | None = None,
) -> RouteDecision:
    """The local decision for ``request`` without any cross-cluster transfer.

    For the server when the atomic reservation of ``original.reservation`` fails in Redis:
    the request stays local and says ``reason`` (``link_congested`` by default). The PrfaaS
    TTFT estimate of ``original`` is kept. Raises RouteUnavailable if the origin has no
    active prefill instance.
    """
    _validate(request, topology)
    ctx = DecisionContext(policy, topology, live, books=False)
    stale = live_is_stale(live, policy.guards)
    hits = hits_collect(request, topology, policy.guards, live)
    decode = decode_pick(ctx, request, policy.guards, not stale)
    t0 = policy.threshold(request.origin)
    control = None if stale else live.control.get(request.origin)
    t_eff = t0 if control is None else control.effective_threshold(t0)
    ttft_prfaas = original.ttft_estimate_s.prfaas if original is not None else None
    return _local_decision(
        ctx,
        request,
        hits,
        decode,
        t_eff,
        reason,
        ttft_prfaas,
        stale,
        refusal=_budget_refusal(original, reason),
    )


def _budget_refusal(original: RouteDecision | None, reason: str) -> LinkRefusal | None:
    """An offload whose reservation the link refused: its budget had no room."""
    rv = original.reservation if original is not None else None
    if rv is None or original is None or original.route != "prfaas":
        return None
    if reason != Reason.LINK_CONGESTED:
        return None
    return LinkRefusal(rv.source, rv.target, REFUSAL_BUDGET)


def route_fallback_local_many(
    requests: Sequence[RouteRequest],
    originals: Sequence[RouteDecision | None],
    policy: RoutingPolicy,
    topology: Topology,
    live: LiveState,
    *,
    reason: str = Reason.LINK_CONGESTED,
) -> list[RouteDecision | None]:
    """:func:`route_fallback_local` for a batch, sharing one pass over the live state.

    ``originals[i]``: the decision whose reservation might fail (None: no fallback needed,
    answered None). The fallbacks book their own work on each other, as if all of them
    happened. An item whose origin has no active prefill instance gets None: if its
    reservation fails it cannot be served.
    """
    if len(requests) != len(originals):
        raise ValueError("requests and originals must have the same length")
    ctx = DecisionContext(policy, topology, live)
    stale = live_is_stale(live, policy.guards)
    out: list[RouteDecision | None] = []
    for request, original in zip(requests, originals, strict=True):
        if original is None:
            out.append(None)
            continue
        _validate(request, topology)
        if not ctx.prefill_pool(request.origin):
            out.append(None)
            continue
        hits = hits_collect(request, topology, policy.guards, live)
        decode = decode_pick(ctx, request, policy.guards, not stale)
        t0 = policy.threshold(request.origin)
        control = None if stale else live.control.get(request.origin)
        t_eff = t0 if control is None else control.effective_threshold(t0)
        out.append(
            _local_decision(
                ctx,
                request,
                hits,
                decode,
                t_eff,
                reason,
                original.ttft_estimate_s.prfaas,
                stale,
                refusal=_budget_refusal(original, reason),
            )
        )
    return out
