"""Inventory CRUD: sites, accelerators, model and performance profiles, clusters, instances,
links. Reads need the ``read`` scope, writes ``admin``, drain/activate ``operate``.

Lists are paginated (``?limit=&offset=``, answer ``{items, count}``) in a stable order. Updates
are PATCH with the ``version`` last read; deletes take it as ``?version=N``
(required).
A stale version gets 409 naming the current one.
"""

from django.http import HttpRequest, HttpResponse
from ninja import Query, Router, Status
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
DELETE_VERSION = Query(
    ..., ge=1, le=MAX_VERSION, description="the version you last read; stale -> 409"
)


def _deleted() -> HttpResponse:
    return HttpResponse(status=204)


# Sites ---------------------------------------------------------------------------------------


@router.get("/sites", response=list[SiteOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def site_list(request: HttpRequest, name: str | None = None):
    return selectors.site_list(name=name)


@router.get("/sites/{site_id}", response=SiteOut, auth=READ)
def site_get(request: HttpRequest, site_id: int) -> Site:
    return selectors.inventory_get(Site, site_id)


@router.post("/sites", response={201: SiteOut}, auth=ADMIN)
def site_create(request: HttpRequest, payload: SiteIn) -> Status[Site]:
    return Status(
        201, services.site_create(actor=actor_from_request(request), **payload_fields(payload))
    )


@router.patch("/sites/{site_id}", response=SiteOut, auth=ADMIN)
def site_update(request: HttpRequest, site_id: int, payload: SitePatch) -> Site:
    return services.site_update(
        site_id=site_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/sites/{site_id}", response={204: None}, auth=ADMIN)
def site_delete(request: HttpRequest, site_id: int, version: int = DELETE_VERSION) -> HttpResponse:
    services.site_delete(
        site_id=site_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


# Accelerators --------------------------------------------------------------------------------


@router.get("/accelerators", response=list[AcceleratorOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def accelerator_list(request: HttpRequest, name: str | None = None):
    return selectors.accelerator_list(name=name)


@router.get("/accelerators/{accelerator_id}", response=AcceleratorOut, auth=READ)
def accelerator_get(request: HttpRequest, accelerator_id: int) -> Accelerator:
    return selectors.inventory_get(Accelerator, accelerator_id)


@router.post("/accelerators", response={201: AcceleratorOut}, auth=ADMIN)
def accelerator_create(request: HttpRequest, payload: AcceleratorIn) -> Status[Accelerator]:
    return Status(
        201,
        services.accelerator_create(actor=actor_from_request(request), **payload_fields(payload)),
    )


@router.patch("/accelerators/{accelerator_id}", response=AcceleratorOut, auth=ADMIN)
def accelerator_update(
    request: HttpRequest, accelerator_id: int, payload: AcceleratorPatch
) -> Accelerator:
    return services.accelerator_update(
        accelerator_id=accelerator_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/accelerators/{accelerator_id}", response={204: None}, auth=ADMIN)
def accelerator_delete(
    request: HttpRequest, accelerator_id: int, version: int = DELETE_VERSION
) -> HttpResponse:
    services.accelerator_delete(
        accelerator_id=accelerator_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


# Model profiles ------------------------------------------------------------------------------


@router.get("/model-profiles", response=list[ModelProfileOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def model_profile_list(request: HttpRequest, name: str | None = None):
    return selectors.model_profile_list(name=name)


@router.get("/model-profiles/{model_profile_id}", response=ModelProfileOut, auth=READ)
def model_profile_get(request: HttpRequest, model_profile_id: int) -> ModelProfile:
    return selectors.inventory_get(ModelProfile, model_profile_id)


@router.post("/model-profiles", response={201: ModelProfileOut}, auth=ADMIN)
def model_profile_create(request: HttpRequest, payload: ModelProfileIn) -> Status[ModelProfile]:
    return Status(
        201,
        services.model_profile_create(actor=actor_from_request(request), **payload_fields(payload)),
    )


@router.patch("/model-profiles/{model_profile_id}", response=ModelProfileOut, auth=ADMIN)
def model_profile_update(
    request: HttpRequest, model_profile_id: int, payload: ModelProfilePatch
) -> ModelProfile:
    return services.model_profile_update(
        model_profile_id=model_profile_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/model-profiles/{model_profile_id}", response={204: None}, auth=ADMIN)
def model_profile_delete(
    request: HttpRequest, model_profile_id: int, version: int = DELETE_VERSION
) -> HttpResponse:
    services.model_profile_delete(
        model_profile_id=model_profile_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


# Performance profiles ------------------------------------------------------------------------


@router.get("/performance-profiles", response=list[PerformanceProfileOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def performance_profile_list(
    request: HttpRequest, accelerator_id: int | None = None, model_id: int | None = None
):
    return selectors.performance_profile_list(accelerator_id=accelerator_id, model_id=model_id)


@router.get(
    "/performance-profiles/{performance_profile_id}", response=PerformanceProfileOut, auth=READ
)
def performance_profile_get(
    request: HttpRequest, performance_profile_id: int
) -> PerformanceProfile:
    return selectors.inventory_get(PerformanceProfile, performance_profile_id)


@router.post("/performance-profiles", response={201: PerformanceProfileOut}, auth=ADMIN)
def performance_profile_create(
    request: HttpRequest, payload: PerformanceProfileIn
) -> Status[PerformanceProfile]:
    return Status(
        201,
        services.performance_profile_create(
            actor=actor_from_request(request), **payload_fields(payload)
        ),
    )


@router.patch(
    "/performance-profiles/{performance_profile_id}", response=PerformanceProfileOut, auth=ADMIN
)
def performance_profile_update(
    request: HttpRequest, performance_profile_id: int, payload: PerformanceProfilePatch
) -> PerformanceProfile:
    return services.performance_profile_update(
        performance_profile_id=performance_profile_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/performance-profiles/{performance_profile_id}", response={204: None}, auth=ADMIN)
def performance_profile_delete(
    request: HttpRequest, performance_profile_id: int, version: int = DELETE_VERSION
) -> HttpResponse:
    services.performance_profile_delete(
        performance_profile_id=performance_profile_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


# Clusters ------------------------------------------------------------------------------------


@router.get("/clusters", response=list[ClusterOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def cluster_list(
    request: HttpRequest,
    name: str | None = None,
    kind: Kind | None = None,
    site_id: int | None = None,
    accelerator_id: int | None = None,
    model_id: int | None = None,
):
    return selectors.cluster_list(
        name=name, kind=kind, site_id=site_id, accelerator_id=accelerator_id, model_id=model_id
    )


@router.get("/clusters/{cluster_id}", response=ClusterOut, auth=READ)
def cluster_get(request: HttpRequest, cluster_id: int) -> Cluster:
    return selectors.inventory_get(Cluster, cluster_id)


@router.post("/clusters", response={201: ClusterOut}, auth=ADMIN)
def cluster_create(request: HttpRequest, payload: ClusterIn) -> Status[Cluster]:
    return Status(
        201, services.cluster_create(actor=actor_from_request(request), **payload_fields(payload))
    )


@router.patch("/clusters/{cluster_id}", response=ClusterOut, auth=ADMIN)
def cluster_update(request: HttpRequest, cluster_id: int, payload: ClusterPatch) -> Cluster:
    return services.cluster_update(
        cluster_id=cluster_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/clusters/{cluster_id}", response={204: None}, auth=ADMIN)
def cluster_delete(
    request: HttpRequest, cluster_id: int, version: int = DELETE_VERSION
) -> HttpResponse:
    services.cluster_delete(
        cluster_id=cluster_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


# Instances -----------------------------------------------------------------------------------


@router.get("/instances", response=list[InstanceOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def instance_list(
    request: HttpRequest,
    name: str | None = None,
    cluster_id: int | None = None,
    role: Role | None = None,
    state: State | None = None,
):
    return selectors.instance_list(name=name, cluster_id=cluster_id, role=role, state=state)


@router.get("/instances/{instance_id}", response=InstanceOut, auth=READ)
def instance_get(request: HttpRequest, instance_id: int) -> Instance:
    return selectors.inventory_get(Instance, instance_id)


@router.post("/instances", response={201: InstanceOut}, auth=ADMIN)
def instance_create(request: HttpRequest, payload: InstanceIn) -> Status[Instance]:
    return Status(
        201, services.instance_create(actor=actor_from_request(request), **payload_fields(payload))
    )


@router.patch("/instances/{instance_id}", response=InstanceOut, auth=ADMIN)
def instance_update(request: HttpRequest, instance_id: int, payload: InstancePatch) -> Instance:
    return services.instance_update(
        instance_id=instance_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/instances/{instance_id}", response={204: None}, auth=ADMIN)
def instance_delete(
    request: HttpRequest, instance_id: int, version: int = DELETE_VERSION
) -> HttpResponse:
    services.instance_delete(
        instance_id=instance_id,
        version=version,
        actor=actor_from_request(request),
    )
    return _deleted()


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


# Links ---------------------------------------------------------------------------------------


@router.get("/links", response=list[LinkOut], auth=READ)
@paginate(BoundedLimitOffsetPagination)
def link_list(request: HttpRequest, source_id: int | None = None, target_id: int | None = None):
    return selectors.link_list(source_id=source_id, target_id=target_id)


@router.get("/links/{link_id}", response=LinkOut, auth=READ)
def link_get(request: HttpRequest, link_id: int) -> Link:
    return selectors.inventory_get(Link, link_id)


@router.post("/links", response={201: LinkOut}, auth=ADMIN)
def link_create(request: HttpRequest, payload: LinkIn) -> Status[Link]:
    return Status(
        201, services.link_create(actor=actor_from_request(request), **payload_fields(payload))
    )


@router.patch("/links/{link_id}", response=LinkOut, auth=ADMIN)
def link_update(request: HttpRequest, link_id: int, payload: LinkPatch) -> Link:
    return services.link_update(
        link_id=link_id,
        version=payload.version,
        changes=payload_fields(payload, exclude={"version"}),
        actor=actor_from_request(request),
    )


@router.delete("/links/{link_id}", response={204: None}, auth=ADMIN)
def link_delete(request: HttpRequest, link_id: int, version: int = DELETE_VERSION) -> HttpResponse:
    services.link_delete(link_id=link_id, version=version, actor=actor_from_request(request))
    return _deleted()
