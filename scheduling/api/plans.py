"""Plans and the rebalancer over HTTP: list and read plans (``read``), approve, reject, roll
back and run the rebalancer now (``operate``). Illegal transitions answer 409 with the error
shape and change nothing."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Path, Query, Router, Schema
from pydantic import ConfigDict

from clusters.models import Cluster, ClusterKind
from controlplane.audit import actor_from_request
from controlplane.auth import TokenAuth
from controlplane.errors import Invalid, NotFound
from scheduling import rebalance
from scheduling.models import Plan, RebalanceTick

router = Router(tags=["plans"])

StatusName = Literal[
    "proposed",
    "approved",
    "applying",
    "applied",
    "rejected",
    "superseded",
    "failed",
    "rolling_back",
    "rolled_back",
]
# Ids are PostgreSQL bigints: a larger number is a bad request, not a database error.
MAX_ID = 2**63 - 1
PLAN_ID = Path(..., ge=1, le=MAX_ID)
VERSION = Query(None, ge=1, le=2**31 - 1, description="the plan version last read")

READ = TokenAuth("read")
OPERATE = TokenAuth("operate")
ADMIN = TokenAuth("admin")


class PlanStepOut(Schema):
    phase: str
    index: int
    action: str
    instance: str | None
    to_role: str
    threshold: float | None
    status: str
    attempts: int
    detail: str
    started_at: datetime | None
    finished_at: datetime | None


class PlanOut(Schema):
    id: int
    cluster: str
    status: str
    version: int
    mode: str
    tick_period_start: datetime
    threshold_before: float
    threshold_after: float
    n_p_before: int
    n_d_before: int
    n_p_after: int
    n_d_after: int
    gain: float
    role_changes: list[dict[str, Any]]
    predictions: dict[str, Any]
    policy_version_before: int | None
    policy_version_after: int | None
    policy_version_restored: int | None
    approved_by: str
    decided_by: str
    error: str
    closed_reason: str
    proposed_at: datetime
    approved_at: datetime | None
    applying_at: datetime | None
    applied_at: datetime | None
    closed_at: datetime | None
    rollback_at: datetime | None
    rolled_back_at: datetime | None


class PlanDetailOut(PlanOut):
    inputs: dict[str, Any]
    steps: list[PlanStepOut]


class PlanListOut(Schema):
    items: list[PlanOut]
    count: int


class TickOut(Schema):
    id: int
    cluster: str
    period_start: datetime
    action: str
    reason: str
    detail: str
    gain: float | None
    plan_id: int | None


class RebalanceOut(Schema):
    ticks: list[TickOut]


def _plan_out(plan: Plan) -> dict[str, Any]:
    data = {name: getattr(plan, name) for name in PlanOut.model_fields if hasattr(plan, name)}
    data["cluster"] = plan.cluster.name
    data["tick_period_start"] = plan.tick.period_start
    return data


def _plan_detail(plan: Plan) -> dict[str, Any]:
    data = _plan_out(plan)
    data["inputs"] = plan.inputs
    data["steps"] = [
        {
            "phase": s.phase,
            "index": s.index,
            "action": s.action,
            "instance": s.instance.name if s.instance else None,
            "to_role": s.to_role,
            "threshold": s.threshold,
            "status": s.status,
            "attempts": s.attempts,
            "detail": s.detail,
            "started_at": s.started_at,
            "finished_at": s.finished_at,
        }
        for s in rebalance.plan_steps(plan)
    ]
    return data


def _tick_out(tick: RebalanceTick) -> dict[str, Any]:
    plan = Plan.objects.filter(tick=tick).values_list("pk", flat=True).first()
    return {
        "id": tick.pk,
        "cluster": tick.cluster.name,
        "period_start": tick.period_start,
        "action": "propose" if plan is not None else tick.action,
        "reason": tick.reason,
        "detail": tick.detail,
        "gain": tick.gain,
        "plan_id": plan,
    }


@router.get("/plans", response=PlanListOut, auth=READ)
def plans_list(
    request: HttpRequest,
    cluster: str | None = Query(None, min_length=1, max_length=100),
    status: StatusName | None = None,
    limit: int = Query(100, ge=1, le=1000),
) -> dict[str, Any]:
    items = [_plan_out(p) for p in rebalance.plan_list(cluster=cluster, status=status, limit=limit)]
    return {"items": items, "count": len(items)}


@router.get("/plans/{plan_id}", response=PlanDetailOut, auth=READ)
def plans_get(request: HttpRequest, plan_id: int = PLAN_ID) -> dict[str, Any]:
    return _plan_detail(rebalance.plan_get(plan_id))


def _plan_transition(
    service: Callable[..., Plan], request: HttpRequest, plan_id: int, version: int | None
) -> dict[str, Any]:
    """Approve, reject and roll back are one shape: the service moves the plan, we show it."""
    plan = service(plan_id=plan_id, actor=actor_from_request(request), version=version)
    return _plan_detail(rebalance.plan_get(plan.pk))


@router.post("/plans/{plan_id}/approve", response=PlanDetailOut, auth=OPERATE)
def plans_approve(
    request: HttpRequest, plan_id: int = PLAN_ID, version: int | None = VERSION
) -> dict[str, Any]:
    return _plan_transition(rebalance.plan_approve, request, plan_id, version)


@router.post("/plans/{plan_id}/reject", response=PlanDetailOut, auth=OPERATE)
def plans_reject(
    request: HttpRequest,
    plan_id: int = PLAN_ID,
    version: int | None = VERSION,
    reason: str = Query("", max_length=500, description="why (kept with the plan)"),
) -> dict[str, Any]:
    plan = rebalance.plan_reject(
        plan_id=plan_id, actor=actor_from_request(request), version=version, reason=reason
    )
    return _plan_detail(rebalance.plan_get(plan.pk))


@router.post("/plans/{plan_id}/rollback", response=PlanDetailOut, auth=OPERATE)
def plans_rollback(
    request: HttpRequest, plan_id: int = PLAN_ID, version: int | None = VERSION
) -> dict[str, Any]:
    return _plan_transition(rebalance.plan_rollback, request, plan_id, version)


@router.get("/rebalance/ticks", response=RebalanceOut, auth=READ)
def rebalance_ticks(
    request: HttpRequest,
    cluster: str | None = Query(None, min_length=1, max_length=100),
    action: Literal["hold", "propose"] | None = None,
    limit: int = Query(50, ge=1, le=1000),
) -> dict[str, Any]:
    """Recent ticks: every hold with its reason, and every proposal with its plan."""
    ticks = rebalance.rebalance_ticks_recent(cluster=cluster, action=action, limit=limit)
    return {"ticks": [_tick_out(t) for t in ticks]}


@router.post("/rebalance", response=RebalanceOut, auth=OPERATE)
def rebalance_now(
    request: HttpRequest,
    cluster: str | None = Query(None, min_length=1, max_length=100, description="a pd cluster"),
) -> dict[str, Any]:
    """Run the rebalancer now: one tick per pd cluster (or the named one), id = now."""
    name = cluster
    clusters = Cluster.objects.filter(kind=ClusterKind.PD)
    if name is not None:
        clusters = clusters.filter(pk=_pd_cluster(name).pk)
    ticks = rebalance.rebalance_run_now(
        cluster_ids=list(clusters.values_list("pk", flat=True)),
        actor=actor_from_request(request),
        now=time.time(),
    )
    return {"ticks": [_tick_out(t) for t in ticks]}


class RebalanceSettingsOut(Schema):
    cluster: str
    enabled: bool
    mode: Literal["auto", "manual"]
    guards: dict[str, Any]
    drain_timeout_s: int
    drain_poll_s: int
    default_output_tokens: int
    actuator: Literal["record", "webhook", "kubernetes", "metrics", "process"]
    webhook_url: str
    webhook_secret_set: bool
    ready_timeout_s: int
    version: int
    effective_guards: dict[str, Any]


class RebalanceSettingsPatch(Schema):
    # Unknown names are refused, and a body must name a setting (the schema says both): an
    # empty change is no change to version.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    enabled: bool | None = None
    mode: Literal["auto", "manual"] | None = None
    guards: dict[str, float | int | None] | None = Field(
        None,
        description="overrides of the rebalancer's guards (scheduling.core.rebalancer.RebalanceGuards)",
    )
    drain_timeout_s: int | None = Field(None, ge=1, le=86400)
    drain_poll_s: int | None = Field(None, ge=1, le=3600)
    default_output_tokens: int | None = Field(None, ge=1, le=10_000_000)
    actuator: Literal["record", "webhook", "kubernetes", "metrics", "process"] | None = None
    webhook_url: str | None = Field(None, max_length=500)
    webhook_secret: str | None = Field(None, max_length=200)
    ready_timeout_s: int | None = Field(
        None, ge=1, le=86400, description="kubernetes: seconds a scaled role may take to settle"
    )


def _settings_out(cluster: Cluster) -> dict[str, Any]:
    row = rebalance.rebalance_settings_for(cluster)
    return {
        "cluster": cluster.name,
        "enabled": row.enabled,
        "mode": row.mode,
        "guards": row.guards,
        "drain_timeout_s": row.drain_timeout_s,
        "drain_poll_s": row.drain_poll_s,
        "default_output_tokens": row.default_output_tokens,
        "actuator": row.actuator,
        "webhook_url": row.webhook_url,
        "webhook_secret_set": bool(row.webhook_secret),
        "ready_timeout_s": row.ready_timeout_s,
        "version": row.version,
        "effective_guards": dataclasses.asdict(rebalance.guards_for(row)),
    }


def _pd_cluster(name: str) -> Cluster:
    found = Cluster.objects.filter(name=name).first()
    if found is None:
        raise NotFound(f"cluster {name!r} does not exist")
    if found.kind != ClusterKind.PD:
        raise Invalid(f"cluster: {name} is a {found.kind} cluster; only pd clusters rebalance")
    return found


@router.get("/rebalance/settings/{cluster}", response=RebalanceSettingsOut, auth=READ)
def rebalance_settings_get(
    request: HttpRequest, cluster: str = Path(..., min_length=1, max_length=100)
) -> dict[str, Any]:
    return _settings_out(_pd_cluster(cluster))


@router.patch("/rebalance/settings/{cluster}", response=RebalanceSettingsOut, auth=ADMIN)
def rebalance_settings_patch(
    request: HttpRequest,
    payload: RebalanceSettingsPatch,
    cluster: str = Path(..., min_length=1, max_length=100),
) -> dict[str, Any]:
    """Mode (``auto``/``manual``), guard overrides, drain timing and the actuator of a PD
    cluster's rebalancer (``kubernetes`` needs the cluster's scale targets). The webhook secret
    is write-only."""
    found = _pd_cluster(cluster)
    changes = payload.model_dump(exclude_unset=True)
    if not changes:
        raise Invalid("the body names no setting to change")
    for name, value in changes.items():
        if value is None:
            raise Invalid(f"{name}: must not be null (leave it out to keep the current value)")
    rebalance.rebalance_settings_update(
        cluster_id=found.pk, changes=changes, actor=actor_from_request(request)
    )
    return _settings_out(found)
