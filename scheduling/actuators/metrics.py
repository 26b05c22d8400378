"""The ``metrics`` actuator: for operators whose HPA or KEDA does the scaling. A role change
publishes the desired replica count of both roles (``prfaas_desired_replicas`` on ``/metrics``,
with the plan's id) instead of scaling anything, so the control plane needs no write access to
the cluster. Which pod the autoscaler then removes is its controller's choice.

Idempotent like every actuator: the counts are decided on the first call and kept in the
step's memo; the rows are then set to them (not moved by one), so a retried step sets the same
counts again.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from clusters.models import Instance, InstanceState
from scheduling.actuators.base import StepNotice, StepReport
from scheduling.models import DesiredReplicas


def desired_replicas_current(cluster_id: int, role: str) -> tuple[int, int | None]:
    """A role's desired count and the plan that set it; before any plan, the inventory's
    instances of that role that are not down (and no plan)."""
    row = DesiredReplicas.objects.filter(cluster_id=cluster_id, role=role).first()
    if row is not None:
        return row.replicas, row.plan_id
    count = (
        Instance.objects.filter(cluster_id=cluster_id, role=role)
        .exclude(state=InstanceState.DOWN)
        .count()
    )
    return count, None


class MetricsActuator:
    name = "metrics"
    replaces_instances = False

    def __init__(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id

    def notify(self, notice: StepNotice) -> StepReport | None:
        if notice.action != "flip":
            return None
        memo: dict[str, Any] = dict(notice.memo)
        if "desired" not in memo:
            source, _ = desired_replicas_current(self.cluster_id, notice.from_role)
            dest, _ = desired_replicas_current(self.cluster_id, notice.to_role)
            memo["desired"] = {notice.from_role: max(0, source - 1), notice.to_role: dest + 1}
            return StepReport(done=False, memo=memo, detail="desired replicas decided")
        with transaction.atomic():
            for role, replicas in sorted(memo["desired"].items()):
                DesiredReplicas.objects.update_or_create(
                    cluster_id=self.cluster_id,
                    role=role,
                    defaults={"replicas": replicas, "plan_id": notice.plan_id},
                )
        desired = ", ".join(f"{r} {n}" for r, n in sorted(memo["desired"].items()))
        return StepReport(memo=memo, detail=f"desired replicas: {desired}")
