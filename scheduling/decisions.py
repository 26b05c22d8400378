"""The route service: live state in, decisions out, with at most two Redis round trips.

Per API call (one request or a batch):

1. the in-process snapshot (topology, policy; no ORM);
2. ONE pipelined Redis read: snapshot version, control state, every instance's and link's
   latest sample, the links' in-flight bytes, and the longest cached prefix per instance of
   every block chain of the call (walked server-side by one script);
3. the pure decision (:func:`scheduling.core.routing.route_decide_many`);
4. ONE write pipeline: the atomic link reservation of each offload (which also records the
   branch it took in the traffic store), the traffic counters of the others, metrics.

A decision whose reservation Redis refuses becomes the router's local fallback
(:func:`scheduling.core.routing.route_fallback_local`, ``link_congested``). When Redis is slow or
down, the read gives up after ``REDIS_DEADLINE_S``; the call is decided from the snapshot with
stale live state (``telemetry_stale``: the policy's static rule, no cache transfer; as nothing
can be reserved, what the rule would offload stays local) and Redis is left alone for ``REDIS_BACKOFF_S`` so no call waits on it; the first
call after that tries again, so the service recovers by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis import exceptions as redis_exceptions

from clusters.live import prefix_index, telemetry
from clusters.live.scripts import (
    counters_queue,
    is_noscript,
    scripts_ensure_async,
    scripts_forget,
)
from controlplane.errors import ApiError, Invalid
from controlplane.redis_connection import redis_async
from scheduling import metrics, traffic
from scheduling.core import routing
from scheduling.snapshot import (
    SNAPSHOT_VERSION_KEY,
    Snapshot,
    link_key,
    parse_version,
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
    """One request as the API validated it (block hashes already folded to 64-bit keys)."""

    origin: str
    prompt_tokens: int
    chain: tuple[str, ...] = ()
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    request_id: str | None = None
    expected_output_tokens: int | None = None


def _redis_available() -> bool:
    return time.monotonic() >= _redis_skip_until


def _redis_failed(exc: BaseException) -> None:
    """A timeout may be this process's own load; only a refused connection means Redis is
    gone, and only then are the next calls spared the attempt. A restarted Redis has lost the
    scripts: load them again next time."""
    global _redis_skip_until
    if is_noscript(exc) or isinstance(
        exc, ConnectionError | OSError | redis_exceptions.ConnectionError
    ):
        with contextlib.suppress(RuntimeError):
            scripts_forget(redis_async())
    if isinstance(exc, ConnectionError | OSError | redis_exceptions.ConnectionError):
        _redis_skip_until = time.monotonic() + REDIS_BACKOFF_S
    log.warning("live state unavailable (%s); deciding from the snapshot", type(exc).__name__)


@dataclass
class _Read:
    version: int
    live: routing.LiveState
    matches: list[prefix_index.IndexMatch] | None


async def _read(snap: Snapshot, chains: list[tuple[str, ...]], now: float) -> _Read:
    r = redis_async()
    await scripts_ensure_async(r)
    pipe = r.pipeline(transaction=False)
    pipe.get(SNAPSHOT_VERSION_KEY)
    telemetry.control_states_queue(pipe)
    telemetry.instance_states_queue(pipe, snap.instance_names)
    telemetry.link_states_queue(pipe, snap.link_keys, now, by_sha=True)
    if chains:
        prefix_index.prefix_matches_queue(pipe, chains, snap.hybrid, by_sha=True)
    raw = await pipe.execute()
    version = parse_version(raw[0])
    control_raw = telemetry.control_states_parse(raw[1])
    at = 2
    inst: dict[str, telemetry.InstanceSample] = {}
    if snap.instance_names:
        inst = telemetry.instance_states_parse(snap.instance_names, raw[at])
        at += 1
    n_links = len(snap.link_keys) + 1 if snap.link_keys else 0
    links = telemetry.link_states_parse(snap.link_keys, raw[at : at + n_links])
    at += n_links
    matches = None
    if chains:
        matches = prefix_index.prefix_matches_parse(raw[at], len(chains), snap.block_tokens)
    newest: float | None = None
    loads: dict[str, routing.InstanceLoad] = {}
    for name, s in inst.items():
        loads[name] = routing.InstanceLoad(
            queue_depth=s.queue_depth,
            queued_prefill_tokens=s.queued_prefill_tokens,
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            updated_at=s.ts,
        )
        newest = s.ts if newest is None else max(newest, s.ts)
    link_loads: dict[tuple[str, str], routing.LinkLoad] = {}
    for pair, key in zip(snap.link_pairs, snap.link_keys, strict=True):
        ls = links.get(key)
        if ls is None:
            continue
        link_loads[pair] = routing.LinkLoad(
            egress_gbps=ls.gbps, inflight_bytes=ls.reserved_bytes, updated_at=ls.ts or None
        )
        if ls.ts:
            newest = ls.ts if newest is None else max(newest, ls.ts)
    control: dict[str, routing.ControlState] = {}
    for cluster, fields in control_raw.items():
        try:
            control[cluster] = routing.ControlState(**fields)
        except TypeError:
            continue
    live = routing.LiveState(
        now=now,
        instances=loads,
        links=link_loads,
        control=control,
        stale=newest is None,
        telemetry_at=newest,
    )
    if not live.stale:
        # Advance each PD cluster's control state to now (pure; the telemetry path persists it).
        guards = snap.policy.guards
        advanced = {
            pd: routing.control_update(
                control.get(pd) or routing.control_initial(),
                routing.control_signals(pd, snap.topology, live),
                guards,
                now,
            )
            for pd in snap.pd_clusters
        }
        live = routing.LiveState(
            now=now,
            instances=loads,
            links=link_loads,
            control=advanced,
            stale=False,
            telemetry_at=newest,
        )
    return _Read(version=version, live=live, matches=matches)


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
    for item in inputs:
        matches: tuple[routing.PrefixMatch, ...] = ()
        if found_by_chain is not None and item.chain:
            found = next(found_iter)
            matches = tuple(
                routing.PrefixMatch(
                    cluster=cluster_of[inst],
                    tokens=tokens,
                    instance=inst,
                    exact=inst not in found.degraded,
                )
                for inst, tokens in found.tokens_by_instance.items()
                if inst in cluster_of
            )
        out.append(
            routing.RouteRequest(
                origin=item.origin,
                prompt_tokens=item.prompt_tokens,
                prefix_matches=matches,
                cached_tokens=dict(item.cached_tokens),
                block_hashes=item.chain,
                request_id=item.request_id,
                expected_output_tokens=item.expected_output_tokens,
            )
        )
    return out


def _record(item: RouteInput, d: routing.RouteDecision, now: float) -> traffic.TrafficRecord:
    return traffic.TrafficRecord(
        origin=item.origin,
        ts=now,
        route=d.route,
        reason=d.reason,
        incremental_tokens=d.incremental_tokens,
        cached_tokens=d.cached_tokens,
        output_tokens=item.expected_output_tokens,
    )


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
                "block_hashes": len(item.chain),
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


async def route_decide_async(inputs: Sequence[RouteInput], *, batch: bool) -> list[dict[str, Any]]:
    """Decide ``inputs`` (one API call) and return the response dicts, in order."""
    started = time.perf_counter()
    now = time.time()
    snap = await snapshot_get_async()
    chains = [item.chain for item in inputs if item.chain]
    read: _Read | None = None
    if _redis_available():
        try:
            # asyncio.timeout, not wait_for: no extra task per call on the hot path.
            async with asyncio.timeout(REDIS_DEADLINE_S):
                read = await _read(snap, chains, now)
            if snapshot_needs_refresh(snap, read.version):
                fresh = await snapshot_refresh_async(read.version)
                if fresh is not snap:
                    snap = fresh
                    # Rare (inventory or policy changed): read again against the new fleet.
                    async with asyncio.timeout(REDIS_DEADLINE_S):
                        read = await _read(snap, chains, now)
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041 - both on 3.11
            if isinstance(exc, ApiError):
                raise
            _redis_failed(exc)
            read = None
    if read is None and snapshot_needs_refresh(snap, None):
        # Redis away: the snapshot still follows the database by age (the rebuild itself
        # backs off while the database is away too).
        snap = await snapshot_refresh_async(None)
    live = read.live if read is not None else routing.LiveState(now=now, stale=True)
    requests = _requests(snap, inputs, read.matches if read is not None else None)
    try:
        decisions = routing.route_decide_many(requests, snap.policy, snap.topology, live)
    except routing.RouteError as exc:
        if read is not None:
            await metrics.route_error_count_async(exc.code, REDIS_DEADLINE_S)
        raise _error(exc, batch) from None

    # Offloads (and cache transfers) need their link bytes reserved atomically; precompute
    # the local fallback of each, so the write pipeline can record whichever branch happens.
    originals = [
        d if d.reservation is not None and d.reservation.bytes > 0 else None for d in decisions
    ]
    fallbacks: dict[int, routing.RouteDecision] = {}
    if any(o is not None for o in originals):
        reason = (
            routing.Reason.LINK_CONGESTED if read is not None else routing.Reason.TELEMETRY_STALE
        )
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
    elapsed = time.perf_counter() - started
    memo: dict[int, dict[str, Any]] = {}

    reservation_ids = {i: uuid.uuid4().hex for i in fallbacks}
    if read is not None:
        try:
            async with asyncio.timeout(REDIS_DEADLINE_S):
                admitted = await _write(
                    snap, inputs, decisions, fallbacks, reservation_ids, now, elapsed, batch, memo
                )
        except (Exception, asyncio.TimeoutError) as exc:  # noqa: UP041
            _redis_failed(exc)
            # Reservations unknown: keep the budget safe, send every offload local.
            admitted = {i: False for i in fallbacks}
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
    else:
        # Without Redis nothing can be reserved, and the link budget is never to be exceeded:
        # what the static rule would offload stays local, still saying telemetry_stale.
        for i, fb in fallbacks.items():
            decisions[i] = fb
    return _snapshot_marked(snap, [_decision_dict(d, memo) for d in decisions])


def _snapshot_marked(snap: Snapshot, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every answer says how old its topology and policy are; one decided from a snapshot
    past its bound (the database unreachable for longer than ``SNAPSHOT_MAX_AGE_S``) is
    ``stale`` like one decided without live state."""
    age = round(snapshot_age_s(snap), 3)
    old = snapshot_stale(snap)
    for answer in answers:
        answer["snapshot_age_s"] = age
        if old:
            answer["stale"] = True
    return answers


async def _write(
    snap: Snapshot,
    inputs: Sequence[RouteInput],
    decisions: Sequence[routing.RouteDecision],
    fallbacks: Mapping[int, routing.RouteDecision],
    reservation_ids: Mapping[int, str],
    now: float,
    elapsed: float,
    batch: bool,
    memo: dict[int, dict[str, Any]],
) -> dict[int, bool]:
    r = redis_async()
    await scripts_ensure_async(r)
    pipe = r.pipeline(transaction=False)
    plain = traffic.TrafficAggregate()
    counts: dict[tuple[str, str], int] = {}
    recent_left = RECENT_PER_BATCH if batch else len(decisions)
    order: list[int] = []
    reservations: list[telemetry.Reservation] = []
    entries: list[str] = []
    for i, d in enumerate(decisions):
        item = inputs[i]
        keep_recent = recent_left > 0
        recent_left -= 1
        fb = fallbacks.get(i)
        if fb is None:
            plain.add(_record(item, d, now))
            counts[(d.route, d.reason)] = counts.get((d.route, d.reason), 0) + 1
            if keep_recent:
                entries.append(_recent_entry(item, d, now, memo))
            continue
        rv = d.reservation
        assert rv is not None
        outcome = traffic.reservation_outcome(
            _record(item, d, now),
            _record(item, fb, now),
            _recent_entry(item, d, now, memo) if keep_recent else "",
            _recent_entry(item, fb, now, memo) if keep_recent else "",
            extra_admitted=[metrics.decision_increment(d.route, d.reason)],
            extra_refused=[metrics.decision_increment(fb.route, fb.reason)],
        )
        order.append(i)
        reservations.append(
            telemetry.Reservation(
                link=link_key(rv.source, rv.target),
                reservation_id=reservation_ids[i],
                nbytes=rv.bytes,
                end_ts=_transfer_end(snap, d, now),
                budget_bytes=snap.topology.link_by_pair[(rv.source, rv.target)].budget_bytes,
                outcome=outcome,
            )
        )
    # Every counter and the plain decisions' recent entries in one scripted command, queued
    # before the reservations so that the recent list keeps the decisions' order as before.
    ints, floats = metrics.latency_increments("batch" if batch else "single", elapsed)
    counters_queue(
        pipe,
        plain.increments() + metrics.decision_increments(counts) + ints,
        floats,
        list_key=traffic.RECENT_KEY,
        list_cap=traffic.RECENT_CAP,
        entries=entries,
    )
    at = len(pipe)
    if reservations:
        telemetry.link_reserve_many_queue(pipe, reservations, now, by_sha=True)
    raw = await pipe.execute()
    if not reservations:
        return {}
    flat = raw[at]
    return {i: bool(int(flat[2 * k])) for k, i in enumerate(order)}


async def live_state_read_async() -> routing.LiveState:
    """The live state a router deciding in process needs (``GET /api/v1/route/live``): the
    same read as a route call's, without prefix matches, control state advanced to now."""
    snap = await snapshot_get_async()
    now = time.time()
    async with asyncio.timeout(REDIS_DEADLINE_S):
        read = await _read(snap, [], now)
    if snapshot_needs_refresh(snap, read.version):
        fresh = await snapshot_refresh_async(read.version)
        if fresh is not snap:
            async with asyncio.timeout(REDIS_DEADLINE_S):
                read = await _read(fresh, [], now)
    return read.live


async def control_tick_async() -> dict[str, routing.ControlState]:
    """Advance and store every PD cluster's control state from the live state now (called
    after telemetry arrives, so congestion raises thresholds without waiting for a route)."""
    snap = await snapshot_get_async()
    now = time.time()
    read = await asyncio.wait_for(_read(snap, [], now), REDIS_DEADLINE_S * 5)
    if read.live.stale:
        return {}
    states = dict(read.live.control)
    await telemetry.control_states_write_async(
        {k: dataclasses.asdict(v) for k, v in states.items()}
    )
    return states
