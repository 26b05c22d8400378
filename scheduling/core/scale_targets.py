"""Where a cluster's roles run on Kubernetes: one scale target per role, an object with a
``/scale`` subresource (a Deployment, a StatefulSet, an LWS, an LWS DisaggregatedSet role
scaler, a Dynamo graph's scaling adapter, an RBG role's scaling adapter, or anything else with
``/scale``), and which pod its controller removes when the role shrinks.

The inventory stores a cluster's targets as JSON (``Cluster.scale_targets``), topology-as-code
reads them from a cluster's ``scale_targets`` key, and the ``kubernetes`` actuator acts on them;
all three go through :func:`scale_targets_read`, so one set of rules holds everywhere.
Pure Python: no Django import here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Loc = tuple[str | int, ...]

Removal = Literal["deletion_cost", "highest_ordinal"]
REMOVALS: tuple[Removal, ...] = ("deletion_cost", "highest_ordinal")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Preset:
    """A known kind: its API version, plural, and which pod its controller removes first."""

    api_version: str
    plural: str
    removal: Removal


#: Kinds known by name. ``removal``: Deployments and ReplicaSets honour
#: ``controller.kubernetes.io/pod-deletion-cost``; StatefulSets, LeaderWorkerSets (a StatefulSet
#: of leaders), DisaggregatedSet roles (each an LWS) and RBG roles (stateful instances, highest
#: index deleted first) remove the highest ordinal. A Dynamo graph's services run as Deployments
#: by default (multi-node services as LWS: give ``removal: highest_ordinal`` then).
PRESETS: dict[str, Preset] = {
    "Deployment": Preset("apps/v1", "deployments", "deletion_cost"),
    "ReplicaSet": Preset("apps/v1", "replicasets", "deletion_cost"),
    "StatefulSet": Preset("apps/v1", "statefulsets", "highest_ordinal"),
    "LeaderWorkerSet": Preset("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "highest_ordinal"),
    "DisaggregatedSetRoleScaler": Preset(
        "disaggregatedset.x-k8s.io/v1", "disaggregatedsetrolescalers", "highest_ordinal"
    ),
    "DynamoGraphDeploymentScalingAdapter": Preset(
        "nvidia.com/v1alpha1", "dynamographdeploymentscalingadapters", "deletion_cost"
    ),
    "RoleBasedGroupScalingAdapter": Preset(
        "workloads.x-k8s.io/v1alpha2", "rolebasedgroupscalingadapters", "highest_ordinal"
    ),
}

# Kubernetes' own name rules: a DNS-1123 subdomain for object names, a label for namespaces
# and plurals, ``group/version`` (or ``v1``) for API versions.
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VERSION = re.compile(r"^v[0-9]+((alpha|beta)[0-9]+)?$")
_KIND = re.compile(r"^[A-Z][A-Za-z0-9]*$")
_ORDINAL = re.compile(r"-([0-9]+)$")

_KEYS = ("kind", "api_version", "plural", "namespace", "name", "removal", "context")


class ScaleTargetError(ValueError):
    """A target that cannot be used, with the key path of the problem (``decode.kind``)."""

    def __init__(self, loc: Loc, message: str) -> None:
        self.loc = loc
        self.path = ".".join(str(part) for part in loc)
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


def error_at(loc: Loc, message: str) -> ScaleTargetError:
    return ScaleTargetError(loc, message)


def mapping_read(
    value: Any, loc: Loc, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise error_at(loc, f"expected a mapping, got {type(value).__name__}")
    allowed = (*required, *optional)
    for key in value:
        if key not in allowed:
            raise error_at((*loc, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise error_at((*loc, key), "required key is missing")
    return value


def str_read(value: Any, loc: Loc, *, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise error_at(loc, f"expected a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise error_at(loc, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ScaleTarget:
    """The object that carries one role's replica count."""

    role: str
    api_version: str
    plural: str
    namespace: str
    name: str
    removal: Removal
    kind: str = ""
    # The kubeconfig context to reach it with (empty: the current context, or the pod's own
    # service account in the cluster the control plane runs in).
    context: str = ""

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def resource(self) -> str:
        """``plural.group`` as RBAC rules and API errors name it (``deployments.apps``)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def describe(self) -> str:
        return f"{self.kind or self.resource} {self.namespace}/{self.name}"

    def to_json(self) -> dict[str, str]:
        out = {
            "api_version": self.api_version,
            "plural": self.plural,
            "namespace": self.namespace,
            "name": self.name,
            "removal": self.removal,
        }
        if self.kind:
            out["kind"] = self.kind
        if self.context:
            out["context"] = self.context
        return out


def _name(value: Any, loc: Loc, pattern: re.Pattern[str], limit: int, what: str) -> str:
    text = str_read(value, loc)
    if len(text) > limit or not pattern.match(text):
        raise error_at(loc, f"{text!r} is not a valid {what}")
    return text


def scale_target_read(value: Any, loc: Loc, role: str) -> ScaleTarget:
    """One role's target: ``kind`` alone for a preset, or ``api_version`` and ``plural`` (and
    ``kind`` if known) for any other object with ``/scale``; ``namespace`` defaults to
    ``default``; ``removal`` overrides the preset's."""
    body = mapping_read(value, loc, required=("name",), optional=_KEYS)
    kind = _name(body["kind"], (*loc, "kind"), _KIND, 63, "kind") if "kind" in body else ""
    preset = PRESETS.get(kind)
    if preset is None and "plural" not in body:
        known = ", ".join(PRESETS)
        raise error_at(
            (*loc, "kind" if kind else "plural"),
            f"{'unknown kind ' + repr(kind) if kind else 'a kind or a plural is required'}: "
            f"give api_version and plural for any object with a /scale subresource "
            f"(kinds known by name: {known})",
        )
    api_version = str_read(
        body.get("api_version", preset.api_version if preset else None), (*loc, "api_version")
    )
    group, _, version = api_version.rpartition("/")
    if not _VERSION.match(version) or (group and not _SUBDOMAIN.match(group)):
        raise error_at((*loc, "api_version"), f"{api_version!r} is not group/version (or v1)")
    plural = (
        _name(body["plural"], (*loc, "plural"), _LABEL, 63, "resource plural")
        if "plural" in body
        else preset.plural  # type: ignore[union-attr]
    )
    removal = str_read(
        body.get("removal", preset.removal if preset else "deletion_cost"),
        (*loc, "removal"),
        choices=REMOVALS,
    )
    context = str_read(body["context"], (*loc, "context")) if "context" in body else ""
    return ScaleTarget(
        role=role,
        api_version=api_version,
        plural=plural,
        namespace=_name(
            body.get("namespace", "default"), (*loc, "namespace"), _LABEL, 63, "namespace"
        ),
        name=_name(body["name"], (*loc, "name"), _SUBDOMAIN, 253, "object name"),
        removal=removal,  # type: ignore[arg-type]
        kind=kind,
        context=context,
    )


def scale_targets_read(value: Any, loc: Loc, *, cluster_kind: str) -> tuple[ScaleTarget, ...]:
    """A cluster's targets by role (``{prefill: {...}, decode: {...}}``; may be empty). A
    ``prfaas`` cluster only prefills, so it names no decode target."""
    roles = ROLES if cluster_kind == "pd" else ("prefill",)
    body = mapping_read(value, loc, optional=roles)
    return tuple(scale_target_read(body[r], (*loc, r), r) for r in roles if r in body)


def scale_targets_json(targets: tuple[ScaleTarget, ...]) -> dict[str, dict[str, str]]:
    """The stored form: every field spelt out, presets resolved."""
    return {t.role: t.to_json() for t in targets}


def scale_targets_of(stored: Mapping[str, Any], cluster_kind: str) -> dict[str, ScaleTarget]:
    """Stored targets by role (the stored form reads back as itself)."""
    return {t.role: t for t in scale_targets_read(stored or {}, (), cluster_kind=cluster_kind)}


def pod_ordinal(pod: str) -> int | None:
    """The ordinal a StatefulSet-like controller gave a pod (``decode-3`` -> 3), from its name."""
    match = _ORDINAL.search(pod)
    return int(match.group(1)) if match else None
