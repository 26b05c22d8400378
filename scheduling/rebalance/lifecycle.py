"""A plan's lifecycle: approve, reject, roll back, resume; each transition audited and published.

In ``manual`` mode a proposed plan waits for ``plan_approve`` or ``plan_reject``. Approval (and
rollback) creates the plan's steps (per role change: drain, wait until telemetry shows the
instance empty or the drain timeout passes, flip the role, activate; then publish the new
threshold as a new policy version) and, after commit, enqueues the apply task by name (this
module does not import the task module that imports it).
"""

from __future__ import annotations

import time
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from clusters.models import Cluster, Instance, InstanceState
from controlplane.audit import Actor, change_record_create
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.live import OVERVIEW, PLANS, PlanEvent, live_publish
from scheduling.actuators import instance_pod
from scheduling.models import (
    ActuatorKind,
    Plan,
    PlanStatus,
    PlanStep,
)
from scheduling.rebalance.selectors import IN_FLIGHT, plan_get, rebalance_settings_for


def plan_state(plan: Plan) -> dict[str, Any]:
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


def plan_event_publish(plan: Plan, actor: Actor, state: str | None = None) -> None:
    """A live event after commit, to the plans pages and the overview (which shows plans)."""
    event = PlanEvent(
        plan_id=plan.pk, state=state or plan.status, ts=time.time(), actor=actor.label
    )
    live_publish(PLANS, event)
    live_publish(OVERVIEW, event)


def plan_transition(plan: Plan, status: str, actor: Actor, action: str, **fields: Any) -> None:
    before = plan_state(plan)
    plan.status = status
    plan.version += 1
    for name, value in fields.items():
        setattr(plan, name, value)
    plan.save()
    change_record_create(
        actor=actor, action=action, obj=plan, before=before, after=plan_state(plan)
    )
    plan_event_publish(plan, actor)


def plan_locked(plan_id: int) -> Plan:
    plan = Plan.objects.select_for_update().filter(pk=plan_id).first()
    if plan is None:
        raise NotFound(f"plan {plan_id} does not exist")
    return plan


def cluster_plans_lock(cluster_id: int) -> None:
    """Serialise the plan writes of one cluster (proposals, approvals) on its row: without it,
    two concurrent ticks each saw no proposed plan and both proposed, and two approvals each
    saw no plan in flight and the second failed on the database constraint (500). Always
    taken before any plan row, so the order cluster -> plan never deadlocks."""
    Cluster.objects.select_for_update().filter(pk=cluster_id).first()


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
        cluster_id = Plan.objects.filter(pk=plan_id).values_list("cluster_id", flat=True).first()
        if cluster_id is not None:
            cluster_plans_lock(cluster_id)
        plan = plan_locked(plan_id)
        _check_version(plan, version)
        if plan.status != PlanStatus.PROPOSED:
            raise _illegal(plan, "approved")
        plan_approve_locked(plan, actor)
    return plan


def plan_approve_locked(plan: Plan, actor: Actor) -> None:
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
    plan_transition(
        plan, PlanStatus.APPROVED, actor, "approve", approved_by=actor.label, approved_at=now
    )
    _steps_create(plan, PlanStep.Phase.APPLY)
    plan_transition(plan, PlanStatus.APPLYING, actor, "apply", applying_at=now)
    plan_apply_enqueue(plan.pk)


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


def plan_reject(
    *, plan_id: int, actor: Actor, version: int | None = None, reason: str = ""
) -> Plan:
    """An operator turns a proposed plan down, saying why; nothing in the fleet changes."""
    reason = reason.strip()
    if len(reason) > 500:
        raise Invalid("reason: at most 500 characters")
    with transaction.atomic():
        plan = plan_locked(plan_id)
        _check_version(plan, version)
        if plan.status != PlanStatus.PROPOSED:
            raise _illegal(plan, "rejected")
        plan_transition(
            plan,
            PlanStatus.REJECTED,
            actor,
            "reject",
            decided_by=actor.label,
            closed_at=timezone.now(),
            closed_reason=reason,
        )
    return plan


def plan_rollback(*, plan_id: int, actor: Actor, version: int | None = None) -> Plan:
    """Undo an applied (or a failed, partly applied) plan: restore its previous threshold (as a
    new policy version) and flip its instances back through the same drain-then-flip steps;
    steps whose effect is already there (an instance never flipped) change nothing."""
    with transaction.atomic():
        plan = plan_locked(plan_id)
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
        plan_transition(
            plan, PlanStatus.ROLLING_BACK, actor, "rollback", rollback_at=timezone.now()
        )
        plan_apply_enqueue(plan.pk)
    return plan


def plan_resume(*, plan_id: int) -> Plan:
    """Re-drive a plan that is applying or rolling back (after a crash); a no-op otherwise.
    Steps already done are not done again."""
    plan = plan_get(plan_id)
    if plan.status in (PlanStatus.APPLYING, PlanStatus.ROLLING_BACK):
        plan_apply_enqueue(plan.pk)
    return plan


def _steps_create(plan: Plan, phase: str) -> None:
    """The steps of a phase (idempotent: existing steps are kept)."""
    if plan.steps.filter(phase=phase).exists():
        return
    rollback = phase == PlanStep.Phase.ROLLBACK
    changes = list(reversed(plan.role_changes)) if rollback else list(plan.role_changes)
    replaces = rebalance_settings_for(plan.cluster).actuator == ActuatorKind.KUBERNETES
    index = 0
    for change in changes:
        inst = Instance.objects.get(name=change["instance"], cluster_id=plan.cluster_id)
        untouched = inst.role == change["from_role"] and inst.state == InstanceState.ACTIVE
        if rollback and untouched:
            continue  # a failed apply never reached this instance: leave it serving
        to_role = change["from_role"] if rollback else change["to_role"]
        seeds: dict[str, dict[str, Any]] = {}
        if rollback and replaces:
            inst, seeds = _rollback_replaced(plan, inst)
        for action in ("drain", "wait", "flip", "activate"):
            PlanStep.objects.create(
                plan=plan,
                phase=phase,
                index=index,
                action=action,
                instance=inst,
                to_role=to_role,
                actuation=seeds.get(action, {}),
            )
            index += 1
    PlanStep.objects.create(
        plan=plan,
        phase=phase,
        index=index,
        action="policy",
        threshold=plan.threshold_before if rollback else plan.threshold_after,
    )


def _rollback_replaced(plan: Plan, inst: Instance) -> tuple[Instance, dict[str, dict[str, Any]]]:
    """Undoing a change that replaced ``inst``'s pod (``kubernetes``): restore both roles'
    replica counts as the apply recorded them (the grown role shrinks removing the pod it
    gained, the shrunk one grows back), about the instance of the gained pod when it is in the
    inventory (so it is drained first), else about ``inst``. Returns that instance and the
    memos its drain and flip steps start with."""
    apply_flip = plan.steps.filter(
        phase=PlanStep.Phase.APPLY, instance_id=inst.pk, action="flip"
    ).first()
    memo = (apply_flip.actuation if apply_flip is not None else None) or {}
    shrink, grow = memo.get("shrink") or {}, memo.get("grow") or {}
    added = list(grow.get("added") or [])
    flip: dict[str, Any] = {"planned": True}
    if "from" in grow:
        flip["shrink"] = {
            "role": grow["role"],
            "from": grow["to"],
            "to": grow["from"],
            "remove": added[0] if added else "",
        }
    if "from" in shrink:
        flip["grow"] = {"role": shrink["role"], "from": shrink["to"], "to": shrink["from"]}
    gained = (
        Instance.objects.filter(cluster_id=plan.cluster_id)
        .filter(Q(name__in=added) | Q(labels__pod__in=added))
        .exclude(state=InstanceState.DOWN)
        .first()
        if added
        else None
    )
    if gained is not None:
        flip["shrink"]["remove"] = instance_pod(gained.name, gained.labels)
        return gained, {"flip": flip}
    drain = {"remove": added[0], "role": grow["role"]} if added else {"skip": True}
    return inst, {"drain": drain, "flip": flip}


#: The Celery task that runs a plan's steps (``scheduling.tasks.plan_apply_step``), sent by name:
#: the task module imports these services, so they must not import it.
PLAN_APPLY_STEP_TASK = "scheduling.plan_apply_step"


def _enqueue_now(plan_id: int) -> None:
    current_app.send_task(PLAN_APPLY_STEP_TASK, args=(plan_id,))


def plan_apply_enqueue(plan_id: int) -> None:
    """Start (or resume) applying a plan once the current transaction commits."""
    transaction.on_commit(lambda: _enqueue_now(plan_id))
