"""The ``kubernetes`` actuator: a role change scales the cluster's role objects through their
``/scale`` subresource, removing the pod the plan drained.

A role flip on Kubernetes replaces the instance: shrink the old role by one (its controller
removes the drained pod), grow the new role by one, wait until the new replica is ready. So:

* ``drain``: before the control plane drains the instance, its pod is made the one its role's
  controller removes next: ``controller.kubernetes.io/pod-deletion-cost`` set to the lowest
  value on it (Deployments, ReplicaSets, Dynamo's Deployment-backed services), or, for
  controllers that remove the highest ordinal (StatefulSets, LWS, DisaggregatedSet roles, RBG
  roles), a check that it is that pod (the planner picks it; a plan that drained another fails
  here, before anything changed).
* ``flip``: a small state machine over polls, kept in the step's memo: shrink (read ``/scale``,
  record the counts, PATCH ``spec.replicas`` with the ``resourceVersion`` read; a 409 is read
  again, at most ``CONFLICT_TRIES`` times; wait until the drained pod is gone), then grow (the
  same, then wait until the role reports the new count ready: the object's
  ``status.readyReplicas``, else its ready pods). The counts are recorded before each PATCH and
  a PATCH is only sent while the object still asks for the recorded "from" count, so a step
  retried after a worker crash finishes the change instead of making it twice. Each wait has
  ``ready_timeout_s``; past it the step fails (no retry), naming what was not ready.
* A rolled-back flip is the same machine seeded with the reverse counts
  (``scheduling.rebalance.lifecycle``): shrink the grown role removing the added pod, grow the
  shrunk one back.

Errors that trying again cannot fix (a denied permission, a missing object, a deadline passed,
a controller that removed another pod, a replica count changed by someone else) fail the step
at once; others (connection errors, 5xx) are retried by the plan's step retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from scheduling.actuators.base import ActuatorError, StepNotice, StepReport
from scheduling.actuators.kube_api import DELETION_COST, KubeApi, Pod, ScaleConflict
from scheduling.core.scale_targets import ScaleTarget, pod_ordinal

CONFLICT_TRIES = 5
# The lowest cost a pod can have: the ReplicaSet controller removes it before any other.
LOWEST_COST = "-2147483648"
# Labels StatefulSets and LWS put on pods: their ordinal, and (LWS) which pod of a group.
ORDINAL_LABELS = ("apps.kubernetes.io/pod-index", "leaderworkerset.sigs.k8s.io/group-index")
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

ApiFactory = Callable[[str], KubeApi]


def _instance_pods(pods: list[Pod]) -> list[Pod]:
    """The pods that are instances: not terminating, and for LWS only a group's leader."""
    return [p for p in pods if not p.terminating and p.labels.get(LWS_WORKER_INDEX, "0") == "0"]


def _ordinal(pod: Pod) -> int | None:
    for label in ORDINAL_LABELS:
        if pod.labels.get(label, "").isdigit():
            return int(pod.labels[label])
    return pod_ordinal(pod.name)


def _rank(pod: Pod) -> int:
    ordinal = _ordinal(pod)
    return -1 if ordinal is None else ordinal


class KubernetesActuator:
    """Scales one cluster's role objects (``targets`` by role); ``pods`` maps the cluster's
    instance names to their pod names."""

    name = "kubernetes"
    replaces_instances = True

    def __init__(
        self,
        targets: Mapping[str, ScaleTarget],
        pods: Mapping[str, str],
        api: ApiFactory,
        *,
        ready_timeout_s: float = 900.0,
        poll_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.targets = dict(targets)
        self.pods = dict(pods)
        self._api_factory = api
        self._apis: dict[str, KubeApi] = {}
        self.ready_timeout_s = ready_timeout_s
        self.poll_s = poll_s
        self._clock = clock

    # plumbing ----------------------------------------------------------------------------------

    def _target(self, role: str) -> ScaleTarget:
        target = self.targets.get(role)
        if target is None:
            raise ActuatorError(
                f"the cluster names no Kubernetes scale target for its {role} role "
                "(the cluster's scale_targets)",
                retry=False,
            )
        return target

    def _api(self, target: ScaleTarget) -> KubeApi:
        if target.context not in self._apis:
            self._apis[target.context] = self._api_factory(target.context)
        return self._apis[target.context]

    def close(self) -> None:
        for api in self._apis.values():
            api.close()
        self._apis.clear()

    def _pod_of(self, notice: StepNotice) -> str:
        if "remove" in notice.memo:
            return str(notice.memo["remove"])
        return self.pods.get(notice.instance, notice.instance)

    def _role_pods(self, target: ScaleTarget) -> list[Pod]:
        api = self._api(target)
        selector = api.scale_get(target).selector
        if not selector:
            raise ActuatorError(
                f"{target.describe()}: its /scale reports no status.selector, so its pods "
                "cannot be told apart",
                retry=False,
            )
        return _instance_pods(api.pods(target.namespace, selector))

    # the drained pod goes first --------------------------------------------------------------

    def _mark_for_removal(self, target: ScaleTarget, pod: str) -> str:
        """Make ``pod`` the one ``target``'s controller removes next, or refuse."""
        api = self._api(target)
        if target.removal == "deletion_cost":
            current = api.pod_get(target.namespace, pod)
            if current is None:
                raise ActuatorError(
                    f"pod {target.namespace}/{pod} does not exist: the instance's pod (its "
                    "name, or its 'pod' label) must be a pod of "
                    f"{target.describe()}",
                    retry=False,
                )
            if current.annotations.get(DELETION_COST) != LOWEST_COST:
                api.pod_annotate(target.namespace, pod, {DELETION_COST: LOWEST_COST})
            return f"{pod}: {DELETION_COST}={LOWEST_COST}"
        live = self._role_pods(target)
        if pod not in {p.name for p in live}:
            raise ActuatorError(
                f"pod {target.namespace}/{pod} is not a running pod of {target.describe()}",
                retry=False,
            )
        highest = max(live, key=_rank)
        if highest.name != pod:
            raise ActuatorError(
                f"{target.describe()} removes its highest ordinal first ({highest.name}), "
                f"not {pod}: the plan must drain {highest.name}",
                retry=False,
            )
        return f"{pod}: the highest ordinal of {target.describe()}"

    def _drain(self, notice: StepNotice) -> StepReport | None:
        if notice.memo.get("skip"):
            return None
        target = self._target(str(notice.memo.get("role") or notice.from_role))
        return StepReport(detail=self._mark_for_removal(target, self._pod_of(notice)))

    # scaling ---------------------------------------------------------------------------------

    def _scale_to(self, target: ScaleTarget, start: int, end: int) -> None:
        """Set ``target`` from ``start`` to ``end`` replicas with the version read; done already
        (it asks for ``end``) is fine, anything else is someone else's change."""
        api = self._api(target)
        for _ in range(CONFLICT_TRIES):
            scale = api.scale_get(target)
            if scale.replicas == end:
                return
            if scale.replicas != start:
                raise ActuatorError(
                    f"{target.describe()} asks for {scale.replicas} replicas, not the "
                    f"{start} this step read: something else scaled it, and this step will "
                    "not scale it again",
                    retry=False,
                )
            try:
                api.scale_patch(target, end, scale.resource_version)
                return
            except ScaleConflict:
                continue  # changed since read (its status, another writer): read it again
        raise ActuatorError(
            f"{target.describe()} changed under every one of {CONFLICT_TRIES} patches (409)"
        )

    def _shrunk(self, target: ScaleTarget, phase: dict[str, Any]) -> tuple[bool, str]:
        api = self._api(target)
        pod = phase.get("remove") or ""
        live = self._role_pods(target)
        if pod:
            gone = api.pod_get(target.namespace, pod)
            if gone is None:
                return True, f"{pod} removed"
            if not gone.terminating and len(live) <= phase["to"]:
                others = sorted(set(phase.get("before", [])) - {p.name for p in live})
                raise ActuatorError(
                    f"{target.describe()} removed {', '.join(others) or 'another pod'} instead "
                    f"of the drained {pod} (does its controller honour "
                    f"{DELETION_COST if target.removal == 'deletion_cost' else 'ordinals'}?)",
                    retry=False,
                )
            return False, f"waiting for {pod} to go"
        done = len(live) <= phase["to"]
        return done, f"{len(live)} pods, {phase['to']} wanted"

    def _grown(self, target: ScaleTarget, phase: dict[str, Any]) -> tuple[bool, str]:
        api = self._api(target)
        status = api.object_status(target)
        live = self._role_pods(target)
        ready_pods = [p for p in live if p.ready]
        ready = status.get("readyReplicas")
        count = int(ready) if isinstance(ready, int) else len(ready_pods)
        phase["added"] = sorted({p.name for p in live} - set(phase.get("before", [])))
        return count >= phase["to"], f"{count} of {phase['to']} ready"

    def _flip(self, notice: StepNotice) -> StepReport:
        memo = {k: (dict(v) if isinstance(v, dict) else v) for k, v in notice.memo.items()}
        now = self._clock()
        if not memo.get("planned"):
            # Apply: record the shrink's counts (and the grow's role) before any PATCH.
            source, dest = self._target(notice.from_role), self._target(notice.to_role)
            count = self._api(source).scale_get(source).replicas
            if count < 1:
                raise ActuatorError(f"{source.describe()} has no replica to give up", retry=False)
            memo.update(
                planned=True,
                shrink={
                    "role": source.role,
                    "from": count,
                    "to": count - 1,
                    "remove": self._pod_of(notice),
                    "before": sorted(p.name for p in self._role_pods(source)),
                },
                grow={"role": dest.role},
            )
            return StepReport(done=False, memo=memo, detail=self._summary(memo))
        for name in ("shrink", "grow"):
            phase = memo.get(name)
            if not phase or phase.get("done"):
                continue
            target = self._target(phase["role"])
            if "from" not in phase:  # the grow's count is read once the shrink is done
                count = self._api(target).scale_get(target).replicas
                phase.update({"from": count, "to": count + 1})
            if "at" not in phase:
                phase["at"] = now
                if name == "shrink" and phase.get("remove"):
                    self._mark_for_removal(target, phase["remove"])
                phase.setdefault("before", sorted(p.name for p in self._role_pods(target)))
                return StepReport(done=False, memo=memo, detail=self._summary(memo))
            self._scale_to(target, phase["from"], phase["to"])
            settled = self._shrunk if name == "shrink" else self._grown
            finished, how = settled(target, phase)
            if not finished:
                waited = now - float(phase["at"])
                if waited > self.ready_timeout_s:
                    raise ActuatorError(
                        f"{target.describe()} ({phase['role']}, {phase['from']} -> "
                        f"{phase['to']}): {how} after {waited:.0f} s "
                        f"(ready_timeout_s {self.ready_timeout_s:g})",
                        retry=False,
                    )
                return StepReport(
                    done=False,
                    memo=memo,
                    wait_s=self.poll_s,
                    detail=f"{self._summary(memo)}; {phase['role']}: {how}",
                )
            phase["done"] = True
            phase["result"] = how
        return StepReport(done=True, memo=memo, detail=self._summary(memo))

    @staticmethod
    def _summary(memo: Mapping[str, Any]) -> str:
        parts = []
        for name in ("shrink", "grow"):
            phase = memo.get(name)
            if not phase or "from" not in phase:
                continue
            text = f"{phase['role']} {phase['from']} -> {phase['to']}"
            if phase.get("result"):
                text += f" ({phase['result']}"
                text += f"; new: {', '.join(phase['added'])})" if phase.get("added") else ")"
            parts.append(text)
        return "; ".join(parts) or "nothing to scale"

    def notify(self, notice: StepNotice) -> StepReport | None:
        try:
            if notice.action == "drain":
                return self._drain(notice)
            if notice.action == "flip":
                return self._flip(notice)
            return None
        finally:
            self.close()
