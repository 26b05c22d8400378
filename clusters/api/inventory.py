"""Inventory CRUD: sites, accelerators, model and performance profiles, clusters, instances,
links. Reads need the ``read`` scope, writes ``admin``, drain/activate ``operate``.

Each resource is one row of :data:`RESOURCES` (NetBox-style: declared, not hand-written):
its path, model, schemas, list filters and the selector and services behind it. The routes
of every row are the same five operations:

* ``GET /{path}``: paginated (``?limit=&offset=``, answer ``{items, count}``) in a stable
  order, filtered by the row's query parameters;
* ``GET /{path}/{id}``, ``POST /{path}`` (201);
* ``PATCH /{path}/{id}`` with the ``version`` last read; ``DELETE /{path}/{id}?version=N``
  (required). A stale version gets 409 naming the current one.

Each row names its services (``clusters.services.<name>_create|_update|_delete``), so a missing
one fails at import; the operations are named ``<name>_list|_get|_create|_update|_delete``
(:func:`_names`).

The operations are closures per row with real signatures: this module evaluates annotations
when a function is defined (no ``from __future__ import annotations``), so a row's schemas
are the parameters' types, and its id's path name is the parameter's alias.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from ninja import Path, Query, Router, Schema, Status
from ninja.pagination import paginate

from clusters import selectors, services
from clusters.api.schemas import (
    AcceleratorIn,
    AcceleratorOut,
    AcceleratorPatch,
    ClusterIn,
    ClusterKind,
    ClusterOut,
    ClusterPatch,
    InstanceIn,
    InstanceOut,
    InstancePatch,
    InstanceRole,
    InstanceState,
    LinkIn,
    LinkOut,
    LinkPatch,
    ModelProfileIn,
    ModelProfileOut,
    ModelProfilePatch,
    PerformanceProfileIn,
    PerformanceProfileOut,
    PerformanceProfilePatch,
    SiteIn,
    SiteOut,
    SitePatch,
    payload_fields,
)
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
from controlplane.audit import actor_from_request
from controlplane.auth import TokenAuth
from controlplane.pagination import BoundedLimitOffsetPagination

router = Router(tags=["inventory"])

READ = TokenAuth("read")
ADMIN = TokenAuth("admin")
OPERATE = TokenAuth("operate")

# Versions are PostgreSQL integers: a larger number is a bad request, not a database error.
MAX_VERSION = 2**31 - 1


class NameFilter(Schema):
    name: str | None = None


class PerformanceProfileFilter(Schema):
    accelerator_id: int | None = None
    model_id: int | None = None


class ClusterFilter(Schema):
    name: str | None = None
    kind: ClusterKind | None = None
    site_id: int | None = None
    accelerator_id: int | None = None
    model_id: int | None = None


class InstanceFilter(Schema):
    name: str | None = None
    cluster_id: int | None = None
    role: InstanceRole | None = None
    state: InstanceState | None = None


class LinkFilter(Schema):
    source_id: int | None = None
    target_id: int | None = None


@dataclass(frozen=True)
class Resource:
    """One inventory resource as the API serves it."""

    path: str  # URL segment, e.g. "model-profiles"
    name: str  # service and operation prefix, e.g. "model_profile"
    model: type[Versioned]
    out: type[Schema]
    create: type[Schema]
    patch: type[Schema]
    filters: type[Schema]
    select: Callable[..., QuerySet[Any]]
    create_service: Callable[..., Any]
    update_service: Callable[..., Any]
    delete_service: Callable[..., Any]

    @property
    def id_param(self) -> str:
        return f"{self.name}_id"


RESOURCES: tuple[Resource, ...] = (
    Resource(
        "sites",
        "site",
        Site,
        SiteOut,
        SiteIn,
        SitePatch,
        NameFilter,
        selectors.site_list,
        services.site_create,
        services.site_update,
        services.site_delete,
    ),
    Resource(
        "accelerators",
        "accelerator",
        Accelerator,
        AcceleratorOut,
        AcceleratorIn,
        AcceleratorPatch,
        NameFilter,
        selectors.accelerator_list,
        services.accelerator_create,
        services.accelerator_update,
        services.accelerator_delete,
    ),
    Resource(
        "model-profiles",
        "model_profile",
        ModelProfile,
        ModelProfileOut,
        ModelProfileIn,
        ModelProfilePatch,
        NameFilter,
        selectors.model_profile_list,
        services.model_profile_create,
        services.model_profile_update,
        services.model_profile_delete,
    ),
    Resource(
        "performance-profiles",
        "performance_profile",
        PerformanceProfile,
        PerformanceProfileOut,
        PerformanceProfileIn,
        PerformanceProfilePatch,
        PerformanceProfileFilter,
        selectors.performance_profile_list,
        services.performance_profile_create,
        services.performance_profile_update,
        services.performance_profile_delete,
    ),
    Resource(
        "clusters",
        "cluster",
        Cluster,
        ClusterOut,
        ClusterIn,
        ClusterPatch,
        ClusterFilter,
        selectors.cluster_list,
        services.cluster_create,
        services.cluster_update,
        services.cluster_delete,
    ),
    Resource(
        "instances",
        "instance",
        Instance,
        InstanceOut,
        InstanceIn,
        InstancePatch,
        InstanceFilter,
        selectors.instance_list,
        services.instance_create,
        services.instance_update,
        services.instance_delete,
    ),
    Resource(
        "links",
        "link",
        Link,
        LinkOut,
        LinkIn,
        LinkPatch,
        LinkFilter,
        selectors.link_list,
        services.link_create,
        services.link_update,
        services.link_delete,
    ),
)


def _names(r: Resource, verb: str) -> dict[str, Any]:
    """The operation's id and summary, as ninja derives them for a module-level function
    ``<name>_<verb>`` of this module (the names clients' generated code already uses)."""
    name = f"{r.name}_{verb}"
    return {
        "operation_id": f"{__name__.replace('.', '_')}_{name}",
        "summary": name.replace("_", " ").title(),
    }


def resource_routes(r: Resource) -> None:
    """Register the five operations of ``r`` on the inventory router."""
    item = f"/{r.path}/{{{r.id_param}}}"
    pk_in_path = Path(..., alias=r.id_param)
    # Schemas known when the row is registered (mypy sees variables, not types).
    out: Any = r.out
    create_in: Any = r.create
    patch_in: Any = r.patch
    filters_in: Any = Query[r.filters]  # type: ignore[name-defined,misc]

    @router.get(f"/{r.path}", response=list[out], auth=READ, **_names(r, "list"))
    @paginate(BoundedLimitOffsetPagination)
    def list_(request: HttpRequest, filters: filters_in) -> QuerySet[Any]:
        return r.select(**filters.model_dump())

    @router.get(item, response=out, auth=READ, **_names(r, "get"))
    def get(request: HttpRequest, pk: int = pk_in_path) -> Versioned:
        return selectors.inventory_get(r.model, pk)

    @router.post(f"/{r.path}", response={201: out}, auth=ADMIN, **_names(r, "create"))
    def create(request: HttpRequest, payload: create_in) -> Status[Model]:
        made = r.create_service(actor=actor_from_request(request), **payload_fields(payload))
        return Status(201, made)

    @router.patch(item, response=out, auth=ADMIN, **_names(r, "update"))
    def update(request: HttpRequest, payload: patch_in, pk: int = pk_in_path) -> Model:
        return r.update_service(
            **{r.id_param: pk},
            version=payload.version,
            changes=payload_fields(payload, exclude={"version"}),
            actor=actor_from_request(request),
        )

    @router.delete(item, response={204: None}, auth=ADMIN, **_names(r, "delete"))
    def delete(
        request: HttpRequest,
        pk: int = pk_in_path,
        version: int = Query(
            ..., ge=1, le=MAX_VERSION, description="the version you last read; stale -> 409"
        ),
    ) -> HttpResponse:
        r.delete_service(**{r.id_param: pk}, version=version, actor=actor_from_request(request))
        return HttpResponse(status=204)


for _resource in RESOURCES:
    resource_routes(_resource)


# Instances also drain and activate (operators; no version needed, one may be given).


@router.post("/instances/{instance_id}/drain", response=InstanceOut, auth=OPERATE)
def instance_drain(
    request: HttpRequest, instance_id: int, version: int | None = Query(None, ge=1, le=MAX_VERSION)
) -> Instance:
    return services.instance_drain(
        instance_id=instance_id, version=version, actor=actor_from_request(request)
    )


@router.post("/instances/{instance_id}/activate", response=InstanceOut, auth=OPERATE)
def instance_activate(
    request: HttpRequest, instance_id: int, version: int | None = Query(None, ge=1, le=MAX_VERSION)
) -> Instance:
    return services.instance_activate(
        instance_id=instance_id, version=version, actor=actor_from_request(request)
    )
