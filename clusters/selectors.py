"""Reads of the inventory, in a stable order (name, then id) so that pages never shuffle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from django.db.models import QuerySet

from clusters.models import (
    Accelerator,
    Cluster,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    Versioned,
)
from controlplane.errors import NotFound
from scheduling.core.link import link_key

M = TypeVar("M", bound=Versioned)


def _filtered(queryset: QuerySet[M], filters: dict[str, Any]) -> QuerySet[M]:
    """Apply the filters that were given (None means "not filtered")."""
    return queryset.filter(**{k: v for k, v in filters.items() if v is not None})


def inventory_get(model: type[M], pk: int) -> M:
    """One object by id, or NotFound naming what was asked."""
    obj = model._default_manager.filter(pk=pk).first()
    if obj is None:
        raise NotFound(f"{model._meta.verbose_name} {pk} does not exist")
    return obj


def site_list(*, name: str | None = None) -> QuerySet[Site]:
    return _filtered(Site.objects.order_by("name", "id"), {"name__icontains": name})


def accelerator_list(*, name: str | None = None) -> QuerySet[Accelerator]:
    return _filtered(Accelerator.objects.order_by("name", "id"), {"name__icontains": name})


def model_profile_list(*, name: str | None = None) -> QuerySet[ModelProfile]:
    return _filtered(ModelProfile.objects.order_by("name", "id"), {"name__icontains": name})


def performance_profile_list(
    *, accelerator_id: int | None = None, model_id: int | None = None
) -> QuerySet[PerformanceProfile]:
    return _filtered(
        PerformanceProfile.objects.select_related("accelerator", "model").order_by("id"),
        {"accelerator_id": accelerator_id, "model_id": model_id},
    )


def cluster_list(
    *,
    name: str | None = None,
    kind: str | None = None,
    site_id: int | None = None,
    accelerator_id: int | None = None,
    model_id: int | None = None,
) -> QuerySet[Cluster]:
    return _filtered(
        Cluster.objects.select_related("site", "accelerator", "model").order_by("name", "id"),
        {
            "name__icontains": name,
            "kind": kind,
            "site_id": site_id,
            "accelerator_id": accelerator_id,
            "model_id": model_id,
        },
    )


def instance_list(
    *,
    name: str | None = None,
    cluster_id: int | None = None,
    role: str | None = None,
    state: str | None = None,
) -> QuerySet[Instance]:
    return _filtered(
        Instance.objects.select_related("cluster").order_by("name", "id"),
        {"name__icontains": name, "cluster_id": cluster_id, "role": role, "state": state},
    )


def link_list(*, source_id: int | None = None, target_id: int | None = None) -> QuerySet[Link]:
    return _filtered(
        Link.objects.select_related("source", "target").order_by("id"),
        {"source_id": source_id, "target_id": target_id},
    )


def inventory_names_missing(
    instances: Sequence[str], links: Sequence[tuple[str, str]]
) -> tuple[list[str], list[str]]:
    """The instance names and links ``(source, target)`` the inventory does not have (links
    as ``source->target``), for a token binding to be refused when it is written."""
    known = set(Instance.objects.filter(name__in=instances).values_list("name", flat=True))
    pairs = set(
        Link.objects.filter(
            source__name__in={s for s, _ in links}, target__name__in={t for _, t in links}
        ).values_list("source__name", "target__name")
    )
    return (
        [name for name in instances if name not in known],
        [link_key(s, t) for s, t in links if (s, t) not in pairs],
    )
