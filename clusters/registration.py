"""Instances that join by themselves: an agent beside an engine registers its instance.

``PUT /api/v1/registrations/{name}`` (scope ``register``) creates the instance or re-binds an
existing name in one transaction, validated like any inventory write and recorded in the change
log with its cause:

* bound: a register token names the clusters it may register into (403 ``outside_binding``);
* throttled: at most ``REGISTRATIONS_PER_MINUTE`` per token and wall-clock minute (429
  ``throttled``), counted before anything is read or written;
* validated (422, nothing written): the cluster exists (``unknown_cluster``); the engine runs on
  the cluster's accelerator (``profile_mismatch``) and a performance profile describes that
  accelerator for the cluster's model (``profile_missing``); the role is allowed in the cluster
  (``role_not_allowed``: no decode in a prfaas cluster, nor on a profile without decode
  figures); the engine speaks the cluster's KV connector (``kv_connector_mismatch``); a name
  held by another cluster's instance is not taken over (409 ``name_taken``);
* idempotent: a restarted agent registering the same instance again changes nothing (no new
  version, no change record) and only counts as a heartbeat. A new instance is ``registered``;
  a declared one keeps ``declared`` (topology as code owns it). An unreachable instance that
  registers again gets back the state it had before (active, or draining mid-plan).

The rebalancer reads the inventory at each tick, so it sees the instance at its next one; the
routers' snapshots are rebuilt after commit (``post_save``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction

from clusters import services
from clusters.live.heartbeats import registration_seen, registrations_count
from clusters.models import (
    Cluster,
    ClusterKind,
    Instance,
    InstanceOrigin,
    InstanceRole,
    InstanceState,
    PerformanceProfile,
)
from clusters.reachability import state_before_unreachable
from controlplane.audit import Actor
from controlplane.auth import cluster_binding_check
from controlplane.errors import ApiError, Conflict, Invalid

REGISTER_ACTION = "register"


class Throttled(ApiError):
    status = 429
    code = "throttled"


@dataclass(frozen=True)
class Registration:
    """What an agent says about the engine it runs beside."""

    name: str
    cluster: str
    role: str
    endpoint: str | None  # None: keep the inventory's ("" for a new instance)
    accelerator: str
    kv_connector: str
    engine: str
    engine_version: str = ""


@dataclass(frozen=True)
class Registered:
    instance: Instance
    created: bool
    changed: tuple[str, ...]


def registration_throttle(principal: Any) -> None:
    """429 once the caller has registered ``REGISTRATIONS_PER_MINUTE`` times this minute."""
    token_id = getattr(principal, "token_id", None)
    who = f"t{token_id}" if token_id is not None else f"u{getattr(principal, 'user_id', '')}"
    limit = int(settings.REGISTRATIONS_PER_MINUTE)
    if registrations_count(who) > limit:
        raise Throttled(
            f"more than {limit} registrations this minute from this token; an agent registers "
            "each engine once and then every few seconds at most",
        )


def _cluster_checked(reg: Registration) -> Cluster:
    cluster = (
        Cluster.objects.select_related("accelerator", "model").filter(name=reg.cluster).first()
    )
    if cluster is None:
        raise Invalid(f"cluster: no cluster named {reg.cluster!r}", code="unknown_cluster")
    if cluster.accelerator.name != reg.accelerator:
        raise Invalid(
            f"accelerator: cluster {cluster.name} runs {cluster.accelerator.name}, "
            f"not {reg.accelerator}",
            code="profile_mismatch",
        )
    profile = PerformanceProfile.objects.filter(
        accelerator=cluster.accelerator, model=cluster.model
    ).first()
    if profile is None:
        raise Invalid(
            f"accelerator: no performance profile of {cluster.accelerator.name} for model "
            f"{cluster.model.name}; add it to the topology first",
            code="profile_missing",
        )
    if reg.role == InstanceRole.DECODE:
        if cluster.kind == ClusterKind.PRFAAS:
            raise Invalid(
                f"role: {cluster.name} is a prfaas cluster: it only prefills",
                code="role_not_allowed",
            )
        if profile.decode_max_batch is None:
            raise Invalid(
                f"role: the {cluster.accelerator.name} profile has no decode figures",
                code="role_not_allowed",
            )
    if reg.kv_connector != cluster.kv_connector:
        raise Invalid(
            f"kv_connector: cluster {cluster.name}'s engines speak {cluster.kv_connector}, "
            f"not {reg.kv_connector}",
            code="kv_connector_mismatch",
        )
    return cluster


def _register(reg: Registration, cluster: Cluster, actor: Actor) -> Registered:
    with transaction.atomic():
        existing = Instance.objects.select_for_update().filter(name=reg.name).first()
        transaction.on_commit(lambda: registration_seen(reg.name))
        if existing is None:
            created = services.instance_create(
                actor=actor,
                cluster_id=cluster.pk,
                name=reg.name,
                role=reg.role,
                endpoint=reg.endpoint or "",
                origin=InstanceOrigin.REGISTERED,
                engine=reg.engine,
                engine_version=reg.engine_version,
                action=REGISTER_ACTION,
                cause=f"registered by its agent as {reg.role} ({_engine(reg)})",
            )
            return Registered(created, True, ())
        if existing.cluster_id != cluster.pk:
            raise Conflict(
                f"name: instance {reg.name!r} belongs to cluster {existing.cluster.name}",
                code="name_taken",
            )
        wanted: dict[str, Any] = {
            "role": reg.role,
            "engine": reg.engine,
            "engine_version": reg.engine_version,
        }
        if reg.endpoint is not None:
            wanted["endpoint"] = reg.endpoint
        if existing.state == InstanceState.UNREACHABLE:
            wanted["state"] = state_before_unreachable(existing)
        changes = {k: v for k, v in wanted.items() if getattr(existing, k) != v}
        if not changes:
            return Registered(existing, False, ())
        causes = []
        if "state" in changes:
            causes.append(f"heartbeat again: {changes['state']}")
        if "role" in changes:
            causes.append(f"registered as {reg.role} (was {existing.role})")
        causes.append(f"registered by its agent ({_engine(reg)})")
        updated = services.instance_update(
            instance_id=existing.pk,
            version=existing.version,
            changes=changes,
            actor=actor,
            action=REGISTER_ACTION,
            cause="; ".join(causes),
        )
        return Registered(updated, False, tuple(sorted(changes)))


def _engine(reg: Registration) -> str:
    return f"{reg.engine} {reg.engine_version}".strip()


def instance_register(*, registration: Registration, actor: Actor, principal: Any) -> Registered:
    """Create or re-bind the instance an agent registers (see the module docstring)."""
    registration_throttle(principal)
    cluster_binding_check(principal, registration.cluster)
    cluster = _cluster_checked(registration)
    try:
        return _register(registration, cluster, actor)
    except Conflict as exc:
        if exc.code != "already_exists":
            raise
        # Another registration of the same new name committed first: re-bind it instead.
        return _register(registration, cluster, actor)
