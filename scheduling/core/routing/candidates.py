"""Candidates of one decision: active pools, prefix hits, instance picks, PrfaaS options.

:class:`DecisionContext` holds the per-snapshot work shared by every request of a batch (and
what the batch itself has already placed, so that a batch spreads like single calls would);
the functions here evaluate where a request could prefill and decode, and at what predicted
cost. :mod:`scheduling.core.routing.decide` chooses among them.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

from scheduling.core.link import link_admits
from scheduling.core.routing.live import (
    LiveState,
    prefill_pool,
)
from scheduling.core.routing.reasons import Reason
from scheduling.core.routing.types import (
    InstanceSpec,
    Link,
    LinkReservation,
    Placement,
    PrefixMatch,
    RouteGuards,
    RouteRequest,
    RouteUnavailable,
    RoutingPolicy,
    Topology,
    link_abundant_at,
    link_scarce_at,
)

# Used when a link is fully busy: the transfer estimate then assumes this share of the line
# rate, so that a saturated link gives a large but finite TTFT instead of a division by zero.
_MIN_BANDWIDTH_SHARE = 0.05


class DecisionContext:
    """Per-snapshot work shared by every request decided against one live state: active
    pools, backlogs and link loads, plus what this batch itself has already placed."""

    __slots__ = (
        "backlog_sums",
        "books",
        "decode",
        "extra_inflight",
        "heaps",
        "live",
        "policy",
        "pool_index",
        "pools",
        "topology",
    )

    def __init__(
        self, policy: RoutingPolicy, topology: Topology, live: LiveState, books: bool = True
    ) -> None:
        self.policy = policy
        self.topology = topology
        self.live = live
        # Whether decisions book their work for the next ones (a batch). A context for one
        # decision books nothing, so it reads the live state's memo (LiveState.derived) as is.
        self.books = books
        # cluster -> [[instance, backlog_s], ...] (lists: a batch adds its own work)
        self.pools: dict[str, list[list[Any]]] = {}
        self.decode: dict[str, list[list[Any]]] = {}
        self.extra_inflight: dict[tuple[str, str], int] = {}
        # cluster -> {instance name: pool entry}, built only when a request has hits there
        self.pool_index: dict[str, dict[str, list[Any]]] = {}
        # Every request reads each pool's least loaded entry (once per PrfaaS cluster and for
        # the origin) and the PrfaaS pools' backlog totals, so they are not rescanned per read.
        # A single decision reads them memoised per live state. A batch books its own work,
        # so it keeps a heap per pool, (value when pushed, position, entry): bookings only
        # add, so an entry whose value moved since is pushed again with its value when it
        # reaches the top, and the top is then the least (first of equals, as min gives).
        # ("prefill" | "decode", cluster) -> heap
        self.heaps: dict[tuple[str, str], list[tuple[float, int, list[Any]]]] = {}
        # cluster -> backlog total of its prefill pool, this batch's bookings included
        self.backlog_sums: dict[str, float] = {}

    def prefill_pool(self, cluster: str) -> list[list[Any]]:
        got = self.pools.get(cluster)
        if got is None:
            # Built once per live state and topology (LiveState.derived), copied per context:
            # a batch books its own work into the entries.
            key = ("prefill", cluster)
            memo = self.live.derived.get(key)
            if memo is None or memo[0] is not self.topology:
                memo = (self.topology, prefill_pool(self.topology, self.live, cluster))
                self.live.derived[key] = memo
            got = [[inst, q] for inst, q in memo[1]] if self.books else memo[1]
            self.pools[cluster] = got
        return got

    def _memo_least(self, kind: str, cluster: str, pool: list[list[Any]], at: int) -> Any:
        """A single decision's (least entry, value total) of a pool, once per live state."""
        key = ("least", kind, cluster)
        memo = self.live.derived.get(key)
        if memo is None or memo[0] is not pool:
            least = min(pool, key=itemgetter(at)) if pool else None
            memo = (pool, least, sum(e[at] for e in pool))
            self.live.derived[key] = memo
        return memo

    def _heap_least(self, kind: str, cluster: str, pool: list[list[Any]], at: int) -> list[Any]:
        heap = self.heaps.get((kind, cluster))
        if heap is None:
            heap = [(e[at], i, e) for i, e in enumerate(pool)]
            heapq.heapify(heap)
            self.heaps[(kind, cluster)] = heap
        while True:
            value, i, entry = heap[0]
            now = entry[at]
            if now == value or now != now:  # (a NaN never equals itself: no endless loop)
                return entry
            heapq.heapreplace(heap, (now, i, entry))

    def least_backlogged(self, cluster: str) -> list[Any]:
        """The least backlogged entry of a non-empty prefill pool (the first of equals)."""
        pool = self.prefill_pool(cluster)
        if self.books:
            return self._heap_least("prefill", cluster, pool, 1)
        return self._memo_least("prefill", cluster, pool, 1)[1]

    def mean_backlog(self, cluster: str) -> float:
        """Mean backlog of a non-empty prefill pool, this batch's bookings included."""
        pool = self.prefill_pool(cluster)
        if not self.books:
            return float(self._memo_least("prefill", cluster, pool, 1)[2]) / len(pool)
        total = self.backlog_sums.get(cluster)
        if total is None:
            total = self.backlog_sums[cluster] = sum(e[1] for e in pool)
        return total / len(pool)

    def decode_pool(self, cluster: str) -> list[list[Any]]:
        """Active decode instances of ``cluster`` as ``[score, instance]``: the ordering key
        (has KV room, active requests, KV usage) folded into one number, so that picking is
        one C-level ``min``; a batch adds 1 per request it places there."""
        got = self.decode.get(cluster)
        if got is None:
            cap = self.policy.guards.decode_kv_usage_max
            key = ("decode", cluster, cap)
            memo = self.live.derived.get(key)
            if memo is not None and memo[0] is self.topology:
                got = [[score, inst] for score, inst in memo[1]] if self.books else memo[1]
                self.decode[cluster] = got
                return got
            loads = self.live.instances
            got = []
            append = got.append
            for name, inst, active in self.topology.decode_rows.get(cluster, ()):
                load = loads.get(name)
                if load is None:
                    if active:
                        append([0.0, inst])
                    continue
                state = load.state
                if (state == "active") if state is not None else active:
                    kv = load.kv_usage
                    # kv is within [0, 1]: half of it never outweighs one request.
                    score = load.running + load.waiting + 0.5 * kv
                    if kv >= cap:
                        score += 1e12
                    append([score, inst])
            self.live.derived[key] = (self.topology, [[score, inst] for score, inst in got])
            self.decode[cluster] = got
        return got

    def least_loaded_decode(self, cluster: str) -> list[Any]:
        """The least loaded entry of a non-empty decode pool (the first of equals)."""
        pool = self.decode_pool(cluster)
        if self.books:
            return self._heap_least("decode", cluster, pool, 0)
        return self._memo_least("decode", cluster, pool, 0)[1]

    def index_of(self, cluster: str) -> dict[str, list[Any]]:
        got = self.pool_index.get(cluster)
        if got is None:
            pool = self.prefill_pool(cluster)
            if self.books:
                got = {e[0].name: e for e in pool}
            else:
                # The memo's own entries: index them once per live state too.
                key = ("index", cluster)
                memo = self.live.derived.get(key)
                if memo is None or memo[0] is not pool:
                    memo = (pool, {e[0].name: e for e in pool})
                    self.live.derived[key] = memo
                got = memo[1]
            self.pool_index[cluster] = got
        return got

    def link_inflight(self, link: Link) -> int:
        load = self.live.links.get(link.pair)
        base = load.inflight_bytes if load is not None else 0
        return base + self.extra_inflight.get(link.pair, 0)


class PrefixHits:
    """The request's usable cached prefixes, per cluster and per instance."""

    __slots__ = ("best", "by_cluster", "by_instance", "pool")

    def __init__(self) -> None:
        # cluster -> (tokens, instance or None, exact)
        self.best: dict[str, tuple[int, str | None, bool]] = {}
        # instance -> tokens, and the same per cluster
        self.by_instance: dict[str, int] = {}
        self.by_cluster: dict[str, dict[str, int]] = {}
        # cluster -> tokens in the cluster-wide pool
        self.pool: dict[str, int] = {}

    def cluster_hit(self, cluster: str) -> tuple[int, str | None, bool]:
        return self.best.get(cluster, (0, None, True))


def _active_prefill(topology: Topology, live: LiveState) -> dict[str, str]:
    """Prefill instances that are active now, name -> cluster (built once per live state and
    topology, :attr:`LiveState.derived`)."""
    memo = live.derived.get("active_prefill")
    if memo is not None and memo[0] is topology:
        return memo[1]
    loads = live.instances
    active: dict[str, str] = {}
    # The rule of prefill_pool: a reported state wins over the inventory's.
    for cluster, rows in topology.prefill_rows.items():
        for name, _inst, listed_active in rows:
            load = loads.get(name)
            state = load.state if load is not None else None
            if (state == "active") if state is not None else listed_active:
                active[name] = cluster
    live.derived["active_prefill"] = (topology, active)
    return active


def hits_collect(
    request: RouteRequest, topology: Topology, guards: RouteGuards, live: LiveState
) -> PrefixHits:
    """The request's prefix matches that can be used: on a known active prefill instance of
    the named cluster (or a cluster-wide pool), degraded ones discounted, capped below the
    prompt. A cache on a draining or down instance is not counted anywhere."""
    hits = PrefixHits()
    if not request.prefix_matches and not request.cached_tokens:
        return hits
    block = topology.model.block_tokens
    # At least one token is always computed: the engine needs it for the first output token.
    cap = request.prompt_tokens - 1
    clusters = topology.cluster_by_name
    active = _active_prefill(topology, live)
    by_instance, by_cluster, pool, best = hits.by_instance, hits.by_cluster, hits.pool, hits.best
    matches: Iterable[PrefixMatch] = request.prefix_matches
    if request.cached_tokens:
        matches = list(matches) + [
            PrefixMatch(cluster=c, tokens=n) for c, n in request.cached_tokens.items()
        ]
    for m in matches:
        cluster, tokens, name = m.cluster, m.tokens, m.instance
        if tokens <= 0:
            continue
        if name is not None:
            if active.get(name) != cluster:
                continue  # unknown, not prefill, elsewhere, or not active now
        elif cluster not in clusters:
            continue
        if not m.exact:
            tokens = int(tokens * guards.degraded_match_factor) // block * block
        if tokens > cap:
            tokens = cap
        if tokens <= 0:
            continue
        if name is not None:
            if tokens > by_instance.get(name, 0):
                by_instance[name] = tokens
                own = by_cluster.get(cluster)
                if own is None:
                    own = by_cluster[cluster] = {}
                own[name] = tokens
        elif tokens > pool.get(cluster, 0):
            pool[cluster] = tokens
        prev = best.get(cluster)
        if prev is None or tokens > prev[0] or (tokens == prev[0] and m.exact and not prev[2]):
            best[cluster] = (tokens, name, m.exact)
    return hits


def spread_key(request: RouteRequest) -> int:
    key = request.request_id or f"{request.origin}:{request.prompt_tokens}"
    return zlib.crc32(key.encode())


def prefill_pick(
    ctx: DecisionContext,
    cluster: str,
    request: RouteRequest,
    hits: PrefixHits,
    extra_cached: int,
    use_load: bool,
) -> tuple[list[Any], int, float] | None:
    """The active prefill instance of ``cluster`` that finishes this request first:
    least ``backlog + T(prompt - its usable prefix)``, i.e. cache-affine but load-aware.

    Returns (pool entry ``[instance, backlog_s]``, cached tokens there, T of the rest there:
    the prefill seconds the caller books), or None when the cluster has no active prefill
    instance. ``extra_cached``: tokens a cache transfer would bring to whichever instance
    wins. Without trustworthy load (``use_load=False``) the longest hit wins and ties are
    spread by a hash of the request.
    """
    pool = ctx.prefill_pool(cluster)
    if not pool:
        return None
    prompt = request.prompt_tokens
    base_cached = hits.pool.get(cluster, 0)
    if extra_cached > base_cached:
        base_cached = extra_cached
    own = hits.by_cluster.get(cluster)
    if not use_load:
        longest = base_cached
        ties: list[list[Any]] = []
        for entry in pool:
            c = own.get(entry[0].name, 0) if own else 0
            if c < base_cached:
                c = base_cached
            if c > longest:
                longest, ties = c, [entry]
            elif c == longest:
                ties.append(entry)
        return (
            ties[spread_key(request) % len(ties)],
            longest,
            ctx.topology.prefill_seconds(cluster, prompt - longest),
        )
    # The least backlogged instance, or one holding a longer prefix: any other instance
    # has at least that backlog and no better prefix, so it cannot finish first.
    topology = ctx.topology
    best = ctx.least_backlogged(cluster)
    best_cached = base_cached
    if own:
        c = own.get(best[0].name, 0)
        if c > best_cached:
            best_cached = c
    best_t = topology.prefill_seconds(cluster, prompt - best_cached)
    best_cost = best[1] + best_t
    if own:
        index = ctx.index_of(cluster)
        # A prefix is often held by several instances at the same length: T once per length.
        seconds: dict[int, float] = {}
        for name, tokens in own.items():
            held = index.get(name)
            # T is never negative: a backlog at or past the best cost cannot beat it.
            if held is None or held is best or held[1] >= best_cost:
                continue
            entry = held
            cached = tokens if tokens > base_cached else base_cached
            t = seconds.get(cached)
            if t is None:
                t = seconds[cached] = topology.prefill_seconds(cluster, prompt - cached)
            cost = entry[1] + t
            if cost < best_cost:
                best, best_cost, best_cached, best_t = entry, cost, cached, t
    return best, best_cached, best_t


def decode_pick(
    ctx: DecisionContext, request: RouteRequest, guards: RouteGuards, use_load: bool
) -> list[Any]:
    """Least loaded active decode instance of the origin with KV room (any active one when
    none has room), as its pool entry ``[score, instance]``; raises RouteUnavailable when
    the origin has no active decode instance."""
    origin = request.origin
    pool = ctx.decode_pool(origin)
    if not pool:
        raise RouteUnavailable(
            f"pd cluster {origin!r} has no active decode instance", code=Reason.NO_DECODE_CAPACITY
        )
    if not use_load:
        # No trustworthy load: spread requests by a hash instead of piling onto one.
        return pool[spread_key(request) % len(pool)]
    return ctx.least_loaded_decode(origin)


class PrfaasOption:
    """One PrfaaS cluster considered for this request (internal, mutable scratch)."""

    __slots__ = (
        "backlog",
        "cached",
        "cluster",
        "compute",
        "decision_tokens",
        "entry",
        "kv_bytes",
        "link",
        "move_in",
        "move_out",
        "reserve_bytes",
        "scarce",
        "ttft",
        "util",
    )

    cluster: str
    link: Link
    util: float
    backlog: float
    scarce: bool
    #: the offload test's incremental length for this cluster
    decision_tokens: int
    #: (holder instance, tokens, bytes) of a PrfaaS-held prefix that could move to the origin
    move_out: tuple[str | None, int, int] | None
    #: (holder instance, tokens, bytes) of a PD-held prefix moved here if offloaded
    move_in: tuple[str | None, int, int] | None
    entry: list[Any]
    cached: int
    #: prefill seconds of the uncached rest on ``entry``
    compute: float
    kv_bytes: int
    reserve_bytes: int
    ttft: float


def placement_of(topology: Topology, inst: InstanceSpec) -> Placement:
    return topology.placement_by_name[inst.name]


def link_headroom(ctx: DecisionContext, link: Link) -> int:
    return link.budget - ctx.link_inflight(link)


def link_admits_option(ctx: DecisionContext, opt: PrfaasOption) -> bool:
    """The link admits this offload (scheduling.core.link: not saturated, budget has room)."""
    return link_admits(opt.util, ctx.link_inflight(opt.link), opt.reserve_bytes, opt.link.budget)


def transfer_seconds(nbytes: float, link: Link, util: float) -> float:
    share = max(_MIN_BANDWIDTH_SHARE, 1.0 - util)
    return nbytes * 8.0 / (link.gbps * 1e9 * share)


def prfaas_evaluate(
    ctx: DecisionContext,
    request: RouteRequest,
    hits: PrefixHits,
    link: Link,
    l_pd: int,
    pd_holder: str | None,
    pd_exact: bool,
    stale: bool,
    kv_bytes: int,
) -> PrfaasOption | None:
    """How offloading to ``link.source`` would go; None if it has no active prefill.
    ``kv_bytes``: the KV the decode side needs, whichever cluster prefills
    (``topology.kv_transfer_bytes(prompt, l_pd)``, computed once per request)."""
    topology = ctx.topology
    guards = ctx.policy.guards
    cluster = link.source
    pool = ctx.prefill_pool(cluster)
    if not pool:
        return None
    prompt = request.prompt_tokens
    l_c, c_holder, c_exact = hits.cluster_hit(cluster)
    if stale:
        # The static rule: local cache only, no transfers, no load.
        util, backlog, scarce = 0.0, 0.0, True
    else:
        load = ctx.live.links.get(link.pair)
        util = (load.egress_gbps / link.gbps) if load is not None else 0.0
        backlog = ctx.mean_backlog(cluster)
        if util >= link_scarce_at(link, guards) or backlog >= guards.prfaas_backlog_s:
            scarce = True
        elif util <= link_abundant_at(link, guards) and backlog <= guards.prfaas_backlog_clear_s:
            scarce = False
        else:
            control = ctx.live.control.get(request.origin)
            scarce = control.scarce if control is not None else True
    transfers_ok = guards.allow_cache_transfer and not scarce

    opt = PrfaasOption()
    opt.cluster, opt.link, opt.util, opt.backlog, opt.scarce = cluster, link, util, backlog, scarce
    # Paper's offload test: scarce -> prompt - l_pd; abundant -> prompt - max(l_prfaas, l_pd),
    # where l_prfaas counts only when it can really be moved to the PD cluster.
    movable = l_c if (transfers_ok and c_exact and l_c > l_pd) else 0
    opt.decision_tokens = prompt - max(l_pd, movable)
    opt.move_out = (c_holder, l_c, topology.prefix_bytes(l_c)) if movable else None
    opt.move_in = None
    extra = 0
    if transfers_ok and pd_exact and l_pd > l_c:
        extra = l_pd
    picked = prefill_pick(ctx, cluster, request, hits, extra, not stale)
    assert picked is not None
    entry, cached, compute = picked
    reserve = 0
    ttft = entry[1] + link.rtt_ms / 1000.0
    if extra and cached == extra and hits.by_instance.get(entry[0].name, 0) < extra:
        move_bytes = topology.prefix_bytes(extra)
        opt.move_in = (pd_holder, extra, move_bytes)
        reserve += move_bytes
        ttft += transfer_seconds(move_bytes, link, util)
    opt.entry, opt.cached = entry, cached
    opt.kv_bytes = kv_bytes
    reserve += opt.kv_bytes
    opt.compute = compute
    # Layer-wise pipelining hides the KV transfer behind compute; only the excess shows.
    ttft += compute + max(0.0, transfer_seconds(opt.kv_bytes, link, util) - compute)
    opt.reserve_bytes = reserve
    opt.ttft = ttft
    return opt


def prefill_book(ctx: DecisionContext, entry: list[Any], seconds: float) -> None:
    if ctx.books:
        entry[1] += seconds
        cluster = entry[0].cluster
        if cluster in ctx.backlog_sums:
            ctx.backlog_sums[cluster] += seconds


def link_book(ctx: DecisionContext, reservation: LinkReservation | None) -> None:
    if ctx.books and reservation is not None and reservation.bytes:
        key = (reservation.source, reservation.target)
        ctx.extra_inflight[key] = ctx.extra_inflight.get(key, 0) + reservation.bytes


def decode_book(ctx: DecisionContext, entry: list[Any]) -> None:
    if ctx.books:
        entry[0] += 1.0
