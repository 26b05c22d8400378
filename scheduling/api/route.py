"""Routing API: per-request decisions, the policy snapshot routers cache, recent decisions.

``POST /route`` and ``POST /route/batch`` are the hot path: async, no ORM query, at most two
Redis round trips (:mod:`scheduling.decisions`). ``GET /policy`` serves the in-process snapshot
with an ETag. Prompts are described by token counts and block hashes only, never text.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Annotated, Any

import msgspec
import orjson
from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema
from pydantic import StringConstraints, field_validator, model_validator

from clusters.live.prefix_index import BlockHashError, block_hash_key
from controlplane.auth import require_scope
from controlplane.errors import ErrorOut, Invalid
from scheduling import traffic
from scheduling.decisions import RouteInput, route_decide_async, route_records_flush
from scheduling.snapshot import snapshot_current_async

router = Router(tags=["routing"])

ROUTER = require_scope("router", asynchronous=True)
READ = require_scope("read", asynchronous=True)

# Far beyond any context window: a larger count is a bug in the caller, not a long prompt.
MAX_PROMPT_TOKENS = 10_000_000
MAX_OUTPUT_TOKENS = 10_000_000
MAX_BLOCK_HASHES = 20_000
MAX_BATCH = 1000

BlockHash = (
    Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1, strict=True)]
    | Annotated[str, StringConstraints(pattern=r"^(0x)?([0-9a-fA-F]{16}|[0-9a-fA-F]{64})$")]
)
ClusterName = Annotated[str, StringConstraints(min_length=1, max_length=100)]
# Counts are strict integers: pydantic's lax mode read true as 1 and 5.0 as 5.
TokenCount = Annotated[int, Field(ge=0, le=MAX_PROMPT_TOKENS, strict=True)]


class RouteIn(Schema):
    """One LLM request, described by token counts and its prefix-block chain."""

    origin: ClusterName = Field(description="PD cluster where the request arrived")
    prompt_tokens: int = Field(ge=1, le=MAX_PROMPT_TOKENS, strict=True)
    block_hashes: list[BlockHash] = Field(
        default_factory=list,
        max_length=MAX_BLOCK_HASHES,
        description="prefix block chain: vLLM block hashes (64-bit ints, or 16/64 hex digits)",
    )
    cached_tokens: dict[ClusterName, TokenCount] = Field(
        default_factory=dict,
        max_length=64,
        description="router-known cached prefix tokens per cluster (capped at prompt_tokens)",
    )
    request_id: Annotated[str, StringConstraints(max_length=128)] | None = None
    expected_output_tokens: int | None = Field(None, ge=0, le=MAX_OUTPUT_TOKENS, strict=True)

    @field_validator("block_hashes", mode="after")
    @classmethod
    def _fold(cls, value: list[int | str]) -> list[int | str]:
        out: list[int | str] = []
        for i, h in enumerate(value):
            try:
                out.append(block_hash_key(h))
            except BlockHashError as exc:
                raise ValueError(f"block_hashes[{i}]: {exc}") from None
        return out

    @model_validator(mode="after")
    def _consistent(self) -> RouteIn:
        # A cache cannot hold more of the prompt than the prompt: such counts are capped.
        for cluster, tokens in self.cached_tokens.items():
            if tokens > self.prompt_tokens:
                self.cached_tokens[cluster] = self.prompt_tokens
        return self

    def to_input(self) -> RouteInput:
        return RouteInput(
            origin=self.origin,
            prompt_tokens=self.prompt_tokens,
            chain=bytes.fromhex("".join(str(h) for h in self.block_hashes)),
            cached_tokens=self.cached_tokens,
            request_id=self.request_id,
            expected_output_tokens=self.expected_output_tokens,
        )


class RouteBatchIn(Schema):
    requests: list[RouteIn] = Field(min_length=1, max_length=MAX_BATCH)


# --- the same request as msgspec structs: the ASGI fast path decodes a body in one pass ------
# (pydantic above stays the schema of the ninja operations and the OpenAPI document;
# tests/scheduling/test_route_fastpath.py holds both doors to the same answers and errors).

_WireName = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
_WireCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)]


class RouteWire(msgspec.Struct, gc=False):
    """:class:`RouteIn` as the fast path decodes it (same fields, bounds and defaults)."""

    origin: _WireName
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    block_hashes: Annotated[list[int | str], msgspec.Meta(max_length=MAX_BLOCK_HASHES)] = []
    cached_tokens: Annotated[dict[_WireName, _WireCount], msgspec.Meta(max_length=64)] = {}
    request_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    expected_output_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTPUT_TOKENS)] | None = None


class RouteBatchWire(msgspec.Struct, gc=False):
    requests: Annotated[list[RouteWire], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


ROUTE_DECODER = msgspec.json.Decoder(RouteWire)
ROUTE_BATCH_DECODER = msgspec.json.Decoder(RouteBatchWire)


def _chain(values: list[int | str], where: str) -> bytes:
    """Block hashes folded to their 64-bit keys (:func:`block_hash_key`), packed as the prefix
    index holds them: 8 bytes big-endian each (ints in one ``struct`` call, the common case)."""
    with contextlib.suppress(struct.error):
        # Non-negative ints below 2**64 (msgspec gives ints and strings only, never bools).
        return struct.pack(f">{len(values)}Q", *values)
    keys: list[str] = []
    for i, h in enumerate(values):
        try:
            keys.append(block_hash_key(h))
        except BlockHashError as exc:
            raise Invalid(f"{where}block_hashes[{i}]: {exc}", code="invalid") from None
    return bytes.fromhex("".join(keys))


def route_wire_input(item: RouteWire, where: str = "") -> RouteInput:
    """The service's input from a decoded request (``where``: ``requests[i].`` in a batch)."""
    cached = item.cached_tokens
    if cached and max(cached.values()) > item.prompt_tokens:
        # A cache cannot hold more of the prompt than the prompt: such counts are capped.
        cached = {k: min(v, item.prompt_tokens) for k, v in cached.items()}
    return RouteInput(
        origin=item.origin,
        prompt_tokens=item.prompt_tokens,
        chain=_chain(item.block_hashes, where) if item.block_hashes else b"",
        cached_tokens=cached,
        request_id=item.request_id,
        expected_output_tokens=item.expected_output_tokens,
    )


def route_wire_decode(body: bytes, *, batch: bool) -> list[RouteInput]:
    """Decode and check a fast-path body; ``msgspec.DecodeError`` for what is not JSON,
    :class:`Invalid` (the pydantic door's paths: ``requests[3].prompt_tokens: ...``)."""
    try:
        if batch:
            items = ROUTE_BATCH_DECODER.decode(body).requests
            return [route_wire_input(r, f"requests[{i}].") for i, r in enumerate(items)]
        return [route_wire_input(ROUTE_DECODER.decode(body))]
    except msgspec.ValidationError as exc:
        raise Invalid(_wire_detail(str(exc)), code="invalid") from None


def _wire_detail(message: str) -> str:
    """msgspec's ``Expected ... - at `$.requests[0].origin``` as ``requests[0].origin: ...``."""
    text, sep, where = message.rpartition(" - at `$")
    if not sep:
        return message
    path = where.rstrip("`").lstrip(".")
    return f"{path}: {text}" if path else text


class PlacementOut(Schema):
    cluster: str
    instance: str
    endpoint: str


class TtftOut(Schema):
    local: float | None = Field(description="seconds; null when unbounded")
    prfaas: float | None = Field(description="seconds; null when no PrfaaS cluster is usable")


class CacheTransferOut(Schema):
    source_cluster: str
    source_instance: str | None
    target_cluster: str
    target_instance: str
    tokens: int
    bytes: int


class ReservationOut(Schema):
    source: str
    target: str
    bytes: int
    id: str | None = Field(
        None, description="release it with POST /outcomes when the transfer ends"
    )


class LinkRefusalOut(Schema):
    source: str
    target: str
    cause: str = Field(
        description="budget: the link's in-flight KV budget had no room; saturation: its "
        "egress was at capacity, or congestion control raised the threshold for it"
    )


class RouteOut(Schema):
    """The decision: where prefill and decode run, and why (``reason``)."""

    request_id: str | None
    route: str = Field(description="local | prfaas")
    prefill: PlacementOut
    decode: PlacementOut
    incremental_tokens: int
    cached_tokens: int
    threshold: float | None = Field(description="effective threshold; null = never offload")
    policy_version: int
    reason: str
    ttft_estimate_s: TtftOut
    cache_transfer: CacheTransferOut | None
    reservation: ReservationOut | None
    kv_bytes: int
    link_refusal: LinkRefusalOut | None = Field(
        None,
        description="set when the link guard kept an offload local (reason link_congested): "
        "which link, and why",
    )
    stale: bool = Field(
        description="decided without fresh live state (Redis away, telemetry old) or from a "
        "snapshot older than SNAPSHOT_MAX_AGE_S (the database away)"
    )
    snapshot_age_s: float = Field(
        description="seconds since the topology and policy this was decided with were read"
    )
    live_age_s: float | None = Field(
        None,
        description="seconds since the live state it was decided with was read (at most "
        "LIVE_STATE_MAX_AGE_S); null when Redis was away (stale)",
    )


class RouteBatchOut(Schema):
    decisions: list[RouteOut]


ERRORS: dict[int, Any] = {
    401: ErrorOut,
    403: ErrorOut,
    404: ErrorOut,
    413: ErrorOut,
    422: ErrorOut,
    503: ErrorOut,
}


def _json(data: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


async def route_answer(inputs: list[RouteInput], *, batch: bool) -> bytes:
    """The one pipeline behind both doors of ``/route`` and ``/route/batch`` (these ninja
    operations and the ASGI fast path, :mod:`scheduling.fastpath`): checked requests in, the
    JSON answer out."""
    decisions = await route_decide_async(inputs, batch=batch)
    return orjson.dumps({"decisions": decisions} if batch else decisions[0])


@router.post("/route", auth=ROUTER, response={200: RouteOut, **ERRORS})
async def route(request: HttpRequest, payload: RouteIn) -> HttpResponse:
    """Decide where one request's prefill and decode run."""
    body = await route_answer([payload.to_input()], batch=False)
    return HttpResponse(body, content_type="application/json")


@router.post("/route/batch", auth=ROUTER, response={200: RouteBatchOut, **ERRORS})
async def route_batch(request: HttpRequest, payload: RouteBatchIn) -> HttpResponse:
    """Decide up to 1,000 requests against one live snapshot, in order."""
    body = await route_answer([r.to_input() for r in payload.requests], batch=True)
    return HttpResponse(body, content_type="application/json")


@router.get(
    "/policy",
    auth=ROUTER,
    response={200: dict[str, Any], 304: None, 401: ErrorOut, 403: ErrorOut, 503: ErrorOut},
)
async def policy(request: HttpRequest) -> HttpResponse:
    """Everything a router needs to decide locally: thresholds, guards, clusters, instances
    and endpoints, links and their budgets (``scheduling.core.routing.policy_snapshot_from_dict``
    reads it). Send ``If-None-Match`` with the last ETag to get 304 when nothing changed."""
    snap = await snapshot_current_async()
    etags = {t.strip() for t in request.headers.get("If-None-Match", "").split(",")}
    if snap.etag in etags or "*" in etags:
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(snap.body, content_type="application/json")
    response["ETag"] = snap.etag
    response["Cache-Control"] = "no-cache"
    return response


class RecentDecisionOut(Schema):
    ts: float
    inputs: dict[str, Any]
    decision: dict[str, Any]


@router.get(
    "/decisions/recent",
    auth=READ,
    response={200: list[RecentDecisionOut], 401: ErrorOut, 403: ErrorOut, 422: ErrorOut},
)
async def decisions_recent(
    request: HttpRequest, limit: int = Query(50, ge=1, le=traffic.RECENT_CAP)
) -> HttpResponse:
    """The latest decisions with their inputs, newest first ("why was this offloaded?")."""
    await route_records_flush()  # this process's own, not yet written
    return _json(await traffic.recent_decisions_read_async(limit))
