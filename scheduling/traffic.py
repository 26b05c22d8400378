"""Traffic store: what requests arrived per origin PD cluster and minute, for the rebalancer.

The rebalancer re-solves the threshold and the P/D split from the *incremental-length
distribution after prefix matching* (``docs/paper.md`` section 4.2), so every
decision adds its incremental length to a log-spaced histogram here. Reads return plain data
(counts and a histogram) the pure planner can turn into an empirical distribution.

Key layout:

``traffic:{cluster}:{minute}``   HASH  per origin cluster and unix minute:
                                       ``arrivals``, ``offloads`` (route prfaas),
                                       ``cache_hit_tokens``, ``incremental_tokens``,
                                       ``output_tokens`` and ``output_known`` (requests that
                                       told their output length), ``h:{bin}`` (histogram of
                                       incremental lengths, bins ``BIN_EDGES``),
                                       ``r:{reason}`` (decisions per reason code),
                                       ``o:{link}`` (offloads admitted over a link, keyed
                                       ``source->target``), ``g:{link}:{cause}`` (offloads
                                       its guard kept local: ``budget`` or ``saturation``).
                                       Expires after ``RETENTION_S``.
``traffic:recent``               LIST  the latest decisions with their inputs (JSON, newest
                                       first), capped at ``RECENT_CAP``: "why was this
                                       offloaded?".

Writes are queued on the caller's pipeline (the route endpoint's one write round trip); a
decision that depends on a link reservation is counted once the reservation's answer is known,
as the branch it took. The braces of ``traffic:{cluster}`` are literal: the cluster is the
hash tag of its windows (:func:`clusters.live.keys.traffic_key`).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings

from clusters.live.keys import traffic_key
from controlplane.redis_connection import redis_async, redis_sync

RETENTION_S = 3 * 24 * 3600
RECENT_CAP = 500
RECENT_KEY = "traffic:recent"

# Log-spaced: 4 bins per doubling from 64 tokens to 2^21; bin 0 is [0, 64), the last is open.
BIN_EDGES: tuple[int, ...] = (0, *(round(2 ** (k / 4)) for k in range(24, 85)))


def length_bin(tokens: int) -> int:
    """Index of the histogram bin holding ``tokens``: ``BIN_EDGES[i] <= tokens < [i + 1]``."""
    return max(0, bisect.bisect_right(BIN_EDGES, tokens) - 1)


def fleet_rate(count: float, wall_s: float) -> float:
    """``count`` events over ``wall_s`` seconds of the wall clock, per second of the fleet's
    clock (``FLEET_CLOCK_SPEED``: an emulated fleet may run faster)."""
    return count / wall_s / float(settings.FLEET_CLOCK_SPEED) if wall_s > 0 else 0.0


@dataclass(frozen=True)
class TrafficRecord:
    """One decision as the traffic store counts it."""

    origin: str
    ts: float
    route: str
    reason: str
    incremental_tokens: int
    cached_tokens: int
    output_tokens: int | None = None
    # The link of an offload (``source->target``), and ``source->target:cause`` when the link's
    # guard kept one local.
    link: str = ""
    refusal: str = ""

    def increments(self) -> list[tuple[str, int]]:
        """The counters this decision adds (those that add nothing left out)."""
        fields: dict[str, int] = {}
        decision_fields_add(
            fields,
            self.route,
            self.reason,
            self.incremental_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.link,
            self.refusal,
        )
        return list(fields.items())

    @property
    def minute(self) -> int:
        return int(self.ts // 60)


def decision_fields_add(
    fields: dict[str, int],
    route: str,
    reason: str,
    incremental_tokens: int,
    cached_tokens: int,
    output_tokens: int | None,
    link: str = "",
    refusal: str = "",
) -> None:
    """Add one decision's counters to a traffic hash's ``fields`` (what every writer of the
    traffic store counts; an increment of 0 is left out, so no field appears that adds
    nothing). ``link``: the link an offload crosses; ``refusal``: ``link:cause`` when the
    link's guard kept an offload local."""
    get = fields.get
    fields["arrivals"] = get("arrivals", 0) + 1
    name = f"h:{length_bin(incremental_tokens)}"
    fields[name] = get(name, 0) + 1
    name = f"r:{reason}"
    fields[name] = get(name, 0) + 1
    if cached_tokens:
        fields["cache_hit_tokens"] = get("cache_hit_tokens", 0) + cached_tokens
    if incremental_tokens:
        fields["incremental_tokens"] = get("incremental_tokens", 0) + incremental_tokens
    if route == "prfaas":
        fields["offloads"] = get("offloads", 0) + 1
        if link:
            name = f"o:{link}"
            fields[name] = get(name, 0) + 1
    if refusal:
        name = f"g:{refusal}"
        fields[name] = get(name, 0) + 1
    if output_tokens is not None:
        if output_tokens:
            fields["output_tokens"] = get("output_tokens", 0) + output_tokens
        fields["output_known"] = get("output_known", 0) + 1


def traffic_record_queue(pipe: Any, record: TrafficRecord, recent_entry: str | None) -> None:
    """Queue the counters of one decision (and its "recent decisions" entry, if given)."""
    agg = TrafficAggregate()
    agg.add(record)
    agg.queue(pipe)
    if recent_entry:
        recent_queue(pipe, recent_entry)


def recent_queue(pipe: Any, entry: str) -> None:
    """Queue one "recent decisions" entry (the list stays capped)."""
    pipe.lpush(RECENT_KEY, entry)
    pipe.ltrim(RECENT_KEY, 0, RECENT_CAP - 1)


class TrafficAggregate:
    """Counters of many decisions summed in process, queued as one HINCRBY per field."""

    def __init__(self) -> None:
        self.fields: dict[str, dict[str, int]] = {}

    def add(self, record: TrafficRecord) -> None:
        self.count(
            record.origin,
            record.ts,
            record.route,
            record.reason,
            record.incremental_tokens,
            record.cached_tokens,
            record.output_tokens,
            record.link,
            record.refusal,
        )

    def count(
        self,
        origin: str,
        ts: float,
        route: str,
        reason: str,
        incremental_tokens: int,
        cached_tokens: int,
        output_tokens: int | None = None,
        link: str = "",
        refusal: str = "",
    ) -> None:
        """:meth:`add` without building the record (the route path counts every decision of a
        batch this way: a record object per decision was a cost of its own)."""
        key = traffic_key(origin, int(ts // 60))
        fields = self.fields.get(key)
        if fields is None:
            fields = self.fields[key] = {}
        decision_fields_add(
            fields,
            route,
            reason,
            incremental_tokens,
            cached_tokens,
            output_tokens,
            link,
            refusal,
        )

    def queue(self, pipe: Any) -> None:
        for key, fields in self.fields.items():
            for name, incr in fields.items():
                pipe.hincrby(key, name, incr)
            pipe.expire(key, RETENTION_S)

    def increments(self) -> list[tuple[str, str, int, int]]:
        """The same counters as ``(key, field, incr, ttl_s)`` rows (for one scripted write)."""
        return [
            (key, name, incr, RETENTION_S)
            for key, fields in self.fields.items()
            for name, incr in fields.items()
        ]


@dataclass(frozen=True)
class TrafficWindow:
    """Counts for one origin cluster over ``[start, end)`` (unix seconds, whole minutes)."""

    cluster: str
    start: float
    end: float
    minutes: int
    arrivals: int
    offloads: int
    cache_hit_tokens: int
    incremental_tokens: int
    output_tokens: int
    output_known: int
    bin_edges: tuple[int, ...]
    histogram: tuple[int, ...]
    reasons: Mapping[str, int] = field(default_factory=dict)
    # link (source->target) -> offloads admitted over it
    link_offloads: Mapping[str, int] = field(default_factory=dict)
    # link (source->target) -> cause -> offloads its guard kept local
    link_refusals: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def arrival_rate(self) -> float:
        """Requests per second of the fleet's clock over the window."""
        return fleet_rate(self.arrivals, self.end - self.start)

    @property
    def offload_fraction(self) -> float:
        return self.offloads / self.arrivals if self.arrivals else 0.0


def traffic_window_read(
    cluster: str, start: float, end: float, client: redis.Redis | None = None
) -> TrafficWindow:
    """Sum the minutes of ``cluster`` from ``start`` (inclusive) to ``end`` (exclusive)."""
    if end < start:
        raise ValueError("end must not be before start")
    r = client or redis_sync()
    first, last = int(start // 60), -(-math.ceil(end) // 60) - 1
    minutes = list(range(first, last + 1)) if end > start else []
    pipe = r.pipeline(transaction=False)
    for m in minutes:
        pipe.hgetall(traffic_key(cluster, m))
    totals: dict[str, int] = {}
    hist = [0] * len(BIN_EDGES)
    reasons: dict[str, int] = {}
    link_offloads: dict[str, int] = {}
    link_refusals: dict[str, dict[str, int]] = {}
    for h in pipe.execute() if minutes else []:
        for raw_k, raw_v in h.items():
            k, v = raw_k.decode(), int(raw_v)
            if k.startswith("h:"):
                idx = int(k[2:])
                if 0 <= idx < len(hist):
                    hist[idx] += v
            elif k.startswith("r:"):
                reasons[k[2:]] = reasons.get(k[2:], 0) + v
            elif k.startswith("o:"):
                link_offloads[k[2:]] = link_offloads.get(k[2:], 0) + v
            elif k.startswith("g:"):
                link, _, cause = k[2:].rpartition(":")
                causes = link_refusals.setdefault(link, {})
                causes[cause] = causes.get(cause, 0) + v
            else:
                totals[k] = totals.get(k, 0) + v
    return TrafficWindow(
        cluster=cluster,
        start=float(first * 60) if minutes else start,
        end=float((last + 1) * 60) if minutes else end,
        minutes=len(minutes),
        arrivals=totals.get("arrivals", 0),
        offloads=totals.get("offloads", 0),
        cache_hit_tokens=totals.get("cache_hit_tokens", 0),
        incremental_tokens=totals.get("incremental_tokens", 0),
        output_tokens=totals.get("output_tokens", 0),
        output_known=totals.get("output_known", 0),
        bin_edges=BIN_EDGES,
        histogram=tuple(hist),
        reasons=reasons,
        link_offloads=link_offloads,
        link_refusals=link_refusals,
    )


def recent_decisions_read(
    limit: int = 50, client: redis.Redis | None = None
) -> list[dict[str, Any]]:
    """The latest decisions with their inputs, newest first."""
    r = client or redis_sync()
    raw: Sequence[bytes] = r.lrange(RECENT_KEY, 0, max(0, limit - 1))  # type: ignore[assignment]
    return [json.loads(x) for x in raw]


async def recent_decisions_read_async(limit: int = 50) -> list[dict[str, Any]]:
    raw = await redis_async().lrange(RECENT_KEY, 0, max(0, limit - 1))
    return [json.loads(x) for x in raw]
