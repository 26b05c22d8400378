"""Closing the loop: link reservations for routers that decide in process, and the outcomes
of what a gateway served.

A gateway (``fleet/gateway``) decides with the same pure function as ``POST /route``, in its
own process. Two things it cannot do alone:

1. **reserve link bytes atomically**: an offload's in-flight KV bytes must never exceed the
   link's budget across every router process, so an offload decided in process still takes
   its reservation here (:func:`reservation_take_async`: the route path's Lua script, one
   round trip, only for offloads and cache transfers);
2. **tell what happened**: each request's outcome (:func:`outcomes_record_async`, batched)
   releases its reservation as soon as the transfer ended (instead of at the predicted end),
   feeds the rebalancer's traffic store with what was served (for decisions the route service
   did not already count), puts the decision among the recent decisions, and accumulates
   predicted against observed TTFT per prefill cluster for ``/metrics`` and the decisions page.

Everything one call writes goes in one pipeline. Key layout (Redis):

``outcomes:ttft:{cluster}``  HASH  ``o{i}`` / ``p{i}``: outcomes whose observed / predicted TTFT
                                   fell in bucket ``i`` of ``TTFT_BUCKETS_S`` (not cumulative),
                                   ``osum``, ``psum`` (seconds), ``count``, ``abserr`` (sum of
                                   ``|observed - predicted|``)
``outcomes:counts``          HASH  ``{status}|{transfer}`` -> outcomes
``outcomes:released``        HASH  ``count``, ``bytes``: reservations released by outcomes
``outcomes:recent``          LIST  the latest outcomes (JSON, newest first), ``RECENT_CAP``
``outcomes:intake``          HASH  ``duplicate``: items sent again (applied once);
                                   ``rejected|{code}``: items refused one by one
``outcomes:seen:{key}``      STRING an idempotency key already applied (``SEEN_TTL_S``)

A batch is checked item by item (:func:`outcomes_record_async`): a malformed item, or one
naming a cluster or reason code the inventory does not know (client-supplied names must not
create keys or metric series), is refused on its own and counted; the rest are applied. Every
item's link reservation is released whatever becomes of the item, so a refused outcome never
holds link budget until the reservation expires. An item that carries an idempotency key
(the gateway: request id and attempt) is applied once, however many times it is sent (a
control plane that stalled past the sender's timeout receives the retries too).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from clusters.live import telemetry
from clusters.live.ejections import ejections_store_async
from clusters.live.scripts import counters_queue
from controlplane.errors import ApiError
from controlplane.redis_connection import redis_async, redis_sync
from controlplane.redis_scripts import pipeline_run_async
from scheduling import metrics, traffic
from scheduling.core import routing
from scheduling.core.link import link_key
from scheduling.core.routing.reasons import REASONS
from scheduling.snapshot import (
    Snapshot,
    snapshot_cached,
    snapshot_get_async,
    snapshot_refresh_async,
)

TTFT_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
COUNTS_KEY = "outcomes:counts"
RELEASED_KEY = "outcomes:released"
RECENT_KEY = "outcomes:recent"
INTAKE_KEY = "outcomes:intake"
SEEN_PREFIX = "outcomes:seen:"
# How long an applied idempotency key is remembered: far longer than any sender's retries of
# one batch (a gateway retries every outcome_interval_s; a stalled control plane answers or
# drops its connections within its own deadlines).
SEEN_TTL_S = 900
RECENT_CAP = 500
# Outcomes of one batch kept in the recent lists (plus every one that released a reservation
# or failed): a batch of 1,000 plain local requests must not cost 2,000 list pushes.
RECENT_PER_BATCH = 32
# A reservation is held at most this long without an outcome (the gateway died): it then
# expires by itself like the route path's, so a lost outcome never leaks link budget.
MAX_HOLD_S = 600.0
REDIS_DEADLINE_S = 2.0
DECIDED_BY = ("gateway", "control_plane")
TRANSFER_STATES = ("none", "finished", "failed")
STATUSES = ("ok", "failed", "cancelled")


def ttft_key(cluster: str) -> str:
    return f"outcomes:ttft:{cluster}"


class UnknownLink(ApiError):
    status = 404
    code = "unknown_link"


class UnknownInstance(ApiError):
    status = 404
    code = "unknown_instance"


# --- reservations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReservationResult:
    admitted: bool
    id: str | None
    budget_bytes: int


async def reservation_take_async(
    source: str, target: str, nbytes: int, hold_s: float
) -> ReservationResult:
    """Reserve ``nbytes`` in flight on the link ``source -> target`` for at most ``hold_s``
    seconds, atomically against every other router; refused (not an error) when the budget
    has no room. The holder releases it early with its outcome."""
    snap = await snapshot_get_async()
    spec = snap.topology.link_by_pair.get((source, target))
    if spec is None:
        raise UnknownLink(f"no routable link {source} -> {target}")
    hold = min(max(hold_s, 0.001), MAX_HOLD_S)
    rid = uuid.uuid4().hex
    now = time.time()
    async with asyncio.timeout(REDIS_DEADLINE_S):
        admitted = await telemetry.link_reserve_async(
            link_key(source, target), rid, nbytes, now + hold, spec.budget, now
        )
    return ReservationResult(admitted, rid if admitted else None, spec.budget)


# --- outcomes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request as a gateway served it. ``decision``: the decision it carried out (as
    ``decision_to_dict`` writes it, reservation id included); ``served_*``: what actually
    ran after any retry or fallback; ``observed_ttft_s``: arrival to first token (None when
    no token came)."""

    decision: routing.RouteDecision
    decided_by: str
    origin: str
    prompt_tokens: int
    served_route: str
    served_reason: str
    prefill_cluster: str
    prefill_instance: str
    decode_cluster: str
    decode_instance: str
    incremental_tokens: int
    cached_tokens: int
    output_tokens: int
    observed_ttft_s: float | None
    transfer: str
    transfer_bytes: int
    status: str
    error: str | None
    ts: float
    request_id: str | None = None
    block_hashes: int = 0
    idempotency_key: str | None = None


@dataclass(frozen=True)
class ServedGroup:
    """Plain outcomes a gateway summed before sending (no reservation, nothing failed, not
    among the few it sends whole): requests that share origin, served route and reason,
    prefill cluster, who decided, status and transfer result. ``incremental_tokens`` has one
    entry per request (the traffic store bins it); ``observed_ttft_s`` and
    ``predicted_ttft_s`` are pairs for the requests that have both."""

    origin: str
    route: str
    reason: str
    prefill_cluster: str
    decided_by: str
    status: str
    transfer: str
    ts: float
    incremental_tokens: Sequence[int]
    cached_tokens: int
    output_tokens: int
    observed_ttft_s: Sequence[float] = ()
    predicted_ttft_s: Sequence[float] = ()
    idempotency_key: str | None = None


@dataclass(frozen=True)
class Rejected:
    """One item of a batch refused on its own: ``kind`` outcome | group, its index in the
    batch's list of that kind, a code and what is wrong."""

    kind: str
    index: int
    code: str
    detail: str


@dataclass(frozen=True)
class Release:
    """A reservation to give back (``decision.reservation`` of an outcome)."""

    source: str
    target: str
    id: str


@dataclass(frozen=True)
class OutcomesBatch:
    """One ``POST /outcomes``: the items that parsed (with their index in the body), those
    refused while parsing, and the reservations of the refused ones (still released)."""

    outcomes: Sequence[tuple[int, Outcome]] = ()
    groups: Sequence[tuple[int, ServedGroup]] = ()
    rejected: Sequence[Rejected] = ()
    releases: Sequence[Release] = ()


@dataclass(frozen=True)
class OutcomesResult:
    accepted: int
    released: int
    released_bytes: int
    duplicates: int = 0
    rejected: tuple[Rejected, ...] = ()


class _Sums:
    """Counter increments of a batch summed by (key, field) before they go to Redis."""

    def __init__(self) -> None:
        self.ints: dict[tuple[str, str], int] = {}
        self.floats: dict[tuple[str, str], float] = {}

    def add(self, key: str, name: str, n: int = 1) -> None:
        self.ints[(key, name)] = self.ints.get((key, name), 0) + n

    def add_float(self, key: str, name: str, x: float) -> None:
        self.floats[(key, name)] = self.floats.get((key, name), 0.0) + x

    def ttft(self, cluster: str, observed: float, predicted: float) -> None:
        key = ttft_key(cluster)
        self.add(key, f"o{bisect.bisect_left(TTFT_BUCKETS_S, observed)}")
        self.add(key, f"p{bisect.bisect_left(TTFT_BUCKETS_S, predicted)}")
        self.add(key, "count")
        self.add_float(key, "osum", observed)
        self.add_float(key, "psum", predicted)
        self.add_float(key, "abserr", abs(observed - predicted))

    def rows(self) -> tuple[list[Any], list[Any]]:
        return (
            [(k, f, n, 0) for (k, f), n in self.ints.items()],
            [(k, f, x, 0) for (k, f), x in self.floats.items()],
        )


def predicted_ttft(outcome: Outcome) -> float | None:
    """The decision's TTFT estimate for the route that was served, when the served route is
    the decided one (a fallback's own prediction was never made)."""
    d = outcome.decision
    if outcome.served_route != d.route:
        return None
    value = d.ttft_estimate_s.prfaas if d.route == "prfaas" else d.ttft_estimate_s.local
    return value if value is not None and math.isfinite(value) else None


def _recent_outcome(outcome: Outcome, released_bytes: int | None) -> str:
    return orjson.dumps(
        {
            "ts": outcome.ts,
            "request_id": outcome.request_id,
            "origin": outcome.origin,
            "decided_by": outcome.decided_by,
            "decided_route": outcome.decision.route,
            "decided_reason": outcome.decision.reason,
            "route": outcome.served_route,
            "reason": outcome.served_reason,
            "prefill": {"cluster": outcome.prefill_cluster, "instance": outcome.prefill_instance},
            "decode": {"cluster": outcome.decode_cluster, "instance": outcome.decode_instance},
            "predicted_ttft_s": predicted_ttft(outcome),
            "observed_ttft_s": outcome.observed_ttft_s,
            "output_tokens": outcome.output_tokens,
            "transfer": outcome.transfer,
            "transfer_bytes": outcome.transfer_bytes,
            "reservation_id": outcome.decision.reservation.id
            if outcome.decision.reservation
            else None,
            "released_bytes": released_bytes,
            "status": outcome.status,
            "error": outcome.error,
        }
    ).decode()


def _recent_decision(outcome: Outcome) -> str:
    """The entry ``GET /decisions/recent`` shows, as the route service writes it."""
    return orjson.dumps(
        {
            "ts": outcome.ts,
            "inputs": {
                "origin": outcome.origin,
                "prompt_tokens": outcome.prompt_tokens,
                "block_hashes": outcome.block_hashes,
                "cached_tokens": {},
                "request_id": outcome.request_id,
                "decided_by": outcome.decided_by,
            },
            "decision": routing.decision_to_dict(outcome.decision),
        }
    ).decode()


def _names_problem(
    snap: Snapshot, origin: str, clusters: Sequence[tuple[str, str]], reason: str
) -> tuple[str, str] | None:
    """``(code, detail)`` when an item names a cluster or reason the inventory does not know:
    such names would become traffic-store keys and metric series."""
    known = snap.topology.cluster_by_name
    for where, name in (("origin", origin), *clusters):
        if name not in known:
            return "unknown_cluster", f"{where}: unknown cluster {name!r}"
    if reason not in REASONS:
        return "unknown_reason", f"reason: unknown reason code {reason!r}"
    return None


def _outcome_names(o: Outcome) -> tuple[str, list[tuple[str, str]], str]:
    return (
        o.origin,
        [("prefill.cluster", o.prefill_cluster), ("decode.cluster", o.decode_cluster)],
        o.served_reason,
    )


def _group_names(g: ServedGroup) -> tuple[str, list[tuple[str, str]], str]:
    return g.origin, [("prefill_cluster", g.prefill_cluster)], g.reason


async def _names_checked(
    batch: OutcomesBatch,
) -> tuple[list[tuple[int, Outcome]], list[tuple[int, ServedGroup]], list[Rejected]]:
    """The items whose names are known (the snapshot is refreshed once when one is not, so a
    cluster added a moment ago is accepted), and the refusals of the others."""
    snap = await snapshot_get_async()
    items: list[tuple[str, int, Outcome | ServedGroup, Any]] = [
        ("outcome", k, o, _outcome_names(o)) for k, o in batch.outcomes
    ]
    items += [("group", k, g, _group_names(g)) for k, g in batch.groups]
    if any(_names_problem(snap, *names) for *_, names in items):
        snap = await snapshot_refresh_async()
    outcomes: list[tuple[int, Outcome]] = []
    groups: list[tuple[int, ServedGroup]] = []
    rejected: list[Rejected] = []
    for kind, k, item, names in items:
        problem = _names_problem(snap, *names)
        if problem is not None:
            rejected.append(Rejected(kind, k, *problem))
        elif isinstance(item, Outcome):
            outcomes.append((k, item))
        else:
            groups.append((k, item))
    return outcomes, groups, rejected


async def _claim(r: Any, keys: Sequence[str | None]) -> list[bool]:
    """Claim each idempotency key (None: the item has none and is always applied); False for
    a key already applied."""
    wanted = [k for k in keys if k is not None]
    if not wanted:
        return [True] * len(keys)
    pipe = r.pipeline(transaction=False)
    for key in wanted:
        pipe.set(SEEN_PREFIX + key, 1, nx=True, ex=SEEN_TTL_S)
    async with asyncio.timeout(REDIS_DEADLINE_S):
        got = iter(await pipe.execute())
    return [True if k is None else bool(next(got)) for k in keys]


async def outcomes_record_async(batch: OutcomesBatch) -> OutcomesResult:
    """Record a batch of outcomes and summed groups (module docstring): every reservation
    released, known items applied once in one pipeline, the others refused one by one."""
    r = redis_async()
    checked, checked_groups, rejected = await _names_checked(batch)
    rejected = [*batch.rejected, *rejected]
    outcome_keys = [o.idempotency_key for _, o in checked]
    group_keys = [g.idempotency_key for _, g in checked_groups]
    fresh = await _claim(r, outcome_keys + group_keys)
    claimed = [k for k, new in zip(outcome_keys + group_keys, fresh, strict=True) if k and new]
    duplicates = fresh.count(False)
    outcomes = [o for (_, o), new in zip(checked, fresh, strict=False) if new]
    groups = [g for (_, g), new in zip(checked_groups, fresh[len(checked) :], strict=True) if new]
    try:
        return await _apply(r, batch, outcomes, groups, rejected, duplicates)
    except BaseException:
        # Not applied: a retry of these items must not be taken for a duplicate.
        if claimed:
            with contextlib.suppress(Exception):
                await r.delete(*(SEEN_PREFIX + k for k in claimed))
        raise


async def _apply(
    r: Any,
    batch: OutcomesBatch,
    outcomes: Sequence[Outcome],
    groups: Sequence[ServedGroup],
    rejected: Sequence[Rejected],
    duplicates: int,
) -> OutcomesResult:
    # Every reservation the batch names goes back: the applied items', the duplicates' (a
    # second release frees nothing) and the refused ones'. A release names keys only; for a
    # link that is unknown or no longer routable it frees whatever is still held there.
    releases: list[Release] = list(batch.releases)
    for _, o in batch.outcomes:
        rv = o.decision.reservation
        if rv is not None and rv.id:
            releases.append(Release(rv.source, rv.target, rv.id))
    unique = list(dict.fromkeys(releases))

    def release(pipe: Any) -> None:
        for rel in unique:
            telemetry.link_release_queue(pipe, link_key(rel.source, rel.target), rel.id)

    async with asyncio.timeout(REDIS_DEADLINE_S):
        raw = await pipeline_run_async(r, release) if unique else []
    freed_by = {rel: int(v or 0) for rel, v in zip(unique, raw, strict=True)}
    freed: dict[int, int] = {}  # index in `outcomes` -> bytes its release freed
    for k, o in enumerate(outcomes):
        rv = o.decision.reservation
        if rv is not None and rv.id:
            freed[k] = freed_by[Release(rv.source, rv.target, rv.id)]

    served = traffic.TrafficAggregate()
    sums = _Sums()
    decisions: dict[tuple[str, str], int] = {}
    decision_entries: list[str] = []
    outcome_entries: list[str] = []
    for k, o in enumerate(outcomes):
        sums.add(COUNTS_KEY, f"{o.status}|{o.transfer}")
        notable = k in freed or o.status != "ok"
        if k < RECENT_PER_BATCH or notable:
            outcome_entries.append(_recent_outcome(o, freed.get(k)))
        if o.decided_by == "gateway":
            # Decided in the gateway: the route service never counted it, so the traffic
            # store (the rebalancer's input) learns it from what was served.
            served.add(
                traffic.TrafficRecord(
                    origin=o.origin,
                    ts=o.ts,
                    route=o.served_route,
                    reason=o.served_reason,
                    incremental_tokens=o.incremental_tokens,
                    cached_tokens=o.cached_tokens,
                    output_tokens=o.output_tokens if o.status == "ok" else None,
                )
            )
            pair = (o.served_route, o.served_reason)
            decisions[pair] = decisions.get(pair, 0) + 1
            if k < RECENT_PER_BATCH or notable:
                decision_entries.append(_recent_decision(o))
        predicted = predicted_ttft(o)
        if o.status == "ok" and o.observed_ttft_s is not None and predicted is not None:
            sums.ttft(o.prefill_cluster, o.observed_ttft_s, predicted)
    for g in groups:
        n = len(g.incremental_tokens)
        sums.add(COUNTS_KEY, f"{g.status}|{g.transfer}", n)
        for observed, predicted in zip(g.observed_ttft_s, g.predicted_ttft_s, strict=True):
            sums.ttft(g.prefill_cluster, observed, predicted)
        if g.decided_by != "gateway" or not n:
            continue
        decisions[(g.route, g.reason)] = decisions.get((g.route, g.reason), 0) + n
        per = g.cached_tokens // n
        for i, tokens in enumerate(g.incremental_tokens):
            served.add(
                traffic.TrafficRecord(
                    origin=g.origin,
                    ts=g.ts,
                    route=g.route,
                    reason=g.reason,
                    incremental_tokens=tokens,
                    cached_tokens=per + (g.cached_tokens % n if i == 0 else 0),
                    # The group's output total goes on its first record: the store sums them.
                    output_tokens=(g.output_tokens if i == 0 else 0) if g.status == "ok" else None,
                )
            )
    released_bytes = sum(freed_by.values())
    released = sum(1 for v in freed_by.values() if v > 0)
    if released:
        sums.add(RELEASED_KEY, "count", released)
        sums.add(RELEASED_KEY, "bytes", released_bytes)
    if duplicates:
        sums.add(INTAKE_KEY, "duplicate", duplicates)
    for item in rejected:
        sums.add(INTAKE_KEY, f"rejected|{item.code}")
    ints, floats = sums.rows()

    def counters(pipe: Any) -> None:
        counters_queue(
            pipe,
            served.increments() + metrics.decision_increments(decisions) + ints,
            floats,
            list_key=traffic.RECENT_KEY,
            list_cap=traffic.RECENT_CAP,
            entries=decision_entries,
        )
        counters_queue(pipe, [], list_key=RECENT_KEY, list_cap=RECENT_CAP, entries=outcome_entries)

    async with asyncio.timeout(REDIS_DEADLINE_S):
        await pipeline_run_async(r, counters)
    return OutcomesResult(
        len(outcomes) + sum(len(g.incremental_tokens) for g in groups),
        released,
        released_bytes,
        duplicates,
        tuple(sorted(rejected, key=lambda x: (x.kind, x.index))),
    )


# --- ejections --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ejection:
    """A router's report: ``instance`` failed or hung there; avoid it for ``for_s``."""

    instance: str
    for_s: float
    reason: str


async def instance_ejections_record_async(ejections: Sequence[Ejection]) -> int:
    """Record ejections of known instances (every decision then takes them as down until
    their end; :mod:`clusters.live.ejections`); returns how many. An unknown instance is a
    404 (names become Redis fields)."""
    snap = await snapshot_get_async()
    if any(e.instance not in snap.known_instances for e in ejections):
        snap = await snapshot_refresh_async()
    for i, e in enumerate(ejections):
        if e.instance not in snap.known_instances:
            raise UnknownInstance(f"ejections[{i}].instance: unknown instance {e.instance!r}")
    now = time.time()
    until: dict[str, float] = {}
    for e in ejections:
        until[e.instance] = max(until.get(e.instance, 0.0), now + min(e.for_s, MAX_HOLD_S))
    async with asyncio.timeout(REDIS_DEADLINE_S):
        await ejections_store_async(until)
    return len(until)


async def outcomes_recent_async(limit: int = 50) -> list[dict[str, Any]]:
    raw = await redis_async().lrange(RECENT_KEY, 0, max(0, limit - 1))
    return [orjson.loads(x) for x in raw]


# --- reads: predicted vs observed TTFT ---------------------------------------------------------


@dataclass(frozen=True)
class TtftComparison:
    """Predicted against observed TTFT of one prefill cluster, over every outcome reported."""

    cluster: str
    count: int
    observed_mean_s: float
    predicted_mean_s: float
    mean_abs_error_s: float

    @property
    def ratio(self) -> float | None:
        """Observed over predicted (1.0: the model is right; > 1: the fleet is slower)."""
        return self.observed_mean_s / self.predicted_mean_s if self.predicted_mean_s else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ttft_hashes(client: Any, clusters: Sequence[str]) -> Iterator[tuple[str, dict[str, float]]]:
    pipe = client.pipeline(transaction=False)
    for c in clusters:
        pipe.hgetall(ttft_key(c))
    for c, raw in zip(clusters, pipe.execute(), strict=True):
        if raw:
            yield c, {_text(k): float(v) for k, v in raw.items()}


def ttft_comparisons_read(clusters: Sequence[str], client: Any = None) -> list[TtftComparison]:
    """Per prefill cluster with outcomes: counts and means (sync; for pages)."""
    out = []
    for cluster, h in _ttft_hashes(client or redis_sync(), clusters):
        n = h.get("count", 0.0)
        if n <= 0:
            continue
        out.append(
            TtftComparison(
                cluster=cluster,
                count=int(n),
                observed_mean_s=h.get("osum", 0.0) / n,
                predicted_mean_s=h.get("psum", 0.0) / n,
                mean_abs_error_s=h.get("abserr", 0.0) / n,
            )
        )
    return out


class OutcomeCollector:
    """``/metrics``: TTFT observed and predicted per prefill cluster (histograms), outcomes
    by status and transfer, reservations released by outcomes."""

    def __init__(self, clusters: Callable[[], Sequence[str]]) -> None:
        self._clusters = clusters

    def collect(self) -> Iterator[Metric]:
        r = redis_sync()
        hists = {
            "o": HistogramMetricFamily(
                "prfaas_ttft_observed_seconds",
                "TTFT the gateway observed (arrival to first token), per prefill cluster",
                labels=["cluster"],
            ),
            "p": HistogramMetricFamily(
                "prfaas_ttft_predicted_seconds",
                "TTFT the decision predicted for the same requests, per prefill cluster",
                labels=["cluster"],
            ),
        }
        abserr = CounterMetricFamily(
            "prfaas_ttft_abs_error_seconds",
            "Sum of |observed - predicted| TTFT, per prefill cluster",
            labels=["cluster"],
        )
        for cluster, h in _ttft_hashes(r, self._clusters()):
            for prefix, family in hists.items():
                cumulative = 0.0
                buckets: list[tuple[str, float]] = []
                for i, bound in enumerate(TTFT_BUCKETS_S):
                    cumulative += h.get(f"{prefix}{i}", 0.0)
                    buckets.append((repr(bound), cumulative))
                cumulative += h.get(f"{prefix}{len(TTFT_BUCKETS_S)}", 0.0)
                buckets.append(("+Inf", cumulative))
                family.add_metric([cluster], buckets, sum_value=h.get(f"{prefix}sum", 0.0))
            abserr.add_metric([cluster], h.get("abserr", 0.0))
        yield from hists.values()
        yield abserr
        counts = CounterMetricFamily(
            "prfaas_outcomes",
            "Requests served by gateways, by status and KV transfer result",
            labels=["status", "transfer"],
        )
        for field, value in sorted(r.hgetall(COUNTS_KEY).items()):
            status, _, transfer = _text(field).partition("|")
            counts.add_metric([status, transfer], float(value))
        yield counts
        intake = {_text(k): float(v) for k, v in r.hgetall(INTAKE_KEY).items()}
        yield CounterMetricFamily(
            "prfaas_outcomes_duplicate",
            "Outcomes and groups sent again with an idempotency key already applied",
            value=intake.get("duplicate", 0.0),
        )
        rejected = CounterMetricFamily(
            "prfaas_outcomes_rejected",
            "Outcomes and groups refused one by one, by code (their reservations released)",
            labels=["code"],
        )
        for name, n in sorted(intake.items()):
            if name.startswith("rejected|"):
                rejected.add_metric([name.removeprefix("rejected|")], n)
        yield rejected
        released: Mapping[Any, Any] = r.hgetall(RELEASED_KEY)
        rel = {_text(k): float(v) for k, v in released.items()}
        yield CounterMetricFamily(
            "prfaas_reservations_released",
            "Link reservations released by a gateway's outcome (transfer ended)",
            value=rel.get("count", 0.0),
        )
        yield CounterMetricFamily(
            "prfaas_reservations_released_bytes",
            "KV bytes of the link reservations released by outcomes",
            value=rel.get("bytes", 0.0),
        )


def _snapshot_clusters() -> list[str]:
    snap = snapshot_cached()
    return [c.name for c in snap.topology.clusters] if snap is not None else []


metrics.collector_register(lambda: OutcomeCollector(_snapshot_clusters))
