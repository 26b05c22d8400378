"""Actuators: how an applied plan's steps reach the real fleet.

The control plane changes its own state (policy version, instance role and state) in every
case. An actuator is told about each step as well, so that the engines themselves change:

* ``record`` (default): nothing beyond the control plane's own state.
* ``webhook``: a signed JSON POST per step to the operator's automation (:mod:`.webhook`).
* ``kubernetes``: each role's object is scaled through ``/scale``, removing the drained pod
  (:mod:`.kubernetes`).
* ``metrics``: desired replicas per role on ``/metrics`` for an HPA or KEDA (:mod:`.metrics`).
* ``process``: a flip restarts the engine in its new role through the host's supervisor
  (``fleet.supervisor``, :mod:`.process`).

docs/actuators.md describes each, with what its failures look like.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from clusters.models import Cluster
from scheduling.actuators.base import (
    Actuator,
    ActuatorError,
    RecordActuator,
    StepNotice,
    StepReport,
)
from scheduling.actuators.kube_api import KubeApi
from scheduling.actuators.kubernetes import KubernetesActuator
from scheduling.actuators.metrics import MetricsActuator, desired_replicas_current
from scheduling.actuators.process import ProcessActuator
from scheduling.actuators.webhook import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookActuator,
    signature,
    signature_valid,
    webhook_post,
)
from scheduling.core.scale_targets import ScaleTargetError, scale_targets_of
from scheduling.models import ActuatorKind, RebalanceSettings

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Actuator",
    "ActuatorError",
    "KubernetesActuator",
    "MetricsActuator",
    "ProcessActuator",
    "RecordActuator",
    "StepNotice",
    "StepReport",
    "WebhookActuator",
    "actuator_check",
    "actuator_for",
    "actuator_for_cluster",
    "desired_replicas_current",
    "instance_pod",
    "signature",
    "signature_valid",
    "webhook_post",
]

#: The instance label that names its pod when the instance's own name is not the pod's.
POD_LABEL = "pod"


def instance_pod(name: str, labels: dict[str, Any] | None) -> str:
    return str((labels or {}).get(POD_LABEL) or name)


def actuator_for(kind: str, *, url: str = "", secret: str = "", **options: Any) -> Actuator:
    """The actuator named ``kind`` among those that need no cluster (``record``, ``webhook``,
    ``process``)."""
    if kind == "record":
        return RecordActuator()
    if kind == "webhook":
        return WebhookActuator(url, secret, **options)
    if kind == "process":
        return ProcessActuator(url, secret, **options)
    raise ActuatorError(f"unknown actuator {kind!r} (record, webhook or process)")


def _kube_api(context: str) -> KubeApi:
    return KubeApi.connect(
        kubeconfig=settings.KUBERNETES_KUBECONFIG,
        context=context,
        timeout_s=settings.KUBERNETES_TIMEOUT_S,
    )


def actuator_for_cluster(cluster: Cluster, row: RebalanceSettings) -> Actuator:
    """The actuator ``row`` names for ``cluster``'s plans, built from the inventory."""
    if row.actuator == ActuatorKind.KUBERNETES:
        try:
            targets = scale_targets_of(cluster.scale_targets, cluster.kind)
        except ScaleTargetError as exc:
            raise ActuatorError(f"{cluster.name}: scale_targets: {exc}", retry=False) from exc
        pods = {
            name: instance_pod(name, labels)
            for name, labels in cluster.instances.values_list("name", "labels")
        }
        return KubernetesActuator(
            targets,
            pods,
            _kube_api,
            ready_timeout_s=float(row.ready_timeout_s),
            poll_s=float(row.drain_poll_s),
        )
    if row.actuator == ActuatorKind.METRICS:
        return MetricsActuator(cluster.pk)
    return actuator_for(row.actuator, url=row.webhook_url, secret=row.webhook_secret)


def actuator_check(cluster: Cluster, row: RebalanceSettings) -> None:
    """Refuse settings whose actuator cannot work for ``cluster`` (``ActuatorError``)."""
    if row.actuator == ActuatorKind.KUBERNETES:
        try:
            targets = scale_targets_of(cluster.scale_targets, cluster.kind)
        except ScaleTargetError as exc:
            raise ActuatorError(f"scale_targets: {exc}") from exc
        missing = [role for role in ("prefill", "decode") if role not in targets]
        if missing:
            raise ActuatorError(
                f"{cluster.name} names no scale target for {' and '.join(missing)}: set the "
                "cluster's scale_targets first (inventory API or topology file)"
            )
    elif row.actuator not in (ActuatorKind.METRICS, ActuatorKind.RECORD):
        actuator_for(row.actuator, url=row.webhook_url, secret=row.webhook_secret)
