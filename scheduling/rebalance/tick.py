"""The rebalance tick: the Django side of :func:`scheduling.core.rebalancer.rebalance_decide`.

``rebalance_tick`` runs the pure decision for one PD cluster and period on the observed traffic
window and the inventory, and records the outcome exactly once per tick id
``(cluster, period_start)``: a unique constraint, not a lock, makes a second beat or a retry of
the same period return the first tick's row. A proposal becomes a
:class:`~scheduling.models.Plan`; in ``auto`` mode the tick approves it itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings as django_settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from clusters.live.telemetry import instance_states_read
from clusters.models import Cluster, ClusterKind, Instance
from controlplane.audit import Actor, change_record_create
from controlplane.errors import Invalid, NotFound
from scheduling.actuator_process import actuator_of
from scheduling.actuators import ActuatorError
from scheduling.core import rebalancer
from scheduling.core.scenario import ScenarioError
from scheduling.models import (
    Plan,
    PlanStatus,
    Policy,
    RebalanceMode,
    RebalanceSettings,
    RebalanceTick,
)
from scheduling.policies import policy_current
from scheduling.rebalance.inputs import (
    HOLD_INVENTORY_INCOMPLETE,
    HOLD_PLAN_IN_PROGRESS,
    HOLD_PLAN_UNDER_REVIEW,
    WARMUP_S,
    PlannerFactory,
    history_for,
    instance_views,
    policy_threshold,
    prediction_json,
    tick_context,
    window_from_traffic,
)
from scheduling.rebalance.lifecycle import (
    cluster_plans_lock,
    plan_approve_locked,
    plan_event_publish,
    plan_state,
    plan_transition,
)
from scheduling.rebalance.selectors import (
    IN_FLIGHT,
    SYSTEM_ACTOR,
    guards_for,
    rebalance_settings_for,
)
from scheduling.rebalance.simulation import planner_joint, proposal_check
from scheduling.traffic import traffic_window_read


def rebalance_settings_update(
    *, cluster_id: int, changes: Mapping[str, Any], actor: Actor
) -> RebalanceSettings:
    """Store a PD cluster's rebalancer settings (mode, guard overrides, actuator)."""
    allowed = {
        "enabled",
        "mode",
        "guards",
        "drain_timeout_s",
        "drain_poll_s",
        "default_output_tokens",
        "actuator",
        "webhook_url",
        "webhook_secret",
    }
    unknown = sorted(set(changes) - allowed)
    if unknown:
        raise Invalid(f"unknown setting(s): {', '.join(unknown)}")
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        raise NotFound(f"cluster {cluster_id} does not exist")
    if cluster.kind != ClusterKind.PD:
        raise Invalid(f"{cluster.name} is a {cluster.kind} cluster: only pd clusters rebalance")
    with transaction.atomic():
        row, _ = RebalanceSettings.objects.select_for_update().get_or_create(cluster=cluster)
        before = _settings_snapshot(row)
        for name, value in changes.items():
            setattr(row, name, value)
        if row.mode not in RebalanceMode.values:
            raise Invalid(f"mode: must be one of {', '.join(RebalanceMode.values)}")
        guards_for(row)
        if row.actuator in ("webhook", "process"):
            try:
                actuator_of(row.actuator, url=row.webhook_url, secret=row.webhook_secret)
            except ActuatorError as exc:
                raise Invalid(f"webhook: {exc}") from exc
        elif row.actuator != "record":
            raise Invalid("actuator: must be record, webhook or process")
        row.version += 1
        row.save()
        change_record_create(
            actor=actor, action="update", obj=row, before=before, after=_settings_snapshot(row)
        )
    return row


def _settings_snapshot(row: RebalanceSettings) -> dict[str, Any]:
    return {
        "enabled": row.enabled,
        "mode": row.mode,
        "guards": row.guards,
        "drain_timeout_s": row.drain_timeout_s,
        "actuator": row.actuator,
        "webhook_url": row.webhook_url,
        "webhook_secret": "***" if row.webhook_secret else "",
    }


def rebalance_tick(
    *,
    cluster_id: int,
    period_start: datetime,
    now: float | None = None,
    actor: Actor = SYSTEM_ACTOR,
    planner_factory: PlannerFactory | None = None,
) -> RebalanceTick:
    """Decide once for ``(cluster, period_start)``; a repeat returns the recorded tick."""
    existing = RebalanceTick.objects.filter(
        cluster_id=cluster_id, period_start=period_start
    ).first()
    if existing is not None:
        return existing
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        raise NotFound(f"cluster {cluster_id} does not exist")
    if cluster.kind != ClusterKind.PD:
        raise Invalid(f"{cluster.name} is a {cluster.kind} cluster: only pd clusters rebalance")
    now = time.time() if now is None else now
    row = rebalance_settings_for(cluster)
    guards = guards_for(row)
    window_s = float(django_settings.REBALANCE_WINDOW_S or django_settings.REBALANCE_INTERVAL_S)
    end = period_start.timestamp()
    instances = list(Instance.objects.filter(cluster=cluster).order_by("name"))
    samples = instance_states_read([i.name for i in instances]) if instances else {}
    seen = [s.ts for s in samples.values()]
    raw = traffic_window_read(cluster.name, end - window_s, end)
    window = window_from_traffic(
        raw,
        recorder_seen_at=max(seen) if seen else None,
        default_output_tokens=row.default_output_tokens,
    )
    views = instance_views(instances, samples, now, WARMUP_S)
    policy = policy_current()
    threshold = policy_threshold(policy, cluster)
    history = history_for(cluster, period_start)
    inputs = {
        "window": asdict(window),
        "reasons": dict(raw.reasons),
        "fleet": [asdict(v) for v in views],
        "policy_version": policy.version if policy is not None else None,
        "threshold": threshold,
        "guards": asdict(guards),
        "history": asdict(history),
        "now": now,
    }
    decision_input = rebalancer.RebalanceInput(
        cluster=cluster.name,
        now=now,
        window=window,
        instances=views,
        threshold=threshold,
        guards=guards,
        history=history,
    )
    factory = planner_factory or planner_joint
    context = tick_context(window, end - window_s, end, row, policy)
    simulated: dict[str, Any] | None = None
    # Data problems hold before the planner is even built (the fleet may be incomplete too).
    decision = rebalancer.window_problem(window, now, guards) or rebalancer.fleet_problem(
        views, now, guards
    )
    if decision is None:
        try:
            port = factory(cluster, context)
        except (ScenarioError, KeyError, AssertionError, ValueError) as exc:
            decision = rebalancer.RebalanceDecision(
                action="hold",
                reason=HOLD_INVENTORY_INCOMPLETE,
                detail=f"the inventory cannot be planned: {exc}",
            )
        else:
            decision = rebalancer.rebalance_decide(decision_input, port)
            # Proposals are simulated on the recent traffic before they are shown.
            decision, simulated = proposal_check(cluster, decision, context)
    next_history = rebalancer.history_after(history, decision, now, applied=False)
    try:
        with transaction.atomic():
            tick = RebalanceTick.objects.create(
                cluster=cluster,
                period_start=period_start,
                action=decision.action,
                reason=decision.reason,
                detail=decision.detail,
                gain=decision.gain
                if decision.gain is not None and math.isfinite(decision.gain)
                else None,
                split_direction=decision.split_direction,
                threshold_direction=decision.threshold_direction,
                pending_count=next_history.pending.count if next_history.pending else 0,
                inputs=inputs,
                predictions={
                    "current": prediction_json(decision.current),
                    "proposed": prediction_json(decision.proposed),
                    "target": prediction_json(decision.target),
                    "simulated": simulated,
                },
            )
            if decision.action == "propose":
                _plan_from_decision(tick, cluster, row, decision, policy, actor)
    except IntegrityError:
        # Another beat or a retry recorded this tick first: theirs is the one. (Any other
        # constraint, e.g. a second plan in flight, is not ours to swallow.)
        recorded = RebalanceTick.objects.filter(
            cluster_id=cluster_id, period_start=period_start
        ).first()
        if recorded is None:
            raise
        return recorded
    return tick


def _plan_from_decision(
    tick: RebalanceTick,
    cluster: Cluster,
    row: RebalanceSettings,
    decision: rebalancer.RebalanceDecision,
    policy: Policy | None,
    actor: Actor,
) -> Plan | None:
    assert decision.current is not None and decision.proposed is not None
    cluster_plans_lock(cluster.pk)
    if Plan.objects.select_for_update().filter(cluster=cluster, status__in=IN_FLIGHT).exists():
        tick.action = "hold"
        tick.reason = HOLD_PLAN_IN_PROGRESS
        tick.detail = "another plan of this cluster is being applied or rolled back"
        tick.save(update_fields=["action", "reason", "detail"])
        return None
    waiting = list(
        Plan.objects.select_for_update().filter(cluster=cluster, status=PlanStatus.PROPOSED)
    )
    stale_before = timezone.now() - timedelta(seconds=django_settings.PLAN_REVIEW_STALE_S)
    fresh = [p for p in waiting if p.proposed_at > stale_before]
    if fresh:
        # Nobody should read a plan that is replaced under their eyes: the newer proposal
        # waits (it is the tick's reasoning) until the one under review goes stale.
        age = (timezone.now() - fresh[0].proposed_at).total_seconds()
        tick.action = "hold"
        tick.reason = HOLD_PLAN_UNDER_REVIEW
        tick.detail = (
            f"plan {fresh[0].pk} is under review (proposed {age:.0f} s ago); this tick would "
            f"propose t={round(decision.proposed.setting.threshold)}, "
            f"{decision.proposed.setting.n_p}P/{decision.proposed.setting.n_d}D, and supersedes "
            f"it only once it is older than {django_settings.PLAN_REVIEW_STALE_S} s"
        )
        tick.save(update_fields=["action", "reason", "detail"])
        return None
    for old in waiting:
        plan_transition(
            old,
            PlanStatus.SUPERSEDED,
            actor,
            "supersede",
            closed_at=timezone.now(),
            closed_reason=f"stale: not reviewed within {django_settings.PLAN_REVIEW_STALE_S} s, "
            f"superseded by the proposal of tick {tick.pk}",
        )
    cur, new = decision.current.setting, decision.proposed.setting
    plan = Plan.objects.create(
        tick=tick,
        cluster=cluster,
        status=PlanStatus.PROPOSED,
        mode=row.mode,
        threshold_before=cur.threshold,
        threshold_after=float(round(new.threshold)),
        n_p_before=cur.n_p,
        n_d_before=cur.n_d,
        n_p_after=new.n_p,
        n_d_after=new.n_d,
        gain=decision.gain if decision.gain is not None and math.isfinite(decision.gain) else 1e9,
        role_changes=[asdict(c) for c in decision.role_changes],
        predictions=tick.predictions,
        simulated=tick.predictions.get("simulated") or {},
        inputs=tick.inputs,
        policy_version_before=policy.version if policy is not None else None,
    )
    change_record_create(
        actor=actor, action="propose", obj=plan, before=None, after=plan_state(plan)
    )
    plan_event_publish(plan, actor)
    if row.mode == RebalanceMode.AUTO:
        plan_approve_locked(plan, actor)
    return plan


def rebalance_run_now(
    *, cluster_ids: list[int], actor: Actor, now: float | None = None
) -> list[RebalanceTick]:
    """``POST /rebalance``: a tick per cluster now, its id the current time (not a period)."""
    now = time.time() if now is None else now
    start = datetime.fromtimestamp(now, tz=UTC)
    return [
        rebalance_tick(cluster_id=cid, period_start=start, now=now, actor=actor)
        for cid in cluster_ids
    ]


def rebalance_ticks_prune(*, older_than_days: float) -> int:
    """Retention: delete ticks that held (no plan) older than ``older_than_days``."""
    cutoff = timezone.now() - timedelta(days=older_than_days)
    deleted, _ = RebalanceTick.objects.filter(period_start__lt=cutoff, plan__isnull=True).delete()
    return deleted
