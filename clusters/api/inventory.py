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

The services are ``clusters.services.<name>_create|_update|_delete``, the operation ids
``<name>_list|_get|_create|_update|_delete`` (as when they were written by hand).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from ninja import Query, Router, Schema, Status
from ninja.pagination import paginate

from clusters import selectors, services
from clusters.api.schemas import (
    AcceleratorIn,
    AcceleratorOut,
    AcceleratorPatch,
    ClusterIn,
    ClusterOut,
    ClusterPatch,
    InstanceIn,
    InstanceOut,
    InstancePatch,
    Kind,
    LinkIn,
    LinkOut,
    LinkPatch,
    ModelProfileIn,
    ModelProfileOut,
    ModelProfilePatch,
    PerformanceProfileIn,
    PerformanceProfileOut,
    PerformanceProfilePatch,
    Role,
    SiteIn,
    SiteOut,
    SitePatch,
    State,
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
    kind: Kind | None = None
    site_id: int | None = None
    accelerator_id: int | None = None
    model_id: int | None = None


class InstanceFilter(Schema):
    name: str | None = None
    cluster_id: int | None = None
    role: Role | None = None
    state: State | None = None


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

    @property
    def id_param(self) -> str:
        return f"{self.name}_id"

    def service(self, verb: str) -> Callable[..., Any]:
        service: Callable[..., Any] = getattr(services, f"{self.name}_{verb}")
        return service


RESOURCES: tuple[Resource, ...] = (
    Resource("sites", "site", Site, SiteOut, SiteIn, SitePatch, NameFilter, selectors.site_list),
    Resource(
        "accelerators",
        "accelerator",
        Accelerator,
        AcceleratorOut,
        AcceleratorIn,
        AcceleratorPatch,
        NameFilter,
        selectors.accelerator_list,
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
    ),
    Resource("links", "link", Link, LinkOut, LinkIn, LinkPatch, LinkFilter, selectors.link_list),
)


def _named(fn: Callable[..., Any], name: str, params: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` under the operation's name, its keyword parameters declared as ``params``
    (name -> (annotation, default)) so that ninja sees e.g. ``site_id: int`` in the path."""
    request = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    declared = [
        inspect.Parameter(
            key,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=annotation,
            default=inspect.Parameter.empty if default is ... else default,
        )
        for key, (annotation, default) in params.items()
    ]
    fn.__signature__ = inspect.Signature([request, *declared])  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = name
    return fn


def resource_routes(r: Resource) -> None:
    """Register the five operations of ``r`` on the inventory router."""
    item = f"/{r.path}/{{{r.id_param}}}"

    def list_(request: HttpRequest, **kw: Any) -> QuerySet[Any]:
        return r.select(**kw["filters"].model_dump())

    def get(request: HttpRequest, **kw: Any) -> Versioned:
        return selectors.inventory_get(r.model, kw[r.id_param])

    def create(request: HttpRequest, **kw: Any) -> Status[Model]:
        made = r.service("create")(
            actor=actor_from_request(request), **payload_fields(kw["payload"])
        )
        return Status(201, made)

    def update(request: HttpRequest, **kw: Any) -> Model:
        payload = kw["payload"]
        return r.service("update")(
            **{r.id_param: kw[r.id_param]},
            version=payload.version,
            changes=payload_fields(payload, exclude={"version"}),
            actor=actor_from_request(request),
        )

    def delete(request: HttpRequest, **kw: Any) -> HttpResponse:
        r.service("delete")(
            **{r.id_param: kw[r.id_param]}, version=kw["version"], actor=actor_from_request(request)
        )
        return HttpResponse(status=204)

    listing: Any = list[r.out]  # type: ignore[name-defined]  # a schema known at run time
    filters: Any = Query[r.filters]  # type: ignore[name-defined,misc]
    router.get(f"/{r.path}", response=listing, auth=READ)(
        paginate(BoundedLimitOffsetPagination)(
            _named(list_, f"{r.name}_list", {"filters": (filters, ...)})
        )
    )
    router.get(item, response=r.out, auth=READ)(
        _named(get, f"{r.name}_get", {r.id_param: (int, ...)})
    )
    router.post(f"/{r.path}", response={201: r.out}, auth=ADMIN)(
        _named(create, f"{r.name}_create", {"payload": (r.create, ...)})
    )
    router.patch(item, response=r.out, auth=ADMIN)(
        _named(update, f"{r.name}_update", {r.id_param: (int, ...), "payload": (r.patch, ...)})
    )
    router.delete(item, response={204: None}, auth=ADMIN)(
        _named(
            delete,
            f"{r.name}_delete",
            {
                r.id_param: (int, ...),
                "version": (
                    int,
                    Query(
                        ...,
                        ge=1,
                        le=MAX_VERSION,
                        description="the version you last read; stale -> 409",
                    ),
                ),
            },
        )
    )


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
