"""Live-state API: agents post telemetry and KV events (``agent`` scope); the prefix index's
health per instance is readable (``read`` scope), so a sequence gap is visible.

KV events come two ways into one pipeline (:func:`scheduling.ingest.kv_events_ingest_async`):
``/kv-events`` takes batches parsed from JSON, ``/kv-events/msgpack`` takes vLLM's own msgpack
payloads as the fleet agent forwards them (no re-encoding, ~10x smaller, the fleet-scale
path)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from django.http import HttpRequest
from ninja import Field, Router, Schema
from pydantic import BaseModel, ConfigDict, StringConstraints

from clusters.live import prefix_index
from clusters.live.telemetry import InstanceSample
from controlplane.auth import binding_check, binding_of, require_scope
from controlplane.errors import ApiError, ErrorOut, Invalid, NotFound
from scheduling import ingest
from scheduling.core import kv_events as kv_wire
from scheduling.core.link import link_key
from scheduling.core.service_levels import TTFT_BUCKETS_S, ServiceCounters
from scheduling.snapshot import (
    snapshot_current_async,
    snapshot_refresh,
    snapshot_refresh_async,
)

router = Router(tags=["live"])

AGENT = require_scope("agent", asynchronous=True)
READ = require_scope("read")
AGENT_SYNC = require_scope("agent")

Name = Annotated[str, StringConstraints(min_length=1, max_length=150)]
Count = Annotated[int, Field(ge=0, le=10**9)]
UnixTime = Annotated[float, Field(ge=0, allow_inf_nan=False, description="unix seconds")]


# Samples are plain pydantic models, not ninja Schemas: a Schema validates through Django's
# attribute getter (for ORM objects), which made parsing the largest post 3x slower.
class InstanceSampleIn(BaseModel):
    instance: Name
    ts: UnixTime
    queue_depth: Count = 0
    running: Count = 0
    waiting: Count = 0
    kv_usage: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    queued_prefill_tokens: Annotated[int, Field(ge=0, le=10**12)] = 0


class LinkSampleIn(BaseModel):
    source: Name = Field(description="prfaas cluster")
    target: Name = Field(description="pd cluster")
    ts: UnixTime
    bytes_sent: Annotated[int, Field(ge=0, le=10**16)]
    interval_s: float = Field(gt=0, le=3600, allow_inf_nan=False)
    retransmits: Count = 0


class ClusterServiceIn(Schema):
    """A PD cluster's cumulative service counters (as an engine's Prometheus histograms)."""

    # Counters are counts: a boolean or a fraction is a broken reporter, not a number to coerce.
    model_config = ConfigDict(strict=True)

    cluster: Name
    ts: UnixTime
    arrivals: Annotated[int, Field(ge=0, le=10**15)]
    first_tokens: Annotated[int, Field(ge=0, le=10**15)]
    ttft_buckets: list[Annotated[int, Field(ge=0, le=10**15)]] = Field(
        min_length=len(TTFT_BUCKETS_S) + 1,
        max_length=len(TTFT_BUCKETS_S) + 1,
        description="first tokens per TTFT bucket (upper bounds TTFT_BUCKETS_S, then above)",
    )
    ttft_sum_s: float = Field(0.0, ge=0, le=1e15, allow_inf_nan=False, strict=True)


class TelemetryIn(Schema):
    idempotency_key: Annotated[str, StringConstraints(min_length=1, max_length=200)] = Field(
        description="a batch sent again with the same key is acknowledged but stored once"
    )
    instances: list[InstanceSampleIn] = Field(default_factory=list, max_length=10_000)
    links: list[LinkSampleIn] = Field(default_factory=list, max_length=1_000)
    clusters: list[ClusterServiceIn] = Field(default_factory=list, max_length=1_000)


class TelemetryOut(Schema):
    stored: bool = Field(description="false: this idempotency key was seen before")
    instances: int
    links: int


class KvBatchIn(Schema):
    seq: int | None = Field(
        None, ge=0, le=kv_wire.MAX_SEQ, strict=True, description="publisher sequence"
    )
    batch: list[Any] | dict[str, Any] = Field(
        description="vLLM KVEventBatch, array [ts, events] or map {ts, events}"
    )


class KvEventsIn(Schema):
    instance: Name
    batches: list[KvBatchIn] = Field(min_length=1, max_length=1_000)


class KvEventsOut(Schema):
    instance: str
    batches: int
    applied: int
    duplicates: int
    restarts: int
    missed_batches: int
    evicted: int
    state: str = Field(description="exact | degraded (a sequence gap was seen)")


class IndexStateOut(Schema):
    instance: str
    state: str
    last_seq: int | None
    gaps: int
    missed_batches: int
    last_gap_at: float | None
    blocks: int
    checkpoints: int
    updated_at: float | None = Field(
        None, description="unix time a batch was last applied for the instance"
    )


ERRORS: dict[int, Any] = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 413: ErrorOut, 422: ErrorOut}
KV_ERRORS: dict[int, Any] = {**ERRORS, 503: ErrorOut}


async def _binding_checked(
    request: HttpRequest, instances: list[str], links: list[str] | None = None
) -> None:
    """:func:`binding_check`; a token bound to clusters covers their instances, looked up in
    the snapshot (rebuilt once for a name it does not know: a just-registered instance)."""
    principal = getattr(request, "auth", None)
    binding = binding_of(principal)
    cluster_of = None
    if (
        binding is not None
        and binding.clusters
        and any(n not in binding.instances for n in instances)
    ):
        snap = await snapshot_current_async()
        if any(n not in snap.known_cluster_of for n in instances):
            snap = await snapshot_refresh_async()
        cluster_of = snap.known_cluster_of
    binding_check(principal, instances=instances, links=links or (), cluster_of=cluster_of)


@router.post("/telemetry", auth=AGENT, response={200: TelemetryOut, **ERRORS})
async def telemetry_post(request: HttpRequest, payload: TelemetryIn) -> ingest.TelemetryResult:
    """A batch of instance samples (load) and link samples (bytes sent in an interval).

    A bound agent token gets 403 for a sample of any instance or link outside its binding."""
    await _binding_checked(
        request,
        [s.instance for s in payload.instances],
        [link_key(s.source, s.target) for s in payload.links],
    )
    return await ingest.telemetry_ingest_async(
        payload.idempotency_key,
        [InstanceSample(**s.model_dump()) for s in payload.instances],
        [
            ingest.link_sample(s.source, s.target, s.ts, s.bytes_sent, s.interval_s, s.retransmits)
            for s in payload.links
        ],
        [
            ServiceCounters(
                c.cluster, c.ts, c.arrivals, c.first_tokens, tuple(c.ttft_buckets), c.ttft_sum_s
            )
            for c in payload.clusters
        ],
    )


@router.post("/kv-events", auth=AGENT, response={200: KvEventsOut, **KV_ERRORS})
async def kv_events_post(request: HttpRequest, payload: KvEventsIn) -> ingest.KvIngestResult:
    """One instance's vLLM KV-event batches (BlockStored, BlockRemoved, AllBlocksCleared)."""
    await _binding_checked(request, [payload.instance])
    return await ingest.kv_events_ingest_async(
        payload.instance, [(b.seq, b.batch) for b in payload.batches]
    )


class _KvFramesIn(msgspec.Struct, forbid_unknown_fields=True):
    instance: str
    batches: list[tuple[int | None, bytes]]


_FRAMES_DECODER = msgspec.msgpack.Decoder(_KvFramesIn)
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
MAX_FRAME_BATCHES = 10_000

_FRAMES_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/msgpack": {
                "schema": {
                    "type": "object",
                    "required": ["instance", "batches"],
                    "properties": {
                        "instance": {"type": "string", "maxLength": 150},
                        "batches": {
                            "type": "array",
                            "maxItems": MAX_FRAME_BATCHES,
                            "description": "[seq | null, payload] pairs: the publisher's "
                            "sequence number and vLLM's msgpack KVEventBatch payload (bin)",
                            "items": {"type": "array"},
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/kv-events/msgpack",
    auth=AGENT,
    response={200: KvEventsOut, 415: ErrorOut, **KV_ERRORS},
    openapi_extra=_FRAMES_BODY,
)
async def kv_events_msgpack_post(request: HttpRequest) -> ingest.KvIngestResult:
    """One instance's KV-event batches as the engine published them (msgpack payloads)."""
    content_type = (request.content_type or "").lower()
    if content_type not in MSGPACK_TYPES:
        raise ApiError(
            f"content type {content_type or 'none'!r}: send application/msgpack",
            code="unsupported_media_type",
            status=415,
        )
    try:
        body = _FRAMES_DECODER.decode(request.body)
    except msgspec.DecodeError as exc:
        raise Invalid(f"body: {exc}", code="invalid_kv_event") from None
    if not 1 <= len(body.instance) <= 150:
        raise Invalid("instance: 1 to 150 characters", code="invalid")
    if not 1 <= len(body.batches) <= MAX_FRAME_BATCHES:
        raise Invalid(f"batches: 1 to {MAX_FRAME_BATCHES} batches", code="invalid")
    await _binding_checked(request, [body.instance])
    for i, (seq, _) in enumerate(body.batches):
        if seq is not None and not 0 <= seq <= kv_wire.MAX_SEQ:
            raise Invalid(f"batches[{i}].seq: must be in [0, 2^53)", code="invalid")
    return await ingest.kv_events_ingest_async(body.instance, body.batches)


@router.get(
    "/kv-events/state",
    auth=AGENT_SYNC,
    response={200: IndexStateOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ErrorOut},
)
def kv_events_state_get(request: HttpRequest, instance: Name) -> prefix_index.InstanceIndexState:
    """Where the index stands for one instance (``last_seq``): an agent that (re)starts
    replays from the engine what came after it, instead of leaving a gap."""
    snap = snapshot_refresh()
    binding_check(
        getattr(request, "auth", None), instances=[instance], cluster_of=snap.known_cluster_of
    )
    if instance not in snap.known_instances:
        raise NotFound(f"unknown instance {instance!r}", code="unknown_instance")
    return prefix_index.prefix_index_states([instance])[0]


@router.get(
    "/prefix-index",
    auth=READ,
    response={200: list[IndexStateOut], 401: ErrorOut, 403: ErrorOut},
)
def prefix_index_get(request: HttpRequest) -> list[prefix_index.InstanceIndexState]:
    """Per instance: ``exact`` or ``degraded`` (sequence gap), gaps seen, entries held."""
    snap = snapshot_refresh()
    return prefix_index.prefix_index_states(sorted(snap.known_instances))
