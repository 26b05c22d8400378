"""Policy versions: the service that creates the next one and the selector for the current.

A new version becomes visible to every web process through the snapshot version key
(:func:`scheduling.snapshot.snapshot_version_bump`, after commit), so routers obey it at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Max

from clusters.models import Cluster, ClusterKind
from controlplane.audit import Actor, change_record_create, snapshot
from controlplane.errors import Conflict, Invalid
from scheduling.core import routing
from scheduling.models import Policy
from scheduling.snapshot import snapshot_version_bump

# Largest threshold a policy may hold; far beyond any context window, still a finite number.
MAX_THRESHOLD_TOKENS = 100_000_000


def guards_from_json(guards: Mapping[str, Any]) -> routing.RouteGuards:
    """The router's guards with ``guards`` overriding the defaults; Invalid names the problem."""
    try:
        return routing.route_guards_from_dict(guards, "guards")
    except routing.SnapshotFormatError as exc:
        raise Invalid(str(exc)) from None


def _thresholds_check(thresholds: Mapping[str, Any]) -> dict[str, int]:
    if not isinstance(thresholds, Mapping):
        raise Invalid("thresholds: must be an object of {pd cluster name: tokens}")
    kinds = dict(Cluster.objects.filter(name__in=list(thresholds)).values_list("name", "kind"))
    out: dict[str, int] = {}
    for name, value in thresholds.items():
        if name not in kinds:
            raise Invalid(f"thresholds.{name}: no such cluster")
        if kinds[name] != ClusterKind.PD:
            raise Invalid(f"thresholds.{name}: only pd clusters have a threshold")
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"thresholds.{name}: must be an integer number of tokens")
        if not 0 <= value <= MAX_THRESHOLD_TOKENS:
            raise Invalid(f"thresholds.{name}: must be between 0 and {MAX_THRESHOLD_TOKENS}")
        out[name] = value
    return out


def policy_create(
    *,
    actor: Actor,
    thresholds: Mapping[str, Any],
    guards: Mapping[str, Any] | None = None,
    note: str = "",
    expected_version: int | None = None,
) -> Policy:
    """Create the next policy version (current + 1).

    ``expected_version``: the version the caller based its change on; if another version was
    created meanwhile, Conflict (so a plan approved against v3 cannot silently replace v4).
    """
    checked = _thresholds_check(thresholds)
    guards = dict(guards or {})
    guards_from_json(guards)
    for _ in range(5):
        try:
            with transaction.atomic():
                current = Policy.objects.aggregate(v=Max("version"))["v"] or 0
                if expected_version is not None and expected_version != current:
                    raise Conflict(
                        f"the current policy is v{current}, not v{expected_version}",
                        code="stale_version",
                    )
                policy = Policy.objects.create(
                    version=current + 1,
                    thresholds=checked,
                    guards=guards,
                    created_by=actor.label,
                    note=note,
                )
                change_record_create(
                    actor=actor, action="create", obj=policy, before=None, after=snapshot(policy)
                )
                transaction.on_commit(snapshot_version_bump)
                return policy
        except IntegrityError:
            continue  # another writer took this version number; read the new current
    raise Conflict("could not allocate a policy version (too many concurrent writers)")


def policy_current() -> Policy | None:
    """The policy routers obey now (highest version), or None before the first one."""
    return Policy.objects.order_by("-version").first()
