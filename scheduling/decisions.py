"""The route service: live state in, decisions out, with at most one Redis round trip each
way and none of either for most calls.

Per API call (one request or a batch):

1. the in-process snapshot (topology, policy; no ORM);
2. the in-process live state (:mod:`scheduling.livestate`: control state, every instance's and
   link's latest sample, the links' in-flight bytes, the snapshot version), read in the
   background and never older than ``LIVE_STATE_MAX_AGE_S``;
3. when the call has block chains, ONE scripted Redis read: the longest cached prefix per
   instance of every chain (walked server-side);
4. the pure decision (:func:`scheduling.core.routing.route_decide_many`);
5. when a decision offloads or moves a cache, ONE atomic script reserving the link bytes of
   all of them (it also records the branch each took in the traffic store and the metrics);
6. the traffic counters, metrics and recent entries of the other decisions are summed in
   process and written by one scripted command at most ``ROUTE_RECORD_FLUSH_S`` later (best
   effort, like every metric: a process killed meanwhile loses that much).

A decision whose reservation Redis refuses becomes the router's local fallback
(:func:`scheduling.core.routing.route_fallback_local`, ``link_congested``). When Redis is slow or
down, the read gives up after ``REDIS_DEADLINE_S``; the call is decided from the snapshot with
stale live state (``telemetry_stale``: the policy's static rule, no cache transfer; as nothing
can be reserved, what the rule would offload stays local) and Redis is left alone for
``REDIS_BACKOFF_S`` so no call waits on it; the first call after that tries again, so the
service recovers by itself.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from django.conf import settings
from redis import exceptions as redis_exceptions

from clusters.live import prefix_index, telemetry
from clusters.live.scripts import counters_queue
from controlplane.errors import ApiError, Invalid
from controlplane.redis_connection import redis_async
from controlplane.redis_scripts import scripts_call_async
from scheduling import livestate, metrics, traffic
from scheduling.coalesce import Coalesced
from scheduling.core import routing
from scheduling.core.link import link_key
from scheduling.snapshot import (
    Snapshot,
    snapshot_age_s,
    snapshot_get_async,
    snapshot_needs_refresh,
    snapshot_refresh_async,
    snapshot_stale,
)

log = logging.getLogger(__name__)

# Generous on purpose: under a burst the wait includes this process's own queue, and a
# refused connection (Redis down) fails at once anyway.
REDIS_DEADLINE_S = 1.0
REDIS_BACKOFF_S = 1.0
# Decisions of a batch kept in the "recent decisions" list (all of a single call).
RECENT_PER_BATCH = 16

_redis_skip_until = 0.0


class RouteUnavailableError(ApiError):
    status = 503
    code = "unavailable"


@dataclass(frozen=True)
class RouteInput:
    """One request as the API validated it. ``chain``: its block hashes folded to 64-bit keys
    and packed as the prefix index holds them (8 bytes big-endian each)."""

    origin: str
    prompt_tokens: int
    chain: bytes = b""
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    request_id: str | None = None
    expected_output_tokens: int | None = None


def _redis_available() -> bool:
    return time.monotonic() >= _redis_skip_until


def _redis_failed(exc: BaseException) -> None:
    """A timeout may be this process's own load; only a refused connection means Redis is
    gone, and only then are the next calls spared the attempt."""
    global _redis_skip_until
    if isinstance(exc, ConnectionError | OSError | redis_exceptions.ConnectionError):
        _redis_skip_until = time.monotonic() + REDIS_BACKOFF_S
        # Not refreshable now: the next call after the back-off reads it again.
        livestate.live_state_reset()
    log.warning("live state unavailable (%s); deciding from the snapshot", type(exc).__name__)


async def _matches_run(
    hybrid: bool, block_tokens: int, chains: list[bytes]
) -> list[prefix_index.IndexMatch]:
    return await prefix_index.prefix_matches_bounded_async(
        redis_async(), chains, hybrid, block_tokens, float(settings.PREFIX_READ_DEADLINE_S)
    )


# One group-committed script per model shape (it changes only with the snapshot).
_MATCHERS: dict[tuple[bool, int], Coalesced[bytes, prefix_index.IndexMatch]] = {}


async def _matches(snap: Snapshot, chains: list[bytes]) -> list[prefix_index.IndexMatch]:
    """The longest cached prefix per instance of every chain: ONE scripted command, shared
    with the concurrent calls of this process (:mod:`scheduling.coalesce`)."""
    key = (snap.hybrid, snap.block_tokens)
    matcher = _MATCHERS.get(key)
    if matcher is None:
        matcher = _MATCHERS[key] = Coalesced(functools.partial(_matches_run, *key))
    return await matcher.call(chains)


async def _reserve_run(items: list[telemetry.Reservation]) -> list[bool]:
    now = time.time()
    raws = await scripts_call_async(
        redis_async(), lambda pipe: telemetry.link_reserve_many_queue(pipe, items, now)
    )
    flat = telemetry.link_reserve_many_parse(items, raws)
    return [bool(flat[2 * k]) for k in range(len(items))]


_RESERVER: Coalesced[telemetry.Reservation, bool] = Coalesced(_reserve_run)


def _requests(
    snap: Snapshot,
    inputs: Sequence[RouteInput],
    found_by_chain: list[prefix_index.IndexMatch] | None,
) -> list[routing.RouteRequest]:
    """Router requests; ``found_by_chain``: the prefix matches of the inputs that have a chain,
    in order."""
    out = []
    cluster_of = snap.cluster_of
    found_iter = iter(found_by_chain or ())
    # Requests of one call share prefixes, hence (instance, tokens) pairs: each match is built
    # once per call (the degraded set is the same for all of them).
    made: dict[tuple[str, int], routing.PrefixMatch | None] = {}
    for item in inputs:
        matches: tuple[routing.PrefixMatch, ...] = ()
        if found_by_chain is not None and item.chain:
            found = next(found_iter)
            got = []
            for pair in found.tokens_by_instance.items():
                m = made.get(pair)
                if m is None and pair not in made:
                    inst, tokens = pair
                    cluster = cluster_of.get(inst)
                    m = made[pair] = (
                        None
                        if cluster is None
                        else routing.PrefixMatch(
                            cluster, tokens, inst, exact=inst not in found.degraded
                        )
                    )
                if m is not None:
                    got.append(m)
            matches = tuple(got)
        out.append(
            routing.RouteRequest(
                origin=item.origin,
                prompt_tokens=item.prompt_tokens,
                prefix_matches=matches,
                cached_tokens=item.cached_tokens,
                request_id=item.request_id,
                expected_output_tokens=item.expected_output_tokens,
            )
        )
    return out


def _links(d: routing.RouteDecision) -> tuple[str, str]:
    """The traffic store's link fields of a decision: the link an offload crosses, and
    ``link:cause`` when the link's guard kept an offload local."""
    link = link_key(d.prefill.cluster, d.decode.cluster) if d.route == "prfaas" else ""
    lr = d.link_refusal
    return link, "" if lr is None else f"{link_key(lr.source, lr.target)}:{lr.cause}"


def _decision_dict(d: routing.RouteDecision, memo: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``decision_to_dict`` once per decision of a call: the recent-decisions entry and the
    response share it (``memo`` keeps the decisions themselves alive for the call)."""
    got = memo.get(id(d))
    if got is None:
        got = memo[id(d)] = routing.decision_to_dict(d)
    return got


def _recent_entry(
    item: RouteInput, d: routing.RouteDecision, now: float, memo: dict[int, dict[str, Any]]
) -> str:
    return orjson.dumps(
        {
            "ts": now,
            "inputs": {
                "origin": item.origin,
                "prompt_tokens": item.prompt_tokens,
                "block_hashes": len(item.chain) // 8,
                "cached_tokens": dict(item.cached_tokens),
                "request_id": item.request_id,
            },
            "decision": _decision_dict(d, memo),
        }
    ).decode()


def _transfer_end(snap: Snapshot, d: routing.RouteDecision, now: float) -> float:
    """Predicted end of the decision's transfers: when its reservation expires by itself."""
    rv = d.reservation
    assert rv is not None
    link = snap.topology.link_by_pair.get((rv.source, rv.target))
    rate = link.gbps * 1e9 / 8 if link is not None and link.gbps > 0 else 1.0
    rtt = link.rtt_ms / 1000 if link is not None else 0.0
    ttft = d.ttft_estimate_s.prfaas
    head = ttft if ttft is not None and math.isfinite(ttft) else 0.0
    return now + head + rv.bytes / rate + rtt


def _error(exc: routing.RouteError, batch: bool) -> ApiError:
    where = f"requests[{exc.index}]: " if batch and exc.index is not None else ""
    if isinstance(exc, routing.RouteUnavailable):
        return RouteUnavailableError(where + exc.detail, code=exc.code)
    status = 404 if exc.code == "unknown_origin" else 422
    return Invalid(where + exc.detail, code=exc.code, status=status)


async def _live_and_matches(
    snap: Snapshot, chains: list[bytes], now: float
) -> tuple[Snapshot, livestate.LiveRead, list[prefix_index.IndexMatch] | None]:
    """The live state (in process, age bounded) and the chains' prefix matches; the snapshot
    rebuilt first when the version counter of the live read moved."""
    read = await livestate.live_state_get_async(snap, now)
    if snapshot_needs_refresh(snap, read.version):
        fresh = await snapshot_refresh_async(read.version)
        if fresh is not snap:
            # Rare (inventory or policy changed): read again against the new fleet.
            snap = fresh
            read = await livestate.live_state_get_async(snap, now)
    matches = await _matches(snap, chains) if chains else None
    return snap, read, matches


@dataclass
class _Decided:
    requests: list[routing.RouteRequest]
    decisions: list[routing.RouteDecision]
    # Local fallback of each decision whose link bytes must be reserved, by index.
    fallbacks: dict[int, routing.RouteDecision]


async def _decide(
    snap: Snapshot,
    inputs: Sequence[RouteInput],
    live: routing.LiveState,
    matches: list[prefix_index.IndexMatch] | None,
    batch: bool,
    *,
    read_ok: bool,
) -> _Decided:
    """``read_ok``: the live state was read (errors are counted, a refused reservation means
    a congested link); otherwise Redis is away."""
    requests = _requests(snap, inputs, matches)
    try:
        decisions = routing.route_decide_many(requests, snap.policy, snap.topology, live)
    except routing.RouteError as exc:
        if read_ok:
            await metrics.route_error_count_async(exc.code, REDIS_DEADLINE_S)
        raise _error(exc, batch) from None
    # Offloads (and cache transfers) need their link bytes reserved atomically; precompute
    # the local fallback of each, so the reservation script can record whichever branch
    # happens.
    originals = [
        d if d.reservation is not None and d.reservation.bytes > 0 else None for d in decisions
    ]
    fallbacks: dict[int, routing.RouteDecision] = {}
    if any(o is not None for o in originals):
        reason = routing.Reason.LINK_CONGESTED if read_ok else routing.Reason.TELEMETRY_STALE
        computed = routing.route_fallback_local_many(
            requests, originals, snap.policy, snap.topology, live, reason=reason
        )
        for i, (original, fb) in enumerate(zip(originals, computed, strict=True)):
            if original is None:
                continue
            if fb is None:
                raise RouteUnavailableError(
                    (f"requests[{i}]: " if batch else "")
                    + f"{original.prefill.cluster} is needed for this request but its link "
                    "reservation may be refused, and the origin has no active prefill instance",
                    code=routing.Reason.ORIGIN_UNAVAILABLE,
                )
            fallbacks[i] = fb
    return _Decided(requests, decisions, fallbacks)


async def route_decide_async(inputs: Sequence[RouteInput], *, batch: bool) -> list[dict[str, Any]]:
    """Decide ``inputs`` (one API call) and return the response dicts, in order."""
    started = time.perf_counter()
    now = time.time()
    snap = await snapshot_get_async()
    chains = [item.chain for item in inputs if item.chain]
    read: livestate.LiveRead | None = None
    matches: list[prefix_index.IndexMatch] | None = None
    if _redis_available():
        try:
            # asyncio.timeout, not wait_for: no extra task per call on the hot path.
            async with asyncio.timeout(REDIS_DEADLINE_S):
                snap, read, matches = await _live_and_matches(snap, chains, now)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041 - both on 3.11
            if isinstance(exc, ApiError):
                raise
            _redis_failed(exc)
            read = None
    if read is None and snapshot_needs_refresh(snap, None):
        # Redis away: the snapshot still follows the database by age (the rebuild itself
        # backs off while the database is away too).
        snap = await snapshot_refresh_async(None)
    stale = routing.LiveState(now=now, stale=True)
    if read is None:
        got = await _decide(snap, inputs, stale, None, batch, read_ok=False)
    else:
        got = await _decide(snap, inputs, read.at(now), matches, batch, read_ok=True)
    decisions, fallbacks = got.decisions, got.fallbacks
    elapsed = time.perf_counter() - started
    memo: dict[int, dict[str, Any]] = {}

    admitted: dict[int, bool] = {}
    reservation_ids = {i: uuid.uuid4().hex for i in fallbacks}
    if read is not None and fallbacks:
        try:
            async with asyncio.timeout(REDIS_DEADLINE_S):
                admitted = await _reserve(snap, decisions, fallbacks, reservation_ids, now)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041
            _redis_failed(exc)
            # Redis went away since the live state was read: decided again as stale, as a
            # call that could not read it is (the static rule; nothing reserved, so what it
            # would offload stays local).
            read, memo = None, {}
            got = await _decide(snap, inputs, stale, None, batch, read_ok=False)
            decisions, fallbacks = got.decisions, got.fallbacks
    if read is None:
        # Without Redis nothing can be reserved, and the link budget is never to be exceeded:
        # what the static rule would offload stays local, still saying telemetry_stale.
        for i, fb in fallbacks.items():
            decisions[i] = fb
        return _answers(snap, decisions, memo, None)
    blind = _prefix_blind(inputs, matches)
    for i, ok in admitted.items():
        if not ok:
            decisions[i] = fallbacks[i]
        else:
            # The holder releases it by id when its transfer ends (POST /outcomes).
            rv = decisions[i].reservation
            assert rv is not None
            decisions[i] = dataclasses.replace(
                decisions[i], reservation=dataclasses.replace(rv, id=reservation_ids[i])
            )
    # Recorded once the branch each reservation took is known (the counters of the other
    # branch are never written).
    _pending_add(inputs, decisions, now, elapsed, batch, memo, len(blind))
    return _answers(snap, decisions, memo, max(0.0, now - read.read_at), blind)


def _prefix_blind(
    inputs: Sequence[RouteInput], matches: list[prefix_index.IndexMatch] | None
) -> set[int]:
    """Indexes of the inputs decided without (some of) their prefix hits: the index read
    passed ``PREFIX_READ_DEADLINE_S`` or a shard failed."""
    if not matches:
        return set()
    found = iter(matches)
    return {i for i, item in enumerate(inputs) if item.chain and next(found).unavailable}


def _answers(
    snap: Snapshot,
    decisions: Sequence[routing.RouteDecision],
    memo: dict[int, dict[str, Any]],
    live_age_s: float | None,
    prefix_blind: set[int] | None = None,
) -> list[dict[str, Any]]:
    """The response dicts, each with the age of the live state and of the topology and policy
    it was decided with; one decided from a snapshot past its bound (the database unreachable
    for longer than ``SNAPSHOT_MAX_AGE_S``) is ``stale`` like one decided without live state."""
    out = []
    age = None if live_age_s is None else round(live_age_s, 4)
    snapshot_age = round(snapshot_age_s(snap), 3)
    old = snapshot_stale(snap)
    for i, d in enumerate(decisions):
        # In place: the recent entries that share the dict were serialised already.
        answer = _decision_dict(d, memo)
        answer["live_age_s"] = age
        answer["snapshot_age_s"] = snapshot_age
        if old:
            answer["stale"] = True
        if prefix_blind and i in prefix_blind:
            answer["prefix_unavailable"] = True
        out.append(answer)
    return out


# --- recording: the rebalancer's traffic windows, /metrics, the recent decisions -------------


class _Pending:
    """Counters and recent entries of decisions that reserved nothing, summed in process."""

    def __init__(self) -> None:
        self.traffic = traffic.TrafficAggregate()
        self.ints: dict[tuple[str, str], int] = {}
        self.floats: dict[tuple[str, str], float] = {}
        self.entries: collections.deque[str] = collections.deque(maxlen=traffic.RECENT_CAP)

    def count(self, rows: Sequence[tuple[str, str, Any, int]], into: dict[Any, Any]) -> None:
        for key, name, incr, _ in rows:
            into[(key, name)] = into.get((key, name), 0) + incr


_pending = _Pending()
_flush_due: asyncio.TimerHandle | None = None


def _pending_add(
    inputs: Sequence[RouteInput],
    decisions: Sequence[routing.RouteDecision],
    now: float,
    elapsed: float,
    batch: bool,
    memo: dict[int, dict[str, Any]],
    prefix_unavailable: int = 0,
) -> None:
    """Add a call's records (each decision as it was answered: an offload whose reservation was
    refused counts as its local fallback) to the pending write and make sure a flush is due
    within ``ROUTE_RECORD_FLUSH_S``."""
    global _flush_due
    pending = _pending
    counts: dict[tuple[str, str], int] = {}
    recent_left = RECENT_PER_BATCH if batch else len(decisions)
    for i, d in enumerate(decisions):
        keep_recent = recent_left > 0
        recent_left -= 1
        item = inputs[i]
        link, refusal = _links(d) if d.route == "prfaas" or d.link_refusal else ("", "")
        pending.traffic.count(
            item.origin,
            now,
            d.route,
            d.reason,
            d.incremental_tokens,
            d.cached_tokens,
            item.expected_output_tokens,
            link,
            refusal,
        )
        counts[(d.route, d.reason)] = counts.get((d.route, d.reason), 0) + 1
        if keep_recent:
            pending.entries.append(_recent_entry(item, d, now, memo))
    ints, floats = metrics.latency_increments("batch" if batch else "single", elapsed)
    if prefix_unavailable:
        ints.append(metrics.prefix_unavailable_increment(prefix_unavailable))
    pending.count(metrics.decision_increments(counts) + ints, pending.ints)
    pending.count(floats, pending.floats)
    loop = asyncio.get_running_loop()
    due = _flush_due
    if due is None or due.cancelled() or getattr(due, "_loop", loop) is not loop:
        _flush_due = loop.call_later(float(settings.ROUTE_RECORD_FLUSH_S), _flush_start, loop)


# Flushes in flight (held: the loop keeps only a weak reference to its tasks).
_flushing: set[asyncio.Task[None]] = set()


def _flush_start(loop: asyncio.AbstractEventLoop) -> None:
    task = loop.create_task(route_records_flush())
    _flushing.add(task)
    task.add_done_callback(_flushing.discard)


def route_records_reset() -> None:
    """Forget the pending records (tests)."""
    global _pending, _flush_due
    if _flush_due is not None:
        _flush_due.cancel()
    _pending, _flush_due = _Pending(), None


async def route_records_flush() -> None:
    """Write the pending records in ONE scripted command (on a cluster one per hash slot; best
    effort, like every metric: records of a flush Redis refuses are dropped and the failure
    logged)."""
    global _pending, _flush_due
    pending, _pending, _flush_due = _pending, _Pending(), None
    ints = pending.traffic.increments() + [
        (key, name, n, 0) for (key, name), n in pending.ints.items()
    ]
    floats = [(key, name, x, 0) for (key, name), x in pending.floats.items()]
    if not ints and not floats and not pending.entries:
        return
    try:
        r = redis_async()
        async with asyncio.timeout(REDIS_DEADLINE_S):
            await scripts_call_async(
                r,
                lambda pipe: counters_queue(
                    pipe,
                    ints,
                    floats,
                    list_key=traffic.RECENT_KEY,
                    list_cap=traffic.RECENT_CAP,
                    entries=list(pending.entries),
                ),
            )
    except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041
        log.warning("route records not written (%s)", type(exc).__name__)


async def _reserve(
    snap: Snapshot,
    decisions: Sequence[routing.RouteDecision],
    fallbacks: Mapping[int, routing.RouteDecision],
    reservation_ids: Mapping[int, str],
    now: float,
) -> dict[int, bool]:
    """The link reservations of the offloads, in order, atomically per link (shared with the
    concurrent calls of this process); whether each was admitted."""
    order: list[int] = []
    reservations: list[telemetry.Reservation] = []
    for i, d in enumerate(decisions):
        if i not in fallbacks:
            continue
        rv = d.reservation
        assert rv is not None
        order.append(i)
        reservations.append(
            telemetry.Reservation(
                link=link_key(rv.source, rv.target),
                reservation_id=reservation_ids[i],
                nbytes=rv.bytes,
                end_ts=_transfer_end(snap, d, now),
                budget_bytes=snap.topology.link_by_pair[(rv.source, rv.target)].budget,
            )
        )
    admitted = await _RESERVER.call(reservations)
    return dict(zip(order, admitted, strict=True))


async def live_state_read_async() -> routing.LiveState:
    """The live state a router deciding in process needs (``GET /api/v1/route/live``): the
    route calls' in-process read (age bounded, ``LIVE_STATE_MAX_AGE_S``), judged now."""
    snap = await snapshot_get_async()
    now = time.time()
    async with asyncio.timeout(REDIS_DEADLINE_S):
        snap, read, _ = await _live_and_matches(snap, [], now)
    return read.at(now)


async def control_tick_async() -> dict[str, routing.ControlState]:
    """Advance and store every PD cluster's control state from the live state now (called
    after telemetry arrives, so congestion raises thresholds without waiting for a route).
    The fresh read replaces this process's live state at once."""
    snap = await snapshot_get_async()
    read = await asyncio.wait_for(livestate.live_state_read_fresh(snap), REDIS_DEADLINE_S * 5)
    livestate.live_state_install(read)
    if read.live.stale:
        return {}
    states = dict(read.live.control)
    await telemetry.control_states_write_async(
        {k: dataclasses.asdict(v) for k, v in states.items()}
    )
    return states
