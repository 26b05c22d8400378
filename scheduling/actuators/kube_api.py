"""The few Kubernetes API calls the ``kubernetes`` actuator makes, through lightkube.

Everything comes back as plain data (:class:`Scale`, :class:`Pod`); every refusal becomes an
:class:`~scheduling.actuators.base.ActuatorError` that names the verb and the resource it was
refused (``patch deployments.apps/scale``), as an RBAC rule would spell them, so that an
operator knows which rule to add. A 409 on a scale patch is :class:`ScaleConflict`, for the
caller to re-read and retry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import ApiError, Client, ConfigError, KubeConfig, operators
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment, ReplicaSet, StatefulSet
from lightkube.resources.core_v1 import Pod as PodResource
from lightkube.types import PatchType

from scheduling.actuators.base import ActuatorError
from scheduling.core.scale_targets import ScaleTarget

FIELD_MANAGER = "prfaas-controlplane"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

_BUILTIN: dict[tuple[str, str], Any] = {
    ("apps/v1", "deployments"): Deployment,
    ("apps/v1", "statefulsets"): StatefulSet,
    ("apps/v1", "replicasets"): ReplicaSet,
}


class ScaleConflict(Exception):
    """The object changed since it was read (HTTP 409): read it again."""


@dataclass(frozen=True)
class Scale:
    replicas: int  # spec: what is asked for
    current: int  # status: what the controller has now
    selector: str  # the label selector of its pods
    resource_version: str


@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ready: bool
    terminating: bool


def _resource(target: ScaleTarget) -> Any:
    builtin = _BUILTIN.get((target.api_version, target.plural))
    if builtin is not None:
        return builtin
    # lightkube registers a class per (apiVersion, kind); a target given by plural alone gets a
    # kind of its own making (only the client sees it).
    kind = target.kind or "".join(p.capitalize() for p in re.split(r"[-.]", target.plural))
    try:
        return create_namespaced_resource(target.group, target.version, kind, target.plural)
    except ValueError as exc:
        raise ActuatorError(f"{target.describe()}: {exc}", retry=False) from exc


# Label selector terms as /scale reports them: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
# ``k notin (a,b)``, ``k``, ``!k``.
_TERM = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<absent>[^\s=!,()]+)"
    r"|(?P<key>[^\s=!,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,()]*)"
    r"|\s+(?P<set>in|notin)\s*\((?P<values>[^)]*)\))?)\s*$"
)


def selector_pairs(selector: str) -> dict[str, Any]:
    """A label selector string as lightkube's ``labels`` argument."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    pairs: dict[str, Any] = {}
    for term in filter(str.strip, terms):
        m = _TERM.match(term)
        if m is None:
            raise ActuatorError(f"cannot read the label selector {selector!r}", retry=False)
        if m["absent"]:
            pairs[m["absent"]] = operators.not_exists()
        elif m["set"]:
            values = [v.strip() for v in m["values"].split(",") if v.strip()]
            pairs[m["key"]] = (operators.in_ if m["set"] == "in" else operators.not_in)(values)
        elif m["op"]:
            binary = operators.not_equal if m["op"] == "!=" else operators.equal
            pairs[m["key"]] = binary(m["value"])
        else:
            pairs[m["key"]] = operators.exists()
    return pairs


def _pod(data: dict[str, Any]) -> Pod:
    meta = data.get("metadata") or {}
    conditions = (data.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return Pod(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
    )


class KubeApi:
    """One API server, as one kubeconfig context (or the pod's service account) reaches it."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    def connect(cls, *, kubeconfig: str, context: str, timeout_s: float) -> KubeApi:
        """From ``kubeconfig`` (a path; its ``context``, else its current one), or with no
        path from the service account Kubernetes mounts into the control plane's pods."""
        try:
            if kubeconfig:
                config = KubeConfig.from_file(kubeconfig).get(context_name=context or None)
            else:
                config = KubeConfig.from_service_account().get()
        except (ConfigError, KeyError, OSError) as exc:
            where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
            raise ActuatorError(
                f"no Kubernetes credentials from {where}"
                f"{f' (context {context})' if context else ''}: {exc}; set KUBERNETES_KUBECONFIG "
                "or run the worker in a pod with a service account",
                retry=False,
            ) from exc
        timeout = httpx2.Timeout(timeout_s)
        return cls(Client(config=config, timeout=timeout, field_manager=FIELD_MANAGER))

    def close(self) -> None:
        self.client.close()

    def _call(self, verb: str, resource: str, where: str, call: Any) -> Any:
        try:
            return call()
        except ApiError as exc:
            code = exc.status.code
            message = exc.status.message or ""
            if code == 409:
                raise ScaleConflict(message) from exc
            if code == 403:
                raise ActuatorError(
                    f"Kubernetes denied {verb} {resource} on {where}: {message} "
                    f"(the control plane's Role needs verb {verb!r} on {resource!r}; "
                    "deploy/kubernetes/base/rbac-actuator.yaml)",
                    retry=False,
                ) from exc
            if code == 401:
                raise ActuatorError(
                    f"Kubernetes refused the credentials ({verb} {resource}): {message}",
                    retry=False,
                ) from exc
            if code == 404:
                raise ActuatorError(
                    f"{resource} {where} not found ({verb}): {message}", retry=False
                ) from exc
            raise ActuatorError(f"{verb} {resource} {where}: HTTP {code} {message}") from exc
        except httpx2.HTTPError as exc:
            raise ActuatorError(f"{verb} {resource} {where}: {type(exc).__name__}: {exc}") from exc

    def scale_get(self, target: ScaleTarget) -> Scale:
        res = _resource(target)
        obj = self._call(
            "get",
            f"{target.resource}/scale",
            f"{target.namespace}/{target.name}",
            lambda: self.client.get(res.Scale, target.name, namespace=target.namespace),
        )
        return _scale(obj.to_dict())

    def scale_patch(self, target: ScaleTarget, replicas: int, resource_version: str) -> Scale:
        """Set ``spec.replicas`` if the object is still at ``resource_version`` (else 409)."""
        res = _resource(target)
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
        obj = self._call(
            "patch",
            f"{target.resource}/scale",
            f"{target.namespace}/{target.name}",
            lambda: self.client.patch(
                res.Scale,
                target.name,
                body,
                namespace=target.namespace,
                patch_type=PatchType.MERGE,
            ),
        )
        return _scale(obj.to_dict())

    def object_status(self, target: ScaleTarget) -> dict[str, Any]:
        res = _resource(target)
        obj = self._call(
            "get",
            target.resource,
            f"{target.namespace}/{target.name}",
            lambda: self.client.get(res, target.name, namespace=target.namespace),
        )
        return dict(obj.to_dict().get("status") or {})

    def pods(self, namespace: str, selector: str) -> list[Pod]:
        labels = selector_pairs(selector)
        if not labels:
            # Every pod of the namespace is not a role: refuse rather than guess.
            raise ActuatorError(f"no label selector to find pods in {namespace}", retry=False)
        items = self._call(
            "list",
            "pods",
            f"namespace {namespace}",
            lambda: list(self.client.list(PodResource, namespace=namespace, labels=labels)),
        )
        return [_pod(p.to_dict()) for p in items]

    def pod_get(self, namespace: str, name: str) -> Pod | None:
        """The pod, or None once it is gone."""

        def get() -> Any:
            try:
                return self.client.get(PodResource, name, namespace=namespace)
            except ApiError as exc:
                if exc.status.code == 404:
                    return None
                raise

        obj = self._call("get", "pods", f"{namespace}/{name}", get)
        return None if obj is None else _pod(obj.to_dict())

    def pod_annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self._call(
            "patch",
            "pods",
            f"{namespace}/{name}",
            lambda: self.client.patch(
                PodResource,
                name,
                {"metadata": {"annotations": annotations}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            ),
        )


def _scale(data: dict[str, Any]) -> Scale:
    spec = data.get("spec") or {}
    status = data.get("status") or {}
    meta = data.get("metadata") or {}
    return Scale(
        replicas=int(spec.get("replicas") or 0),
        current=int(status.get("replicas") or 0),
        selector=str(status.get("selector") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
    )
