"""Plans: the Django side of the long-term rebalancer (services and selectors).

``rebalance_tick`` runs the pure decision (:func:`scheduling.rebalancer.rebalance_decide`) for
one PD cluster and period on the observed traffic window and the inventory, and records the
outcome exactly once per tick id ``(cluster, period_start)``: a unique constraint, not a lock,
makes a second beat or a retry of the same period return the first tick's row.

A proposal becomes a :class:`~scheduling.models.Plan`. In ``manual`` mode it waits for
``plan_approve`` or ``plan_reject``; in ``auto`` mode the tick approves it itself. Approval
starts the apply: a list of :class:`~scheduling.models.PlanStep` rows (per role change: drain,
wait until telemetry shows the instance empty or the drain timeout passes, flip the role,
activate; then publish the new threshold as a new policy version). ``plan_apply_step`` runs the
next pending step and says what to do next; the Celery task re-schedules itself for waits
(a worker never sleeps on a drain). Each step checks the state it wants before acting and is
marked done in the same transaction as its change, so a retry after a crash finishes the plan
without applying anything twice. ``plan_rollback`` restores the previous threshold and roles
the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from django.conf import settings as django_settings
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from clusters.live.telemetry import instance_states_read
from clusters.models import Cluster, ClusterKind, Instance, InstanceState
from clusters.services import instance_activate, instance_drain, instance_update
from controlplane.audit import Actor, change_record_create
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.live import OVERVIEW, PLANS, PlanEvent, live_publish
from scheduling import rebalance_simulation, rebalancer
from scheduling.actuators import Actuator, ActuatorError, StepNotice, actuator_for
from scheduling.models import (
    Plan,
    PlanStatus,
    PlanStep,
    Policy,
    RebalanceMode,
    RebalanceSettings,
    RebalanceTick,
)
from scheduling.policies import policy_create, policy_current
from scheduling.scenario import ScenarioError
from scheduling.snapshot import DEFAULT_THRESHOLD_TOKENS, snapshot_version_bump
from scheduling.traffic import traffic_window_read

SYSTEM_ACTOR = Actor(label="rebalancer", source="celery")
IN_FLIGHT = (PlanStatus.APPROVED, PlanStatus.APPLYING, PlanStatus.ROLLING_BACK)
# Hold reasons that keep a candidate pending, so persistence can count consecutive ticks.
PENDING_REASONS = (
    rebalancer.HOLD_AWAITING_PERSISTENCE,
    rebalancer.HOLD_REVERSAL_LIMITED,
    rebalancer.HOLD_COOLDOWN,
)
HOLD_PLAN_IN_PROGRESS = "plan_in_progress"
HOLD_INVENTORY_INCOMPLETE = "inventory_incomplete"
MAX_STEP_ATTEMPTS = 5
STEP_RETRY_S = 10.0
WARMUP_S = 60.0

StepOutcome = tuple[Literal["next", "wait", "done", "idle"], float]

# Builds the planner port of a cluster (tests may pass their own).
PlannerFactory = Callable[[Cluster, Mapping[str, Any]], rebalancer.PlannerPort]


# ---------------------------------------------------------------------------------------------
# Selectors


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


def guards_for(settings_row: RebalanceSettings) -> rebalancer.Guards:
    try:
        return rebalancer.Guards().with_overrides(dict(settings_row.guards or {}))
    except (TypeError, ValueError) as exc:
        raise Invalid(f"guards: {exc}") from exc


def period_start_for(now: float, interval_s: float | None = None) -> datetime:
    """The start of the rebalancing period holding ``now`` (the tick id's time part)."""
    interval = float(interval_s or django_settings.REBALANCE_INTERVAL_S)
    return datetime.fromtimestamp(math.floor(now / interval) * interval, tz=UTC)


# ---------------------------------------------------------------------------------------------
# Settings


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
        if row.actuator == "webhook":
            try:
                actuator_for("webhook", url=row.webhook_url, secret=row.webhook_secret)
            except ActuatorError as exc:
                raise Invalid(f"webhook: {exc}") from exc
        elif row.actuator != "record":
            raise Invalid("actuator: must be record or webhook")
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


# ---------------------------------------------------------------------------------------------
# Inputs of a tick


def window_from_traffic(
    raw: Any, *, recorder_seen_at: float | None, default_output_tokens: float
) -> rebalancer.TrafficWindow:
    """The rebalancer's window from the traffic store's (``scheduling.traffic.TrafficWindow``).

    Routers rarely know output lengths; without any, the cluster's configured mean is used.
    The recorder's liveness is the freshest telemetry of the cluster's instances: with fresh
    telemetry and no recorded request, the traffic really was zero.
    """
    output_mean = (
        raw.output_tokens / raw.output_known if raw.output_known else float(default_output_tokens)
    )
    return rebalancer.TrafficWindow(
        start_s=raw.start,
        end_s=raw.end,
        arrivals=raw.arrivals,
        offloads=raw.offloads,
        incremental_tokens=rebalancer.histogram_points(raw.bin_edges, raw.histogram),
        output_tokens_mean=output_mean,
        cache_hit_tokens=float(raw.cache_hit_tokens),
        prompt_tokens=float(raw.cache_hit_tokens + raw.incremental_tokens),
        samples=raw.minutes,
        bucket_s=60.0,
        recorder_seen_at=recorder_seen_at,
    )


def instance_views(
    instances: list[Instance], samples: Mapping[str, Any], now: float, warmup_s: float
) -> tuple[rebalancer.InstanceView, ...]:
    out = []
    for inst in instances:
        sample = samples.get(inst.name)
        out.append(
            rebalancer.InstanceView(
                name=inst.name,
                role=inst.role,  # type: ignore[arg-type]
                state=inst.state,  # type: ignore[arg-type]
                warming_up=inst.state == InstanceState.ACTIVE
                and now - inst.updated_at.timestamp() < warmup_s,
                load=(
                    float(sample.queue_depth + sample.running + sample.waiting)
                    if sample is not None
                    else None
                ),
                seen_at=sample.ts if sample is not None else None,
            )
        )
    return tuple(out)


def history_for(cluster: Cluster, period_start: datetime) -> rebalancer.History:
    """What earlier ticks and plans of the cluster mean for anti-flapping: the applied (and
    rolled back) plans replayed in order, and the candidate the previous tick kept pending."""
    changes: list[tuple[float, int, int]] = []
    done = Plan.objects.filter(
        cluster=cluster, applied_at__isnull=False, applied_at__lt=period_start
    ).order_by("-applied_at")[:50]
    for plan in done:
        assert plan.applied_at is not None
        split = (plan.n_p_after > plan.n_p_before) - (plan.n_p_after < plan.n_p_before)
        thr = (plan.threshold_after > plan.threshold_before) - (
            plan.threshold_after < plan.threshold_before
        )
        changes.append((plan.applied_at.timestamp(), split, thr))
        if plan.rolled_back_at is not None and plan.rolled_back_at < period_start:
            changes.append((plan.rolled_back_at.timestamp(), -split, -thr))
    history = rebalancer.History()
    for at, split, thr in sorted(changes):
        history = rebalancer.history_record_change(history, at, split, thr)
    interval = float(django_settings.REBALANCE_INTERVAL_S)
    previous = (
        RebalanceTick.objects.filter(
            cluster=cluster,
            period_start__lt=period_start,
            period_start__gte=period_start - timedelta(seconds=2 * interval),
        )
        .order_by("-period_start")
        .first()
    )
    if previous is not None and previous.reason in PENDING_REASONS and previous.pending_count:
        history = replace(
            history,
            pending=rebalancer.Pending(
                at=previous.period_start.timestamp(),
                split_direction=previous.split_direction,
                threshold_direction=rebalancer.threshold_move(
                    previous.split_direction, previous.threshold_direction
                ),
                count=previous.pending_count,
            ),
        )
    return history


def planner_for_cluster(cluster: Cluster, context: Mapping[str, Any]) -> rebalancer.FleetPlanner:
    """The planner port for one PD cluster alone, over the inventory as a scenario; PrfaaS
    clusters count only their active instances. (The tick plans jointly with the PD clusters
    sharing its PrfaaS clusters: :func:`scheduling.rebalance_simulation.planner_joint`.)"""
    return rebalancer.FleetPlanner(rebalance_simulation.inventory_fleet(), cluster.name)


def _tick_context(
    window: rebalancer.TrafficWindow,
    start: float,
    end: float,
    row: RebalanceSettings,
    policy: Policy | None,
) -> dict[str, Any]:
    """What the planner port and the proposal's simulation read of other PD clusters: their
    traffic windows over the same period and the thresholds routers apply to them."""

    def window_of(peer: Cluster) -> rebalancer.TrafficWindow:
        peer_row = rebalance_settings_for(peer)
        return window_from_traffic(
            traffic_window_read(peer.name, start, end),
            recorder_seen_at=end,
            default_output_tokens=peer_row.default_output_tokens or row.default_output_tokens,
        )

    return {
        "window": window,
        "window_of": window_of,
        "threshold_of": lambda peer: policy_threshold(policy, peer),
    }


def policy_threshold(policy: Policy | None, cluster: Cluster) -> float:
    """The threshold routers apply to ``cluster`` now (the snapshot's rule, default included)."""
    if policy is None:
        return float(DEFAULT_THRESHOLD_TOKENS)
    return float(policy.thresholds.get(cluster.name, DEFAULT_THRESHOLD_TOKENS))


def _prediction_json(p: rebalancer.Prediction | None) -> dict[str, Any] | None:
    return asdict(p) if p is not None else None


# ---------------------------------------------------------------------------------------------
# The tick


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
    window_s = float(
        getattr(django_settings, "REBALANCE_WINDOW_S", 0) or django_settings.REBALANCE_INTERVAL_S
    )
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
    factory = planner_factory or rebalance_simulation.planner_joint
    context = _tick_context(window, end - window_s, end, row, policy)
    simulated: dict[str, Any] | None = None
    # Data problems hold before the planner is even built (the fleet may be incomplete too).
    decision = rebalancer.window_problem(window, now, guards) or rebalancer.fleet_problem(
        views, now, guards
    )
    if decision is None:
        try:
            port = factory(cluster, context)
        except (ScenarioError, KeyError, AssertionError, ValueError) as exc:
            decision = rebalancer.Decision(
                action="hold",
                reason=HOLD_INVENTORY_INCOMPLETE,
                detail=f"the inventory cannot be planned: {exc}",
            )
        else:
            decision = rebalancer.rebalance_decide(decision_input, port)
            # Proposals are simulated on the recent traffic before they are shown.
            decision, simulated = rebalance_simulation.proposal_check(cluster, decision, context)
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
                    "current": _prediction_json(decision.current),
                    "proposed": _prediction_json(decision.proposed),
                    "target": _prediction_json(decision.target),
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
    decision: rebalancer.Decision,
    policy: Policy | None,
    actor: Actor,
) -> Plan | None:
    assert decision.current is not None and decision.proposed is not None
    if Plan.objects.select_for_update().filter(cluster=cluster, status__in=IN_FLIGHT).exists():
        tick.action = "hold"
        tick.reason = HOLD_PLAN_IN_PROGRESS
        tick.detail = "another plan of this cluster is being applied or rolled back"
        tick.save(update_fields=["action", "reason", "detail"])
        return None
    for old in Plan.objects.select_for_update().filter(cluster=cluster, status=PlanStatus.PROPOSED):
        _transition(old, PlanStatus.SUPERSEDED, actor, "supersede", closed_at=timezone.now())
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
        actor=actor, action="propose", obj=plan, before=None, after=_plan_state(plan)
    )
    _event(plan, actor)
    if row.mode == RebalanceMode.AUTO:
        _approve(plan, actor)
    return plan


# ---------------------------------------------------------------------------------------------
# Lifecycle


def _plan_state(plan: Plan) -> dict[str, Any]:
    return {
        "status": plan.status,
        "version": plan.version,
        "threshold_before": plan.threshold_before,
        "threshold_after": plan.threshold_after,
        "n_p_before": plan.n_p_before,
        "n_d_before": plan.n_d_before,
        "n_p_after": plan.n_p_after,
        "n_d_after": plan.n_d_after,
        "role_changes": plan.role_changes,
        "policy_version_after": plan.policy_version_after,
    }


def _event(plan: Plan, actor: Actor, state: str | None = None) -> None:
    """A live event after commit, to the plans pages and the overview (which shows plans)."""
    event = PlanEvent(
        plan_id=plan.pk, state=state or plan.status, ts=time.time(), actor=actor.label
    )
    live_publish(PLANS, event)
    live_publish(OVERVIEW, event)


def _transition(plan: Plan, status: str, actor: Actor, action: str, **fields: Any) -> None:
    before = _plan_state(plan)
    plan.status = status
    plan.version += 1
    for name, value in fields.items():
        setattr(plan, name, value)
    plan.save()
    change_record_create(
        actor=actor, action=action, obj=plan, before=before, after=_plan_state(plan)
    )
    _event(plan, actor)


def _locked(plan_id: int) -> Plan:
    plan = Plan.objects.select_for_update().filter(pk=plan_id).first()
    if plan is None:
        raise NotFound(f"plan {plan_id} does not exist")
    return plan


def _illegal(plan: Plan, what: str) -> Conflict:
    return Conflict(
        f"plan {plan.pk} is {plan.status}: it cannot be {what}", code="illegal_transition"
    )


def _check_version(plan: Plan, version: int | None) -> None:
    if version is not None and version != plan.version:
        raise Conflict(
            f"plan {plan.pk} is at version {plan.version}, not {version}", code="stale_version"
        )


def plan_approve(*, plan_id: int, actor: Actor, version: int | None = None) -> Plan:
    """An operator approves a proposed plan; applying it starts right away."""
    with transaction.atomic():
        plan = _locked(plan_id)
        _check_version(plan, version)
        if plan.status != PlanStatus.PROPOSED:
            raise _illegal(plan, "approved")
        _approve(plan, actor)
    return plan


def _approve(plan: Plan, actor: Actor) -> None:
    _stale_check(plan)
    if (
        Plan.objects.filter(cluster_id=plan.cluster_id, status__in=IN_FLIGHT)
        .exclude(pk=plan.pk)
        .exists()
    ):
        raise Conflict(
            "another plan of this cluster is being applied or rolled back", code="plan_in_progress"
        )
    now = timezone.now()
    _transition(
        plan, PlanStatus.APPROVED, actor, "approve", approved_by=actor.label, approved_at=now
    )
    _steps_create(plan, PlanStep.Phase.APPLY)
    _transition(plan, PlanStatus.APPLYING, actor, "apply", applying_at=now)
    _enqueue_step(plan.pk)


def _stale_check(plan: Plan) -> None:
    """Refuse a plan whose instances no longer are what it was computed from."""
    for change in plan.role_changes:
        inst = Instance.objects.filter(name=change["instance"], cluster_id=plan.cluster_id).first()
        if inst is None or inst.state != InstanceState.ACTIVE or inst.role != change["from_role"]:
            raise Conflict(
                f"plan {plan.pk} is stale: {change['instance']} is no longer an active "
                f"{change['from_role']} instance",
                code="plan_stale",
            )


def plan_reject(*, plan_id: int, actor: Actor, version: int | None = None) -> Plan:
    """An operator turns a proposed plan down; nothing in the fleet changes."""
    with transaction.atomic():
        plan = _locked(plan_id)
        _check_version(plan, version)
        if plan.status != PlanStatus.PROPOSED:
            raise _illegal(plan, "rejected")
        _transition(
            plan,
            PlanStatus.REJECTED,
            actor,
            "reject",
            decided_by=actor.label,
            closed_at=timezone.now(),
        )
    return plan


def plan_rollback(*, plan_id: int, actor: Actor, version: int | None = None) -> Plan:
    """Undo an applied (or a failed, partly applied) plan: restore its previous threshold (as a
    new policy version) and flip its instances back through the same drain-then-flip steps;
    steps whose effect is already there (an instance never flipped) change nothing."""
    with transaction.atomic():
        plan = _locked(plan_id)
        _check_version(plan, version)
        if plan.status not in (PlanStatus.APPLIED, PlanStatus.FAILED):
            raise _illegal(plan, "rolled back")
        since = plan.applied_at or plan.applying_at or plan.proposed_at
        later = Plan.objects.filter(cluster_id=plan.cluster_id, applying_at__gt=since).exclude(
            pk=plan.pk
        )
        if later.exists():
            raise Conflict(
                f"a later plan of this cluster was applied after plan {plan.pk}; roll that back first",
                code="not_latest",
            )
        if Plan.objects.filter(cluster_id=plan.cluster_id, status__in=IN_FLIGHT).exists():
            raise Conflict(
                "another plan of this cluster is being applied or rolled back",
                code="plan_in_progress",
            )
        _steps_create(plan, PlanStep.Phase.ROLLBACK)
        _transition(plan, PlanStatus.ROLLING_BACK, actor, "rollback", rollback_at=timezone.now())
        _enqueue_step(plan.pk)
    return plan


def plan_resume(*, plan_id: int) -> Plan:
    """Re-drive a plan that is applying or rolling back (after a crash); a no-op otherwise.
    Steps already done are not done again."""
    plan = plan_get(plan_id)
    if plan.status in (PlanStatus.APPLYING, PlanStatus.ROLLING_BACK):
        transaction.on_commit(lambda: _enqueue_now(plan.pk))
    return plan


def plans_stalled(older_than_s: float) -> list[int]:
    """Plans applying or rolling back with no progress for ``older_than_s`` (crash recovery)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    return list(
        Plan.objects.filter(
            status__in=(PlanStatus.APPLYING, PlanStatus.ROLLING_BACK), updated_at__lt=cutoff
        ).values_list("pk", flat=True)
    )


def _steps_create(plan: Plan, phase: str) -> None:
    """The steps of a phase (idempotent: existing steps are kept)."""
    if plan.steps.filter(phase=phase).exists():
        return
    rollback = phase == PlanStep.Phase.ROLLBACK
    changes = list(reversed(plan.role_changes)) if rollback else list(plan.role_changes)
    index = 0
    for change in changes:
        inst = Instance.objects.get(name=change["instance"], cluster_id=plan.cluster_id)
        untouched = inst.role == change["from_role"] and inst.state == InstanceState.ACTIVE
        if rollback and untouched:
            continue  # a failed apply never reached this instance: leave it serving
        to_role = change["from_role"] if rollback else change["to_role"]
        for action in ("drain", "wait", "flip", "activate"):
            PlanStep.objects.create(
                plan=plan, phase=phase, index=index, action=action, instance=inst, to_role=to_role
            )
            index += 1
    PlanStep.objects.create(
        plan=plan,
        phase=phase,
        index=index,
        action="policy",
        threshold=plan.threshold_before if rollback else plan.threshold_after,
    )


def _enqueue_now(plan_id: int) -> None:
    from scheduling.tasks import plan_apply_step as task

    task.delay(plan_id)


def _enqueue_step(plan_id: int) -> None:
    transaction.on_commit(lambda: _enqueue_now(plan_id))


# ---------------------------------------------------------------------------------------------
# Applying, one step at a time


def _actuator(cluster: Cluster) -> Actuator:
    row = rebalance_settings_for(cluster)
    return actuator_for(row.actuator, url=row.webhook_url, secret=row.webhook_secret)


def _notice(plan: Plan, step: PlanStep) -> StepNotice:
    return StepNotice(
        plan_id=plan.pk,
        step=step.index,
        action=step.action,
        cluster=plan.cluster.name,
        instance=step.instance.name if step.instance else "",
        to_role=step.to_role,
        threshold=step.threshold,
        rollback=step.phase == PlanStep.Phase.ROLLBACK,
    )


def _pending_step(plan: Plan) -> PlanStep | None:
    phase = (
        PlanStep.Phase.ROLLBACK if plan.status == PlanStatus.ROLLING_BACK else PlanStep.Phase.APPLY
    )
    return (
        plan.steps.select_related("instance")
        .filter(phase=phase, status=PlanStep.Status.PENDING)
        .order_by("index")
        .first()
    )


def plan_apply_step(*, plan_id: int, actor: Actor = SYSTEM_ACTOR) -> StepOutcome:
    """Run the next pending step of an applying (or rolling-back) plan.

    Returns ``("next", 0)`` when another step can run now, ``("wait", seconds)`` when the
    step must be polled again later (drain not finished, actuator retry), ``("done", 0)``
    when the plan just finished, and ``("idle", 0)`` when there is nothing to do.
    """
    # 1. Claim the step: record the attempt (and the start time) durably.
    with transaction.atomic():
        plan = _locked(plan_id)
        if plan.status not in (PlanStatus.APPLYING, PlanStatus.ROLLING_BACK):
            return ("idle", 0.0)
        step = _pending_step(plan)
        if step is None:
            _finish(plan, actor)
            return ("done", 0.0)
        step.attempts += 1
        step.started_at = step.started_at or timezone.now()
        step.save(update_fields=["attempts", "started_at"])
        plan.save(update_fields=["updated_at"])
    # 2. The actuator acts outside any transaction (it may be slow); its key makes repeats safe.
    if step.action != "wait":
        try:
            _actuator(plan.cluster).notify(_notice(plan, step))
        except ActuatorError as exc:
            return _step_failed(plan_id, step.pk, str(exc), actor)
    # 3. Make the control plane's change and mark the step done, together.
    with transaction.atomic():
        plan = _locked(plan_id)
        fresh = (
            PlanStep.objects.select_for_update(of=("self",))
            .select_related("instance")
            .get(pk=step.pk)
        )
        if fresh.status != PlanStep.Status.PENDING or plan.status not in (
            PlanStatus.APPLYING,
            PlanStatus.ROLLING_BACK,
        ):
            return ("next", 0.0)  # someone else did it meanwhile
        wait = _step_run(plan, fresh, actor)
        if wait is not None:
            plan.save(update_fields=["updated_at"])
            return ("wait", wait)
        fresh.status = PlanStep.Status.DONE
        fresh.finished_at = timezone.now()
        fresh.save(update_fields=["status", "finished_at", "detail"])
        change_record_create(
            actor=actor,
            action=fresh.action,
            obj=plan,
            before=None,
            after={
                "phase": fresh.phase,
                "step": fresh.index,
                "action": fresh.action,
                "instance": fresh.instance.name if fresh.instance else None,
                "to_role": fresh.to_role or None,
                "threshold": fresh.threshold,
                "detail": fresh.detail,
            },
        )
        _event(plan, actor, state=f"{plan.status}:{fresh.action}")
    return ("next", 0.0)


def _step_failed(plan_id: int, step_id: int, error: str, actor: Actor) -> StepOutcome:
    with transaction.atomic():
        plan = _locked(plan_id)
        step = PlanStep.objects.select_for_update().get(pk=step_id)
        step.detail = error[:2000]
        if step.attempts < MAX_STEP_ATTEMPTS:
            step.save(update_fields=["detail"])
            return ("wait", STEP_RETRY_S * step.attempts)
        step.status = PlanStep.Status.FAILED
        step.finished_at = timezone.now()
        step.save(update_fields=["detail", "status", "finished_at"])
        _transition(
            plan,
            PlanStatus.FAILED,
            actor,
            "fail",
            error=f"step {step.index} ({step.action}) failed: {error}"[:4000],
            closed_at=timezone.now(),
        )
    return ("idle", 0.0)


def _step_run(plan: Plan, step: PlanStep, actor: Actor) -> float | None:
    """Carry one step out if its effect is not already there; seconds to wait, or None."""
    if step.action == "policy":
        _step_policy(plan, step, actor)
        return None
    assert step.instance is not None
    inst = Instance.objects.select_for_update().get(pk=step.instance.pk)
    # The inventory services write with queryset updates (no post_save), so tell the routers'
    # snapshots ourselves: a draining instance must stop getting work at once.
    transaction.on_commit(snapshot_version_bump)
    if step.action == "drain":
        if inst.state == InstanceState.ACTIVE:
            instance_drain(instance_id=inst.pk, actor=actor, version=inst.version)
            step.detail = "drained"
        else:
            step.detail = f"already {inst.state}"
        return None
    if step.action == "wait":
        return _step_wait(plan, step, inst)
    if step.action == "flip":
        if inst.role != step.to_role:
            instance_update(
                instance_id=inst.pk,
                version=inst.version,
                changes={"role": step.to_role},
                actor=actor,
            )
            step.detail = f"now {step.to_role}"
        else:
            step.detail = f"already {step.to_role}"
        return None
    if step.action == "activate":
        if inst.state != InstanceState.ACTIVE:
            instance_activate(instance_id=inst.pk, actor=actor, version=inst.version)
            step.detail = "activated"
        else:
            step.detail = "already active"
        return None
    raise ValueError(f"unknown step action {step.action!r}")


def _step_wait(plan: Plan, step: PlanStep, inst: Instance) -> float | None:
    row = rebalance_settings_for(plan.cluster)
    drained_at = (
        plan.steps.filter(phase=step.phase, index=step.index - 1)
        .values_list("finished_at", flat=True)
        .first()
    ) or step.started_at
    assert drained_at is not None
    sample = instance_states_read([inst.name]).get(inst.name)
    if (
        sample is not None
        and sample.ts >= drained_at.timestamp()
        and sample.queue_depth + sample.running + sample.waiting == 0
    ):
        step.detail = "empty"
        return None
    waited = timezone.now() - drained_at
    if waited.total_seconds() >= row.drain_timeout_s:
        step.detail = f"drain timeout after {waited.total_seconds():.0f} s"
        return None
    return float(row.drain_poll_s)


def _step_policy(plan: Plan, step: PlanStep, actor: Actor) -> None:
    rollback = step.phase == PlanStep.Phase.ROLLBACK
    current = policy_current()
    thresholds = dict(current.thresholds) if current is not None else {}
    guards = dict(current.guards) if current is not None else {}
    assert step.threshold is not None
    thresholds[plan.cluster.name] = round(step.threshold)
    policy = policy_create(
        actor=actor,
        thresholds=thresholds,
        guards=guards,
        note=f"plan {plan.pk} {'rollback' if rollback else 'apply'}",
        expected_version=current.version if current is not None else 0,
    )
    if rollback:
        plan.policy_version_restored = policy.version
    else:
        plan.policy_version_after = policy.version
    plan.save(update_fields=["policy_version_after", "policy_version_restored", "updated_at"])
    step.detail = f"policy v{policy.version}: {plan.cluster.name} t={thresholds[plan.cluster.name]}"


def _finish(plan: Plan, actor: Actor) -> None:
    if plan.status == PlanStatus.ROLLING_BACK:
        _transition(
            plan, PlanStatus.ROLLED_BACK, actor, "rolled_back", rolled_back_at=timezone.now()
        )
    else:
        _transition(plan, PlanStatus.APPLIED, actor, "applied", applied_at=timezone.now())


def plans_in_flight(cluster: Cluster) -> QuerySet[Plan]:
    return Plan.objects.filter(cluster=cluster).filter(Q(status__in=IN_FLIGHT))


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
