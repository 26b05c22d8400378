"""Writes to the inventory. Each one validates, writes, and records an audit entry in one
transaction.

Optimistic concurrency: every update and delete names the ``version`` the caller last saw.
Updates are a conditional ``UPDATE ... SET version = version + 1 WHERE id = %s AND version = %s``;
on PostgreSQL a concurrent writer blocks on the row lock and then re-checks the condition, so
exactly one of two writers holding the same version wins and the other gets a 409 naming the
current version. Deletes lock the row (``SELECT ... FOR UPDATE``) before checking the version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import IntegrityError, models, transaction
from django.db.models import F, ProtectedError
from django.db.models.signals import post_save
from django.utils import timezone

from clusters.models import (
    Accelerator,
    Cluster,
    ClusterKind,
    Instance,
    InstanceOrigin,
    InstanceRole,
    InstanceState,
    KvConnector,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    Versioned,
)
from controlplane.audit import Actor, change_record_create, snapshot
from controlplane.errors import ApiError, Conflict, Invalid, NotFound

M = TypeVar("M", bound=Versioned)

# Fields a caller may set, per model; everything else is bookkeeping or derived.
EDITABLE: dict[type[Versioned], frozenset[str]] = {
    Site: frozenset({"name", "description"}),
    Accelerator: frozenset({"name", "gpu_hour_cost"}),
    ModelProfile: frozenset(
        {"name", "attention", "block_tokens", "kv_cache_mib", "linear_state_mib"}
    ),
    PerformanceProfile: frozenset(
        {
            "accelerator_id",
            "model_id",
            "gpus_per_instance",
            "prefill_seconds",
            "decode_max_batch",
            "decode_step_seconds",
        }
    ),
    Cluster: frozenset(
        {"name", "kind", "site_id", "accelerator_id", "model_id", "kv_connector", "scale_targets"}
    ),
    Instance: frozenset(
        {
            "cluster_id",
            "name",
            "role",
            "state",
            "endpoint",
            "labels",
            "origin",
            "engine",
            "engine_version",
        }
    ),
    Link: frozenset(
        {"source_id", "target_id", "gbps", "rtt_ms", "kv_budget_bytes", "target_utilisation"}
    ),
}
# Copies of a cluster's kind kept so that CHECK constraints can see it (see clusters.models).
DERIVED: dict[type[Versioned], tuple[str, ...]] = {
    Instance: ("cluster_kind",),
    Link: ("source_kind", "target_kind"),
}


def _label(model: type[models.Model]) -> str:
    return str(model._meta.verbose_name)


def _error_text(exc: ValidationError) -> str:
    if not hasattr(exc, "error_dict"):
        return "; ".join(exc.messages)
    parts = []
    for field, errors in exc.error_dict.items():
        for error in errors:
            text = "; ".join(error.messages)
            parts.append(text if field == NON_FIELD_ERRORS else f"{field}: {text}")
    return "; ".join(parts)


def _is_unique_error(exc: ValidationError) -> bool:
    if not hasattr(exc, "error_dict"):
        return False
    codes = {error.code for errors in exc.error_dict.values() for error in errors}
    return bool(codes) and codes <= {"unique", "unique_together"}


def _set_derived(obj: Versioned) -> None:
    if isinstance(obj, Instance) and obj.cluster_id is not None:
        obj.cluster_kind = obj.cluster.kind
    if isinstance(obj, Link):
        if obj.source_id is not None:
            obj.source_kind = obj.source.kind
        if obj.target_id is not None:
            obj.target_kind = obj.target.kind


def _check_references(obj: Versioned) -> None:
    """An id naming no object is a 404 (like one in the path), not a broken rule."""
    for field in obj._meta.concrete_fields:
        if not isinstance(field, models.ForeignKey):
            continue
        pk = getattr(obj, field.attname)
        target = field.related_model
        if pk is not None and not target._default_manager.filter(pk=pk).exists():
            raise NotFound(f"{field.attname}: {_label(target)} {pk} does not exist")


def _validate(obj: Versioned) -> None:
    """Field validators, ``clean()`` and uniqueness; CHECK constraints are the DB's last word."""
    _check_references(obj)
    try:
        obj.full_clean(validate_constraints=False)
    except ValidationError as exc:
        if _is_unique_error(exc):
            raise Conflict(_error_text(exc), code="already_exists") from exc
        raise Invalid(_error_text(exc)) from exc
    _set_derived(obj)


def _integrity(exc: IntegrityError, model: type[models.Model]) -> Conflict | Invalid:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "integrity error"
    cause = type(exc.__cause__).__name__
    if cause == "UniqueViolation" or "UNIQUE constraint" in text:
        return Conflict(f"{_label(model)} already exists: {text}", code="already_exists")
    return Invalid(f"{_label(model)} breaks a rule: {text}")


def _stale(model: type[M], pk: int, version: int) -> ApiError:
    current = model._default_manager.filter(pk=pk).values_list("version", flat=True).first()
    if current is None:
        return NotFound(f"{_label(model)} {pk} does not exist")
    return Conflict(
        f"{_label(model)} {pk} is at version {current}, not {version}: reload it and retry",
        code="version_conflict",
    )


def _fields(model: type[Versioned], changes: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(changes) - EDITABLE[model])
    if unknown:
        raise Invalid(f"{', '.join(unknown)}: not an editable field of {_label(model)}")
    return dict(changes)


def _get(model: type[M], pk: int) -> M:
    obj = model._default_manager.filter(pk=pk).first()
    if obj is None:
        raise NotFound(f"{_label(model)} {pk} does not exist")
    return obj


def _create(
    model: type[M],
    fields: Mapping[str, Any],
    *,
    actor: Actor,
    action: str = "create",
    cause: str = "",
) -> M:
    obj = model(**_fields(model, fields))
    _validate(obj)
    try:
        with transaction.atomic():
            obj.save()
            change_record_create(
                actor=actor, action=action, obj=obj, before=None, after=snapshot(obj), cause=cause
            )
    except IntegrityError as exc:
        raise _integrity(exc, model) from exc
    return obj


def _update(
    model: type[M],
    pk: int,
    *,
    version: int,
    changes: Mapping[str, Any],
    actor: Actor,
    action: str = "update",
    cause: str = "",
) -> M:
    fields = _fields(model, changes)
    try:
        with transaction.atomic():
            obj = _get(model, pk)
            if obj.version != version:
                raise _stale(model, pk, version)
            before = snapshot(obj)
            for name, value in fields.items():
                setattr(obj, name, value)
            _validate(obj)
            after = snapshot(obj)
            changed = {
                name: getattr(obj, name)
                for name in (*fields, *DERIVED.get(model, ()))
                if before.get(name) != after.get(name)
            }
            if not changed:
                return obj
            if isinstance(obj, Cluster) and "kind" in changed:
                _cluster_kind_change_check(obj)
            rows = model._default_manager.filter(pk=pk, version=version).update(
                **changed, version=F("version") + 1, updated_at=timezone.now()
            )
            if rows == 0:
                raise _stale(model, pk, version)
            if isinstance(obj, Cluster) and "kind" in changed:
                _cluster_kind_propagate(obj)
            obj.refresh_from_db()
            change_record_create(
                actor=actor,
                action=action,
                obj=obj,
                before=before,
                after=snapshot(obj),
                cause=cause,
            )
            # The queryset update above sends no post_save; listeners (the routers' snapshot
            # version, so that a drain or a link's new capacity applies at once) need one.
            post_save.send(sender=model, instance=obj, created=False, update_fields=set(changed))
    except IntegrityError as exc:
        raise _integrity(exc, model) from exc
    return obj


def _delete(
    model: type[M],
    pk: int,
    *,
    version: int,
    actor: Actor,
    action: str = "delete",
    cause: str = "",
) -> None:
    try:
        with transaction.atomic():
            obj = model._default_manager.select_for_update().filter(pk=pk).first()
            if obj is None:
                raise NotFound(f"{_label(model)} {pk} does not exist")
            if obj.version != version:
                raise _stale(model, pk, version)
            before = snapshot(obj)
            obj.delete()
            change_record_create(
                actor=actor,
                action=action,
                obj=obj,
                before=before,
                after=None,
                object_id=pk,
                cause=cause,
            )
    except ProtectedError as exc:
        users = sorted({str(o._meta.verbose_name_plural) for o in exc.protected_objects})
        raise Conflict(
            f"{_label(model)} {pk} is still used by {len(exc.protected_objects)} "
            f"{', '.join(users)}: delete or move those first",
            code="in_use",
        ) from exc


def _cluster_kind_change_check(cluster: Cluster) -> None:
    if cluster.kind == ClusterKind.PRFAAS:
        if cluster.instances.filter(role=InstanceRole.DECODE).exists():
            raise Invalid("kind: a prfaas cluster cannot hold decode instances; remove them first")
        if cluster.incoming_links.exists():
            raise Invalid("kind: links end at pd clusters; delete this cluster's incoming links")
    if cluster.kind == ClusterKind.PD and cluster.outgoing_links.exists():
        raise Invalid("kind: links start at prfaas clusters; delete this cluster's outgoing links")


def _cluster_kind_propagate(cluster: Cluster) -> None:
    # Derived copies only: not a change of the instances or links themselves, so no version bump.
    Instance.objects.filter(cluster=cluster).update(cluster_kind=cluster.kind)
    Link.objects.filter(source=cluster).update(source_kind=cluster.kind)
    Link.objects.filter(target=cluster).update(target_kind=cluster.kind)


# Sites ---------------------------------------------------------------------------------------


def site_create(*, actor: Actor, name: str, description: str = "") -> Site:
    return _create(Site, {"name": name, "description": description}, actor=actor)


def site_update(*, site_id: int, version: int, changes: Mapping[str, Any], actor: Actor) -> Site:
    return _update(Site, site_id, version=version, changes=changes, actor=actor)


def site_delete(*, site_id: int, version: int, actor: Actor) -> None:
    _delete(Site, site_id, version=version, actor=actor)


# Accelerators --------------------------------------------------------------------------------


def accelerator_create(*, actor: Actor, name: str, gpu_hour_cost: float) -> Accelerator:
    return _create(Accelerator, {"name": name, "gpu_hour_cost": gpu_hour_cost}, actor=actor)


def accelerator_update(
    *, accelerator_id: int, version: int, changes: Mapping[str, Any], actor: Actor
) -> Accelerator:
    return _update(Accelerator, accelerator_id, version=version, changes=changes, actor=actor)


def accelerator_delete(*, accelerator_id: int, version: int, actor: Actor) -> None:
    _delete(Accelerator, accelerator_id, version=version, actor=actor)


# Model profiles ------------------------------------------------------------------------------


def model_profile_create(
    *,
    actor: Actor,
    name: str,
    block_tokens: int,
    kv_cache_mib: list[list[float]],
    linear_state_mib: float | None = None,
    attention: Any = None,
) -> ModelProfile:
    return _create(
        ModelProfile,
        {
            "name": name,
            "block_tokens": block_tokens,
            "kv_cache_mib": kv_cache_mib,
            "linear_state_mib": linear_state_mib,
            "attention": attention,
        },
        actor=actor,
    )


def model_profile_update(
    *, model_profile_id: int, version: int, changes: Mapping[str, Any], actor: Actor
) -> ModelProfile:
    return _update(ModelProfile, model_profile_id, version=version, changes=changes, actor=actor)


def model_profile_delete(*, model_profile_id: int, version: int, actor: Actor) -> None:
    _delete(ModelProfile, model_profile_id, version=version, actor=actor)


# Performance profiles ------------------------------------------------------------------------


def performance_profile_create(
    *,
    actor: Actor,
    accelerator_id: int,
    model_id: int,
    gpus_per_instance: int,
    prefill_seconds: list[list[float]],
    decode_max_batch: int | None = None,
    decode_step_seconds: float | None = None,
) -> PerformanceProfile:
    return _create(
        PerformanceProfile,
        {
            "accelerator_id": accelerator_id,
            "model_id": model_id,
            "gpus_per_instance": gpus_per_instance,
            "prefill_seconds": prefill_seconds,
            "decode_max_batch": decode_max_batch,
            "decode_step_seconds": decode_step_seconds,
        },
        actor=actor,
    )


def performance_profile_update(
    *, performance_profile_id: int, version: int, changes: Mapping[str, Any], actor: Actor
) -> PerformanceProfile:
    return _update(
        PerformanceProfile, performance_profile_id, version=version, changes=changes, actor=actor
    )


def performance_profile_delete(*, performance_profile_id: int, version: int, actor: Actor) -> None:
    _delete(PerformanceProfile, performance_profile_id, version=version, actor=actor)


# Clusters ------------------------------------------------------------------------------------


def cluster_create(
    *,
    actor: Actor,
    name: str,
    kind: str,
    site_id: int,
    accelerator_id: int,
    model_id: int,
    kv_connector: str = KvConnector.NIXL,
    scale_targets: dict[str, Any] | None = None,
) -> Cluster:
    return _create(
        Cluster,
        {
            "name": name,
            "kind": kind,
            "site_id": site_id,
            "accelerator_id": accelerator_id,
            "model_id": model_id,
            "kv_connector": kv_connector,
            "scale_targets": scale_targets or {},
        },
        actor=actor,
    )


def cluster_update(
    *, cluster_id: int, version: int, changes: Mapping[str, Any], actor: Actor
) -> Cluster:
    """Update a cluster; a kind change is refused while instances or links forbid it."""
    return _update(Cluster, cluster_id, version=version, changes=changes, actor=actor)


def cluster_delete(*, cluster_id: int, version: int, actor: Actor) -> None:
    _delete(Cluster, cluster_id, version=version, actor=actor)


# Instances -----------------------------------------------------------------------------------


def instance_create(
    *,
    actor: Actor,
    cluster_id: int,
    name: str,
    role: str,
    state: str = InstanceState.ACTIVE,
    endpoint: str = "",
    labels: dict[str, str] | None = None,
    origin: str = InstanceOrigin.DECLARED,
    engine: str = "",
    engine_version: str = "",
    action: str = "create",
    cause: str = "",
) -> Instance:
    return _create(
        Instance,
        {
            "cluster_id": cluster_id,
            "name": name,
            "role": role,
            "state": state,
            "endpoint": endpoint,
            "labels": labels or {},
            "origin": origin,
            "engine": engine,
            "engine_version": engine_version,
        },
        actor=actor,
        action=action,
        cause=cause,
    )


def instance_update(
    *,
    instance_id: int,
    version: int,
    changes: Mapping[str, Any],
    actor: Actor,
    action: str = "update",
    cause: str = "",
) -> Instance:
    """Update an instance; ``action`` and ``cause`` say in the change log what changed it
    when it was not a plain edit (a registration, a missed heartbeat)."""
    return _update(
        Instance,
        instance_id,
        version=version,
        changes=changes,
        actor=actor,
        action=action,
        cause=cause,
    )


def instance_delete(
    *, instance_id: int, version: int, actor: Actor, action: str = "delete", cause: str = ""
) -> None:
    _delete(Instance, instance_id, version=version, actor=actor, action=action, cause=cause)


def _instance_state_set(
    instance_id: int, state: str, *, version: int | None, actor: Actor, action: str
) -> Instance:
    if version is None:
        version = _get(Instance, instance_id).version
    return _update(
        Instance, instance_id, version=version, changes={"state": state}, actor=actor, action=action
    )


def instance_drain(*, instance_id: int, actor: Actor, version: int | None = None) -> Instance:
    """Stop sending new work to an instance; it finishes what it has. ``version`` optional."""
    return _instance_state_set(
        instance_id, InstanceState.DRAINING, version=version, actor=actor, action="drain"
    )


def instance_activate(*, instance_id: int, actor: Actor, version: int | None = None) -> Instance:
    """Put a draining or down instance back into service. ``version`` optional."""
    return _instance_state_set(
        instance_id, InstanceState.ACTIVE, version=version, actor=actor, action="activate"
    )


# Links ---------------------------------------------------------------------------------------


def link_create(
    *,
    actor: Actor,
    source_id: int,
    target_id: int,
    gbps: float,
    rtt_ms: float,
    kv_budget_bytes: int | None = None,
    target_utilisation: float | None = None,
) -> Link:
    return _create(
        Link,
        {
            "source_id": source_id,
            "target_id": target_id,
            "gbps": gbps,
            "rtt_ms": rtt_ms,
            "kv_budget_bytes": kv_budget_bytes,
            "target_utilisation": target_utilisation,
        },
        actor=actor,
    )


def link_update(*, link_id: int, version: int, changes: Mapping[str, Any], actor: Actor) -> Link:
    return _update(Link, link_id, version=version, changes=changes, actor=actor)


def link_delete(*, link_id: int, version: int, actor: Actor) -> None:
    _delete(Link, link_id, version=version, actor=actor)


# Admin ---------------------------------------------------------------------------------------


def inventory_admin_save(
    *, obj: Versioned, is_new: bool, actor: Actor, version: int | None = None
) -> Versioned:
    """Save an object edited in the admin through the same rules, version bump and audit.

    The admin form has already applied its fields to ``obj``; ``version`` is the one the form
    was rendered with, so two admins editing the same row cannot silently overwrite each other.
    """
    model = type(obj)
    values = {name: getattr(obj, name) for name in EDITABLE[model]}
    if is_new:
        return _create(model, values, actor=actor)
    expected = obj.version if version is None else version
    return _update(model, obj.pk, version=expected, changes=values, actor=actor)


def inventory_admin_delete(*, obj: Versioned, actor: Actor) -> None:
    _delete(type(obj), obj.pk, version=obj.version, actor=actor)
