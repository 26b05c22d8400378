"""Applying a plan, one step at a time.

``plan_apply_step`` runs the next pending step and says what to do next; the Celery task
re-schedules itself for waits (a worker never sleeps on a drain). Each step checks the state it
wants before acting and is marked done in the same transaction as its change, so a retry after a
crash finishes the plan without applying anything twice. Rollback restores the previous
threshold and roles the same way.
"""

from __future__ import annotations

from typing import Literal

from django.db import transaction
from django.utils import timezone

from clusters.live.telemetry import instance_states_read
from clusters.models import Cluster, Instance, InstanceState
from clusters.services import instance_activate, instance_drain, instance_update
from controlplane.audit import Actor, change_record_create
from scheduling.actuator_process import actuator_of
from scheduling.actuators import Actuator, ActuatorError, StepNotice
from scheduling.models import (
    Plan,
    PlanStatus,
    PlanStep,
)
from scheduling.policies import policy_create, policy_current
from scheduling.rebalance.lifecycle import plan_event_publish, plan_locked, plan_transition
from scheduling.rebalance.selectors import SYSTEM_ACTOR, rebalance_settings_for
from scheduling.snapshot import snapshot_version_bump

MAX_STEP_ATTEMPTS = 5


STEP_RETRY_S = 10.0


StepOutcome = tuple[Literal["next", "wait", "done", "idle"], float]


def _actuator(cluster: Cluster) -> Actuator:
    row = rebalance_settings_for(cluster)
    return actuator_of(row.actuator, url=row.webhook_url, secret=row.webhook_secret)


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
        plan = plan_locked(plan_id)
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
        plan = plan_locked(plan_id)
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
        plan_event_publish(plan, actor, state=f"{plan.status}:{fresh.action}")
    return ("next", 0.0)


def _step_failed(plan_id: int, step_id: int, error: str, actor: Actor) -> StepOutcome:
    with transaction.atomic():
        plan = plan_locked(plan_id)
        step = PlanStep.objects.select_for_update().get(pk=step_id)
        step.detail = error[:2000]
        if step.attempts < MAX_STEP_ATTEMPTS:
            step.save(update_fields=["detail"])
            return ("wait", STEP_RETRY_S * step.attempts)
        step.status = PlanStep.Status.FAILED
        step.finished_at = timezone.now()
        step.save(update_fields=["detail", "status", "finished_at"])
        plan_transition(
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
        plan_transition(
            plan, PlanStatus.ROLLED_BACK, actor, "rolled_back", rolled_back_at=timezone.now()
        )
    else:
        plan_transition(plan, PlanStatus.APPLIED, actor, "applied", applied_at=timezone.now())
