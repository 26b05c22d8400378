"""``/api/v1/tokens``: list tokens (never their secrets) and set an agent or register token's
binding.

Admin scope: a binding decides what a machine may report for the whole fleet.
"""

from datetime import datetime
from typing import Annotated

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.pagination import paginate
from pydantic import ConfigDict, Field, StringConstraints

from controlplane.audit import actor_from_request
from controlplane.auth import TokenAuth
from controlplane.errors import ErrorOut
from controlplane.models import ApiToken
from controlplane.pagination import BoundedLimitOffsetPagination
from controlplane.selectors import token_list
from controlplane.services import MAX_BOUND_NAMES, MAX_NAME_CHARS, token_bind

router = Router(tags=["tokens"])
ADMIN = TokenAuth("admin")

BoundName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]


class TokenOut(Schema):
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    instances: list[str]
    links: list[str]
    clusters: list[str]
    fleet_wide: bool


class TokenBindingIn(Schema):
    model_config = ConfigDict(extra="forbid")

    instances: list[BoundName] = Field(default_factory=list, max_length=MAX_BOUND_NAMES)
    links: list[BoundName] = Field(
        default_factory=list,
        max_length=MAX_BOUND_NAMES,
        description="source->target (cluster names)",
    )
    clusters: list[BoundName] = Field(
        default_factory=list,
        max_length=MAX_BOUND_NAMES,
        description="clusters whose instances it reports for and registers",
    )
    fleet_wide: bool = False


@router.get("/tokens", response=list[TokenOut], auth=ADMIN)
@paginate(BoundedLimitOffsetPagination)
def token_list_api(request: HttpRequest):
    return token_list()


@router.put(
    "/tokens/{name}/binding",
    response={200: TokenOut, 404: ErrorOut, 422: ErrorOut},
    auth=ADMIN,
)
def token_binding_put(request: HttpRequest, name: str, payload: TokenBindingIn) -> ApiToken:
    """Replace what the token reports for; 403 ``outside_binding`` for anything else."""
    return token_bind(
        name=name,
        instances=payload.instances,
        links=payload.links,
        fleet_wide=payload.fleet_wide,
        actor=actor_from_request(request),
        clusters=payload.clusters,
    )
