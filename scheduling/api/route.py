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

from clusters.live.prefix_index import BlockHashError, block_hash_key
from controlplane.auth import require_scope
from controlplane.errors import ApiError, ErrorOut, Invalid
from controlplane.parser import json_content_type_check
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

# --- the request: one msgspec schema, decoded in one pass by both doors -------------------
# (these ninja operations and the ASGI fast path, :mod:`scheduling.fastpath`); its OpenAPI
# schema is generated from the same structs (:func:`_request_body`).

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)]
BlockHash = (
    # 64-bit, signed or not; msgspec bounds only int64, so the chain's folding checks it.
    Annotated[
        int, msgspec.Meta(extra_json_schema={"minimum": -(1 << 63), "maximum": (1 << 64) - 1})
    ]
    | Annotated[str, msgspec.Meta(pattern=r"^(0x)?([0-9a-fA-F]{16}|[0-9a-fA-F]{64})$")]
)


class RouteIn(msgspec.Struct, gc=False):
    """One LLM request, described by token counts and its prefix-block chain."""

    origin: Annotated[Name, msgspec.Meta(description="PD cluster where the request arrived")]
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    block_hashes: Annotated[
        list[BlockHash],
        msgspec.Meta(
            max_length=MAX_BLOCK_HASHES,
            description="prefix block chain: vLLM block hashes (64-bit ints, or 16/64 hex digits)",
        ),
    ] = []
    cached_tokens: Annotated[
        dict[Name, TokenCount],
        msgspec.Meta(
            max_length=64,
            description="router-known cached prefix tokens per cluster (capped at prompt_tokens)",
        ),
    ] = {}
    request_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    expected_output_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTPUT_TOKENS)] | None = None


class RouteBatchIn(msgspec.Struct, gc=False):
    requests: Annotated[list[RouteIn], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


ROUTE_DECODER = msgspec.json.Decoder(RouteIn)
ROUTE_BATCH_DECODER = msgspec.json.Decoder(RouteBatchIn)


def _request_body(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """The operation's request body for OpenAPI: the struct's JSON schema, inlined."""
    (schema,), defs = msgspec.json.schema_components([struct], ref_template="{name}")

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


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


def route_input_from(item: RouteIn, where: str = "") -> RouteInput:
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


def route_body_decode(body: bytes, *, batch: bool) -> list[RouteInput]:
    """Decode and check a body; ``msgspec.DecodeError`` for what is not JSON, :class:`Invalid`
    naming the field's path (``requests[3].prompt_tokens: ...``)."""
    try:
        if batch:
            items = ROUTE_BATCH_DECODER.decode(body).requests
            return [route_input_from(r, f"requests[{i}].") for i, r in enumerate(items)]
        return [route_input_from(ROUTE_DECODER.decode(body))]
    except msgspec.ValidationError as exc:
        raise Invalid(_decode_detail(str(exc)), code="invalid") from None


def _decode_detail(message: str) -> str:
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
    prefix_unavailable: bool = Field(
        False,
        description="present (true) when the prefix index did not answer within "
        "PREFIX_READ_DEADLINE_S, or a shard of it failed: decided without (some of) the "
        "request's cache hits",
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


def route_request_decode(content_type: str | None, body: bytes, *, batch: bool) -> list[RouteInput]:
    """A route call's body, checked, as the service's inputs: the one decoder of both doors."""
    json_content_type_check(content_type)
    try:
        return route_body_decode(body, batch=batch)
    except msgspec.DecodeError:
        raise ApiError("Cannot parse request body", code="http_400") from None


@router.post(
    "/route",
    auth=ROUTER,
    response={200: RouteOut, **ERRORS},
    openapi_extra=_request_body(RouteIn),
)
async def route(request: HttpRequest) -> HttpResponse:
    """Decide where one request's prefill and decode run."""
    inputs = route_request_decode(request.content_type, request.body, batch=False)
    return HttpResponse(await route_answer(inputs, batch=False), content_type="application/json")


@router.post(
    "/route/batch",
    auth=ROUTER,
    response={200: RouteBatchOut, **ERRORS},
    openapi_extra=_request_body(RouteBatchIn),
)
async def route_batch(request: HttpRequest) -> HttpResponse:
    """Decide up to 1,000 requests against one live snapshot, in order."""
    inputs = route_request_decode(request.content_type, request.body, batch=True)
    return HttpResponse(await route_answer(inputs, batch=True), content_type="application/json")


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
