"""``prfaas_desired_replicas`` on ``/metrics``: what the ``metrics`` actuator asks an HPA or KEDA
for, per PD cluster and role, labelled with the plan that set it (``plan_id`` empty before any
plan: then the inventory's count of the role's instances that are not down)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from scheduling import metrics
from scheduling.actuators import desired_replicas_current
from scheduling.models import ActuatorKind, RebalanceSettings


def desired_replicas_list() -> list[tuple[str, str, int, int | None]]:
    """``(cluster, role, replicas, plan id)`` of every cluster whose actuator is ``metrics``."""
    rows = RebalanceSettings.objects.filter(actuator=ActuatorKind.METRICS).select_related("cluster")
    out = []
    for row in rows.order_by("cluster__name"):
        for role in ("prefill", "decode"):
            replicas, plan_id = desired_replicas_current(row.cluster_id, role)
            out.append((row.cluster.name, role, replicas, plan_id))
    return out


class DesiredReplicasCollector:
    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "prfaas_desired_replicas",
            "Replicas a PD cluster's role should run, as its latest plan set them (metrics "
            "actuator; scale on it with an HPA or KEDA)",
            labels=["cluster", "role", "plan_id"],
        )
        for cluster, role, replicas, plan_id in desired_replicas_list():
            gauge.add_metric([cluster, role, "" if plan_id is None else str(plan_id)], replicas)
        yield gauge


metrics.collector_register(DesiredReplicasCollector)
