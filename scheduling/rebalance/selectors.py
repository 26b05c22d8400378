"""Reads of the long-term loop: plans, their steps, ticks, per-cluster rebalance settings."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings as django_settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from clusters.live.telemetry import BANDWIDTH_RETENTION_S, link_bandwidth_series
from clusters.models import Cluster, Link
from controlplane.audit import Actor
from controlplane.errors import Invalid, NotFound
from scheduling.core import rebalancer
from scheduling.models import (
    Plan,
    PlanStatus,
    PlanStep,
    RebalanceSettings,
    RebalanceTick,
)
from scheduling.traffic import fleet_rate, traffic_window_read

SYSTEM_ACTOR = Actor(label="rebalancer", source="celery")


IN_FLIGHT = (PlanStatus.APPROVED, PlanStatus.APPLYING, PlanStatus.ROLLING_BACK)

# The hook for the planner's predicted link refusals (issue 28 adds them to a plan's
# predictions): the share of the offloads offered to a PD cluster's links that their guard
# keeps local. Until a prediction carries this key the pages show the observed share alone.
PREDICTED_REFUSAL_KEY = "offload_refused_fraction"


def plan_predicted_refusal(plan: Plan | None, setting: str = "proposed") -> float | None:
    """What ``plan`` predicted for its ``setting`` of the share of offloads its PD cluster's
    link guard keeps local (None: no plan, or the planner predicts no such figure yet)."""
    if plan is None:
        return None
    value = (plan.predictions.get(setting) or {}).get(PREDICTED_REFUSAL_KEY)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def plans_in_force() -> dict[str, Plan]:
    """The plan each PD cluster runs now: its latest applied one (by cluster name)."""
    out: dict[str, Plan] = {}
    applied = Plan.objects.filter(status=PlanStatus.APPLIED).select_related("cluster")
    for plan in applied.order_by("-applied_at", "-id"):
        out.setdefault(plan.cluster.name, plan)
    return out


def plan_list(
    *, cluster: str | None = None, status: str | None = None, limit: int = 100
) -> QuerySet[Plan]:
    """Plans, newest first, optionally of one cluster (by name) and status."""
    qs = Plan.objects.select_related("cluster", "tick").order_by("-proposed_at", "-id")
    if cluster:
        qs = qs.filter(cluster__name=cluster)
    if status:
        if status not in PlanStatus.values:
            raise Invalid(f"status: must be one of {', '.join(PlanStatus.values)}")
        qs = qs.filter(status=status)
    return qs[: max(1, min(limit, 1000))]


def plan_get(plan_id: int) -> Plan:
    plan = Plan.objects.select_related("cluster", "tick").filter(pk=plan_id).first()
    if plan is None:
        raise NotFound(f"plan {plan_id} does not exist")
    return plan


def plan_steps(plan: Plan) -> list[PlanStep]:
    return list(plan.steps.select_related("instance").order_by("phase", "index"))


def rebalance_ticks_recent(
    *, cluster: str | None = None, action: str | None = None, limit: int = 100
) -> QuerySet[RebalanceTick]:
    """The latest ticks (holds with their reasons, and proposals), newest first."""
    qs = RebalanceTick.objects.select_related("cluster").order_by("-period_start", "-id")
    if cluster:
        qs = qs.filter(cluster__name=cluster)
    if action:
        qs = qs.filter(action=action)
    return qs[: max(1, min(limit, 1000))]


def rebalance_settings_for(cluster: Cluster) -> RebalanceSettings:
    """The cluster's rebalancer settings; defaults (unsaved) when none were stored."""
    found = RebalanceSettings.objects.filter(cluster=cluster).first()
    return found if found is not None else RebalanceSettings(cluster=cluster)


def guards_for(settings_row: RebalanceSettings) -> rebalancer.RebalanceGuards:
    try:
        return rebalancer.RebalanceGuards().with_overrides(dict(settings_row.guards or {}))
    except (TypeError, ValueError) as exc:
        raise Invalid(f"guards: {exc}") from exc


def period_start_for(now: float, interval_s: float | None = None) -> datetime:
    """The start of the rebalancing period holding ``now`` (the tick id's time part)."""
    interval = float(interval_s or django_settings.REBALANCE_INTERVAL_S)
    return datetime.fromtimestamp(math.floor(now / interval) * interval, tz=UTC)


def plans_stalled(older_than_s: float) -> list[int]:
    """Plans applying or rolling back with no progress for ``older_than_s`` (crash recovery).

    A plan waiting on a drain records progress at every poll (its cluster's ``drain_poll_s``),
    so one is stalled only after missing several polls: a slow poll is never re-driven into a
    second chain of polls."""
    now = timezone.now()
    candidates = Plan.objects.filter(
        status__in=(PlanStatus.APPLYING, PlanStatus.ROLLING_BACK),
        updated_at__lt=now - timedelta(seconds=older_than_s),
    ).values_list("pk", "cluster_id", "updated_at")
    poll_s = dict(RebalanceSettings.objects.values_list("cluster_id", "drain_poll_s"))
    default_poll_s = RebalanceSettings._meta.get_field("drain_poll_s").get_default()
    return [
        pk
        for pk, cluster_id, updated_at in candidates
        if (now - updated_at).total_seconds()
        > max(older_than_s, 3 * float(poll_s.get(cluster_id, default_poll_s)))
    ]


def plans_in_flight(cluster: Cluster) -> QuerySet[Plan]:
    return Plan.objects.filter(cluster=cluster).filter(Q(status__in=IN_FLIGHT))


def plans_snapshot() -> dict[str, Any]:
    """The ``plans`` group's snapshot: each recent plan's id, status and version."""
    return {
        "plans": [
            {"id": p.pk, "status": p.status, "version": p.version, "cluster": p.cluster.name}
            for p in plan_list(limit=100)
        ]
    }


def plan_observed(plan: Plan, now: float | None = None) -> dict[str, Any] | None:
    """What the fleet did after the plan was applied (None before), from the first whole
    minute after ``applied_at`` (the traffic store's grain) to now, or to its roll-back: the
    window (``start``, ``end``, ``since_s``), the cluster's arrivals and offered rate (per
    second of the fleet's clock), offloaded share, ``link_congested`` share of decisions, the
    share of the offloads offered to its links that their guard kept local, and the mean egress
    of those links over the part of the window the bandwidth store still holds."""
    if plan.applied_at is None:
        return None
    now = time.time() if now is None else now
    end = min(now, plan.rolled_back_at.timestamp()) if plan.rolled_back_at else now
    # The traffic store counts whole minutes: from the first minute that began after the apply.
    start = math.ceil(plan.applied_at.timestamp() / 60) * 60
    span = max(0.0, end - start)
    out: dict[str, Any] = {"start": start, "end": end, "since_s": span, "arrivals": 0}
    if span < 1:
        return out
    window = traffic_window_read(plan.cluster.name, start, end)
    links = Link.objects.filter(target=plan.cluster).select_related("source", "target")
    held_from = max(start, end - BANDWIDTH_RETENTION_S)
    sent = carried = refused = 0.0
    for link in links:
        key = link.key
        sent += sum(g for _, g in link_bandwidth_series(key, held_from, end))
        carried += window.link_offloads.get(key, 0)
        refused += sum(window.link_refusals.get(key, {}).values())
    arrivals = window.arrivals
    out.update(
        arrivals=arrivals,
        offered_rps=fleet_rate(arrivals, span) if arrivals else None,
        offload_fraction=window.offload_fraction if arrivals else None,
        link_congested=window.reasons.get("link_congested", 0) / arrivals if arrivals else None,
        refused_share=refused / (carried + refused) if carried + refused else None,
        egress_gbps=sent / max(1.0, end - held_from),
        egress_from=held_from,
    )
    return out
