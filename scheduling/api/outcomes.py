"""API for routers that decide in process (``router`` scope): the live state they decide
with, the atomic link reservation an offload needs, and the outcomes they report
(:mod:`scheduling.outcomes`). ``GET /outcomes/recent`` (``read``) shows what was served."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema
from pydantic import ConfigDict, StringConstraints, ValidationError

from controlplane.auth import require_scope
from controlplane.errors import ErrorOut, Invalid
from scheduling import outcomes
from scheduling.core import routing
from scheduling.decisions import live_state_read_async

router = Router(tags=["routing"])
ROUTER = require_scope("router", asynchronous=True)
READ = require_scope("read", asynchronous=True)

Name = Annotated[str, StringConstraints(min_length=1, max_length=150)]
Seconds = Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]
Tokens = Annotated[int, Field(ge=0, le=10_000_000)]
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=200)]
MAX_OUTCOMES = 1000


ERRORS: dict[int, Any] = {s: ErrorOut for s in (401, 403, 404, 413, 422, 503)}


def _json(data: Any) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), content_type="application/json")


@router.get(
    "/route/live",
    auth=ROUTER,
    response={200: dict[str, Any], 401: ErrorOut, 403: ErrorOut, 503: ErrorOut},
)
async def route_live(request: HttpRequest) -> HttpResponse:
    """Instances' loads, links' egress and in-flight bytes, and each PD cluster's control
    state now: what ``route_decide`` needs besides the policy snapshot
    (``scheduling.core.routing.live_state_from_dict`` reads it). Poll it with a bounded age."""
    return _json(routing.live_state_to_dict(await live_state_read_async()))


class StrictBody(Schema):
    """JSON numbers mean numbers: no ``true`` or ``"5"`` read as 5, no 1.5 read as 1."""

    model_config = ConfigDict(strict=True)


class ReservationIn(StrictBody):
    source: Name = Field(description="prfaas cluster")
    target: Name = Field(description="pd cluster")
    bytes: int = Field(ge=1, le=1 << 50, description="KV bytes to hold in flight")
    hold_s: float = Field(
        gt=0,
        le=outcomes.MAX_HOLD_S,
        allow_inf_nan=False,
        description="longest the transfer may take; the reservation expires by itself then",
    )


class ReservationTakenOut(Schema):
    admitted: bool
    id: str | None = Field(description="release it with the request's outcome")
    budget_bytes: int


@router.post("/reservations", auth=ROUTER, response={200: ReservationTakenOut, **ERRORS})
async def reservation_take(request: HttpRequest, payload: ReservationIn) -> HttpResponse:
    """Reserve an offload's KV bytes on a link, atomically against every router (refused,
    ``admitted: false``, when the link's in-flight budget has no room)."""
    result = await outcomes.reservation_take_async(
        payload.source, payload.target, payload.bytes, payload.hold_s
    )
    return _json(
        {"admitted": result.admitted, "id": result.id, "budget_bytes": result.budget_bytes}
    )


class PlaceIn(StrictBody):
    cluster: Name
    instance: Name


class OutcomeIn(StrictBody):
    """One request as a gateway served it."""

    decision: dict[str, Any] = Field(description="the decision carried out, as /route answers")
    decided_by: Literal["gateway", "control_plane"]
    origin: Name
    prompt_tokens: int = Field(ge=1, le=10_000_000)
    route: Literal["local", "prfaas"] = Field(description="what was served, after any fallback")
    reason: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    prefill: PlaceIn
    decode: PlaceIn
    incremental_tokens: Tokens
    cached_tokens: Tokens
    output_tokens: Tokens = 0
    observed_ttft_s: Seconds | None = None
    transfer: Literal["none", "finished", "failed"]
    transfer_bytes: int = Field(0, ge=0, le=1 << 50)
    status: Literal["ok", "failed", "cancelled"]
    error: Annotated[str, StringConstraints(max_length=200)] | None = None
    ts: float = Field(ge=0, allow_inf_nan=False, description="unix seconds, request end")
    request_id: Annotated[str, StringConstraints(max_length=128)] | None = None
    block_hashes: int = Field(0, ge=0, le=100_000)
    idempotency_key: IdempotencyKey | None = Field(
        None, description="request id and attempt: an outcome sent again is applied once"
    )

    def to_outcome(self, index: int) -> outcomes.Outcome:
        try:
            decision = routing.decision_from_dict(self.decision)
        except ValueError as exc:
            raise Invalid(f"outcomes[{index}].decision: not a decision: {exc}") from None
        return outcomes.Outcome(
            decision=decision,
            decided_by=self.decided_by,
            origin=self.origin,
            prompt_tokens=self.prompt_tokens,
            served_route=self.route,
            served_reason=self.reason,
            prefill_cluster=self.prefill.cluster,
            prefill_instance=self.prefill.instance,
            decode_cluster=self.decode.cluster,
            decode_instance=self.decode.instance,
            incremental_tokens=self.incremental_tokens,
            cached_tokens=self.cached_tokens,
            output_tokens=self.output_tokens,
            observed_ttft_s=self.observed_ttft_s,
            transfer=self.transfer,
            transfer_bytes=self.transfer_bytes,
            status=self.status,
            error=self.error,
            ts=self.ts,
            request_id=self.request_id,
            block_hashes=self.block_hashes,
            idempotency_key=self.idempotency_key,
        )


class ServedGroupIn(StrictBody):
    """Plain outcomes summed by the gateway (see ``scheduling.outcomes.ServedGroup``)."""

    origin: Name
    route: Literal["local", "prfaas"]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    prefill_cluster: Name
    decided_by: Literal["gateway", "control_plane"]
    status: Literal["ok", "failed", "cancelled"]
    transfer: Literal["none", "finished", "failed"]
    ts: float = Field(ge=0, allow_inf_nan=False)
    incremental_tokens: list[Tokens] = Field(min_length=1, max_length=100_000)
    cached_tokens: int = Field(ge=0, le=1 << 50)
    output_tokens: int = Field(ge=0, le=1 << 50)
    observed_ttft_s: list[Seconds] = Field(default_factory=list, max_length=100_000)
    predicted_ttft_s: list[Seconds] = Field(default_factory=list, max_length=100_000)
    idempotency_key: IdempotencyKey | None = Field(
        None, description="a group sent again is applied once"
    )

    def to_group(self, index: int) -> outcomes.ServedGroup:
        if len(self.observed_ttft_s) != len(self.predicted_ttft_s):
            raise Invalid(f"groups[{index}]: observed_ttft_s and predicted_ttft_s must pair up")
        if len(self.observed_ttft_s) > len(self.incremental_tokens):
            raise Invalid(f"groups[{index}]: more TTFT pairs than requests")
        return outcomes.ServedGroup(**self.dict())


class OutcomesIn(StrictBody):
    """Items are checked one by one (a bad one is refused alone, see ``RejectedOut``)."""

    outcomes: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_OUTCOMES)
    groups: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_OUTCOMES)


class RejectedOut(Schema):
    kind: Literal["outcome", "group"]
    index: int = Field(description="the item's place in its list")
    code: str = Field(description="invalid | unknown_cluster | unknown_reason")
    detail: str


class OutcomesOut(Schema):
    accepted: int = Field(description="requests applied (a group counts as its requests)")
    released: int = Field(description="link reservations released by these outcomes")
    released_bytes: int
    duplicates: int = Field(description="items whose idempotency key was applied before")
    rejected: list[RejectedOut] = Field(description="items refused one by one")


def _problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<item>"
    return f"{where}: {first['msg']}"


def _release_of(raw: Any) -> outcomes.Release | None:
    """The reservation a refused outcome names, read leniently: it is given back even though
    the outcome itself cannot be recorded."""
    decision = raw.get("decision") if isinstance(raw, dict) else None
    rv = decision.get("reservation") if isinstance(decision, dict) else None
    if not isinstance(rv, dict):
        return None
    source, target, rid = rv.get("source"), rv.get("target"), rv.get("id")
    if not (isinstance(source, str) and isinstance(target, str) and isinstance(rid, str)):
        return None
    if not all(0 < len(x) <= 200 for x in (source, target, rid)):
        return None
    return outcomes.Release(source, target, rid)


def _batch_parse(payload: OutcomesIn) -> outcomes.OutcomesBatch:
    parsed: list[tuple[int, outcomes.Outcome]] = []
    groups: list[tuple[int, outcomes.ServedGroup]] = []
    rejected: list[outcomes.Rejected] = []
    releases: list[outcomes.Release] = []
    for i, raw in enumerate(payload.outcomes):
        try:
            parsed.append((i, OutcomeIn.model_validate(raw).to_outcome(i)))
        except (ValidationError, Invalid) as exc:
            detail = _problem(exc) if isinstance(exc, ValidationError) else exc.detail
            rejected.append(outcomes.Rejected("outcome", i, "invalid", detail))
            release = _release_of(raw)
            if release is not None:
                releases.append(release)
    for i, raw in enumerate(payload.groups):
        try:
            groups.append((i, ServedGroupIn.model_validate(raw).to_group(i)))
        except (ValidationError, Invalid) as exc:
            detail = _problem(exc) if isinstance(exc, ValidationError) else exc.detail
            rejected.append(outcomes.Rejected("group", i, "invalid", detail))
    return outcomes.OutcomesBatch(parsed, groups, rejected, releases)


@router.post("/outcomes", auth=ROUTER, response={200: OutcomesOut, **ERRORS})
async def outcomes_post(request: HttpRequest, payload: OutcomesIn) -> HttpResponse:
    """Report what was served: up to 1,000 outcomes one by one (those holding a reservation,
    failed, or sampled for the recent list) and up to 1,000 groups of plain ones summed.
    Each item is checked on its own: the good ones are applied (once per idempotency key),
    the others refused in ``rejected``; every reservation named is released. Counts
    gateway-decided traffic for the rebalancer, tracks predicted vs observed TTFT."""
    if not payload.outcomes and not payload.groups:
        raise Invalid("outcomes or groups: nothing to record", code="empty")
    result = await outcomes.outcomes_record_async(_batch_parse(payload))
    return _json(
        {
            "accepted": result.accepted,
            "released": result.released,
            "released_bytes": result.released_bytes,
            "duplicates": result.duplicates,
            "rejected": [
                {"kind": r.kind, "index": r.index, "code": r.code, "detail": r.detail}
                for r in result.rejected
            ],
        }
    )


class EjectionIn(StrictBody):
    instance: Name
    for_s: float = Field(gt=0, le=outcomes.MAX_HOLD_S, allow_inf_nan=False)
    reason: Annotated[str, StringConstraints(max_length=200)] = ""


class EjectionsIn(StrictBody):
    ejections: list[EjectionIn] = Field(min_length=1, max_length=100)


class EjectionsOut(Schema):
    recorded: int


@router.post("/ejections", auth=ROUTER, response={200: EjectionsOut, **ERRORS})
async def instance_ejections(request: HttpRequest, payload: EjectionsIn) -> HttpResponse:
    """A router ejected engines that failed or hung there (its outlier detection): every
    decision, the route API's and the live state's readers', takes them as ``down`` until
    ``for_s`` has passed."""
    recorded = await outcomes.instance_ejections_record_async(
        [outcomes.Ejection(e.instance, e.for_s, e.reason) for e in payload.ejections]
    )
    return _json({"recorded": recorded})


@router.get(
    "/outcomes/recent",
    auth=READ,
    response={200: list[dict[str, Any]], 401: ErrorOut, 403: ErrorOut, 422: ErrorOut},
)
async def outcomes_recent(
    request: HttpRequest, limit: int = Query(50, ge=1, le=outcomes.RECENT_CAP)
) -> HttpResponse:
    """The latest outcomes, newest first: served route, instances, predicted and observed
    TTFT, the transfer's result and the reservation bytes released."""
    return _json(await outcomes.outcomes_recent_async(limit))
