"""Telemetry and KV-event ingestion: check names against the snapshot, store, tick control.

No ORM query: instance and link names are checked against the in-process routing snapshot
(refreshed once when a name is unknown, so a just-added instance is accepted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from django.conf import settings

from clusters.live import kv_events, prefix_index, telemetry
from clusters.live.telemetry import InstanceSample, LinkSample
from controlplane.errors import ApiError, Invalid, NotFound
from controlplane.redis_connection import redis_async_ingest
from scheduling.core.link import link_key
from scheduling.core.service_levels import ServiceCounters
from scheduling.decisions import control_tick_async
from scheduling.overview import telemetry_frames_apublish
from scheduling.snapshot import Snapshot, snapshot_current_async, snapshot_refresh_async

log = logging.getLogger(__name__)

# Link samples per link that one telemetry post sends to the screens (5 minutes at 1 s).
FRAME_LINK_SAMPLES = 300

# Samples stamped further ahead than this are refused (clock skew larger than any agent's).
MAX_FUTURE_S = 300.0


async def _snapshot_knowing(names: Sequence[str], kind: str) -> Snapshot:
    snap = await snapshot_current_async()
    known = snap.known_instances if kind == "instance" else snap.known_links
    if all(n in known for n in names):
        return snap
    snap = await snapshot_refresh_async()
    known = snap.known_instances if kind == "instance" else snap.known_links
    for i, n in enumerate(names):
        if n not in known:
            raise NotFound(f"{kind}s[{i}]: unknown {kind} {n!r}", code=f"unknown_{kind}")
    return snap


_Sample = TypeVar("_Sample", InstanceSample, LinkSample)


def _ts_clamped(samples: Sequence[_Sample], where: str, now: float) -> list[_Sample]:
    """The samples with their times checked; stamps ahead of this clock by more than
    ``MAX_FUTURE_S`` are taken as now (a skewed agent clock must not make its samples look
    fresh for ever). Only those are copied: the largest post has ~2,600 samples, and copying
    each cost ~10 ms of a web worker's event loop."""
    out = list(samples)
    ahead = now + MAX_FUTURE_S
    for i, s in enumerate(out):
        ts = s.ts
        if not math.isfinite(ts) or ts < 0:
            raise Invalid(f"{where}[{i}].ts: must be a unix time in seconds")
        if ts > ahead:
            out[i] = dataclasses.replace(s, ts=now)
    return out


@dataclass(frozen=True)
class TelemetryResult:
    stored: bool
    instances: int
    links: int


async def telemetry_ingest_async(
    idempotency_key: str,
    instances: Sequence[InstanceSample],
    links: Sequence[LinkSample],
    clusters: Sequence[ServiceCounters] = (),
) -> TelemetryResult:
    """Store one agent batch once (a repeated key is acknowledged, not stored again);
    ``clusters``: PD clusters' service counters (latest kept, see :mod:`scheduling.alerts`)."""
    now = time.time()
    instances = _ts_clamped(instances, "instances", now)
    links = _ts_clamped(links, "links", now)
    if instances:
        await _snapshot_knowing([s.instance for s in instances], "instance")
    if links:
        await _snapshot_knowing([ls.link for ls in links], "link")
    stored = await telemetry.telemetry_batch_store_async(instances, links, idempotency_key)
    if stored and clusters:
        await telemetry.service_counters_store_async(
            {c.cluster: _service_json(dataclasses.replace(c, ts=min(c.ts, now))) for c in clusters}
        )
    if stored:
        try:
            await control_tick_async()
        except Exception as exc:  # stored already; the route path advances control too
            log.warning("control tick after telemetry failed: %s", exc)
        # Screens get the latest point of each instance and each link's recent samples (an
        # agent catching up after a gap posts its backlog, and the chart should show it), at
        # most FRAME_LINK_SAMPLES per link: a frame stays small whatever the post.
        await telemetry_frames_apublish(
            list({s.instance: s for s in instances}.values()), _recent_per_link(links)
        )
    return TelemetryResult(stored=stored, instances=len(instances), links=len(links))


def _recent_per_link(links: Sequence[LinkSample]) -> list[LinkSample]:
    by_link: dict[str, list[LinkSample]] = {}
    for sample in links:
        by_link.setdefault(sample.link, []).append(sample)
    return [
        sample
        for samples in by_link.values()
        for sample in sorted(samples, key=lambda x: x.ts)[-FRAME_LINK_SAMPLES:]
    ]


def _service_json(c: ServiceCounters) -> str:
    return json.dumps([c.ts, c.arrivals, c.first_tokens, list(c.ttft_buckets), c.ttft_sum_s])


def link_sample(
    source: str, target: str, ts: float, bytes_sent: int, interval_s: float, retransmits: int
) -> LinkSample:
    return LinkSample(link_key(source, target), ts, bytes_sent, interval_s, retransmits)


@dataclass(frozen=True)
class KvIngestResult:
    instance: str
    batches: int
    applied: int
    duplicates: int
    restarts: int
    missed_batches: int
    evicted: int
    state: str


def _batches_decode(
    batches: Sequence[tuple[int | None, Any]], block_tokens: int, model: str
) -> list[tuple[int | None, Any]]:
    decoded = []
    for i, (seq, batch) in enumerate(batches):
        try:
            events = kv_events.payload_events(batch, block_tokens, model, f"batches[{i}].batch")
        except kv_events.KvEventFormatError as exc:
            raise Invalid(str(exc), code="invalid_kv_event") from None
        except kv_events.KvBlockSizeError as exc:
            raise Invalid(str(exc), code="block_size_mismatch") from None
        decoded.append((seq, events))
    return decoded


def _redis_share() -> float:
    return float(settings.INGEST_REDIS_SHARE)


async def kv_events_ingest_async(
    instance: str, batches: Sequence[tuple[int | None, Any]]
) -> KvIngestResult:
    """Apply an instance's batches in order; sequence gaps mark its index ``degraded``.

    A batch is vLLM's msgpack payload (``bytes``, what the agent forwards) or the same batch
    parsed from JSON. Every batch is decoded and checked before any is applied: a request with
    one bad batch changes nothing.
    """
    snap = await snapshot_current_async()
    if instance not in snap.known_instances:
        snap = await snapshot_refresh_async()
        if instance not in snap.known_instances:
            raise NotFound(f"unknown instance {instance!r}", code="unknown_instance")
    # Decoding is pure CPU, linear in the body (tens of ms for the largest one): off the event
    # loop, so the route calls this worker serves meanwhile are not held behind it.
    decoded = await asyncio.to_thread(
        _batches_decode, batches, snap.block_tokens, snap.topology.model.name
    )
    applied = duplicates = restarts = missed = evicted = 0
    state = "exact"
    try:
        results = await prefix_index.kv_batches_apply_async(
            instance, decoded, client=redis_async_ingest(), redis_share=_redis_share()
        )
    except (redis.exceptions.RedisError, OSError) as exc:
        # Some slices may be applied: a retry re-sends them and their seq skips them.
        log.warning("KV events of %s not applied: %s", instance, exc)
        raise ApiError(
            f"the live store is unavailable ({type(exc).__name__}); retry later",
            code="live_store_unavailable",
            status=503,
        ) from None
    try:
        # A bounded step of removing what earlier clears left (a few ms, never a stall).
        await prefix_index.prefix_index_sweep_async(
            client=redis_async_ingest(), redis_share=_redis_share(), instance=instance
        )
    except (redis.exceptions.RedisError, OSError) as exc:  # applied already; the next post sweeps
        log.warning("prefix index sweep failed: %s", exc)
    for result in results:
        state = result.state
        evicted += result.evicted
        missed += result.gap
        if result.status == "duplicate":
            duplicates += 1
        else:
            applied += 1
            restarts += result.status == "restart"
    return KvIngestResult(
        instance, len(decoded), applied, duplicates, restarts, missed, evicted, state
    )
