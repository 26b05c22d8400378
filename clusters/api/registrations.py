"""``PUT /api/v1/registrations/{name}``: an agent registers the instance it runs beside.

Scope ``register``, bound to clusters (:mod:`clusters.registration` has the rules). 201 when
the instance was created, 200 when an existing one was re-bound (or nothing changed: a
restarted agent, a periodic re-registration, which also counts as a heartbeat).
"""

from typing import Annotated, Any

from django.http import HttpRequest
from ninja import Router, Schema, Status
from pydantic import ConfigDict, Field, StringConstraints

from clusters.api.schemas import InstanceOut, InstanceRole, KvConnector
from clusters.registration import Registration, instance_register
from controlplane.audit import actor_from_request
from controlplane.auth import TokenAuth
from controlplane.errors import ErrorOut

router = Router(tags=["registrations"])
REGISTER = TokenAuth("register")

InstanceName = Annotated[
    str, StringConstraints(min_length=1, max_length=150, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
Short = Annotated[str, StringConstraints(max_length=40, pattern=r"^[A-Za-z0-9._+-]*$")]


class RegistrationIn(Schema):
    model_config = ConfigDict(extra="forbid")

    cluster: str = Field(min_length=1, max_length=100)
    role: InstanceRole
    endpoint: str | None = Field(
        None,
        max_length=500,
        description="where a gateway sends the work (http(s) URL); left out: kept as it is",
    )
    accelerator: str = Field(
        min_length=1,
        max_length=100,
        description="the hardware profile: the cluster's accelerator, which must have a "
        "performance profile for the cluster's model",
    )
    kv_connector: KvConnector
    engine: Annotated[str, StringConstraints(min_length=1, max_length=40)] = Field(
        description="e.g. vllm, sglang, emulated"
    )
    engine_version: Short = ""


class RegistrationOut(Schema):
    created: bool
    changed: list[str] = Field(description="fields this registration changed")
    instance: InstanceOut


ERRORS = {401: ErrorOut, 403: ErrorOut, 409: ErrorOut, 422: ErrorOut, 429: ErrorOut}


@router.put(
    "/registrations/{name}",
    response={200: RegistrationOut, 201: RegistrationOut, **ERRORS},
    auth=REGISTER,
)
def registration_put(
    request: HttpRequest, name: InstanceName, payload: RegistrationIn
) -> Status[dict[str, Any]] | dict[str, Any]:
    """Create the instance or re-bind the name (idempotent; see ``docs/agent.md``)."""
    done = instance_register(
        registration=Registration(name=name, **payload.model_dump()),
        actor=actor_from_request(request),
        principal=request.auth,  # type: ignore[attr-defined]
    )
    body = {"created": done.created, "changed": list(done.changed), "instance": done.instance}
    return Status(201, body) if done.created else body
