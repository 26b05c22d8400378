"""Request and response shapes of the inventory API.

``<Entity>In`` creates, ``<Entity>Patch`` updates (only the fields sent change; ``version`` is the
one the caller last read), ``<Entity>Out`` is what every read returns. Inputs refuse unknown
fields, so a misspelt field is a 422 rather than silently ignored.
"""

from datetime import datetime
from typing import Any, Literal

from ninja import Schema
from pydantic import ConfigDict, Field

from controlplane.errors import Invalid

Table = list[tuple[int, float]]
Kind = Literal["prfaas", "pd"]
Role = Literal["prefill", "decode"]
State = Literal["active", "draining", "down"]


class StrictIn(Schema):
    model_config = ConfigDict(extra="forbid")


class PatchIn(StrictIn):
    version: int = Field(ge=1, description="the version you last read; stale -> 409")


class VersionedOut(Schema):
    id: int
    version: int
    created_at: datetime
    updated_at: datetime


class SiteIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    description: str = ""


class SitePatch(PatchIn):
    name: str | None = Field(None, min_length=1, max_length=100)
    description: str | None = None


class SiteOut(VersionedOut):
    name: str
    description: str


class AcceleratorIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    gpu_hour_cost: float = Field(gt=0)


class AcceleratorPatch(PatchIn):
    name: str | None = Field(None, min_length=1, max_length=100)
    gpu_hour_cost: float | None = Field(None, gt=0)


class AcceleratorOut(VersionedOut):
    name: str
    gpu_hour_cost: float


class ModelProfileIn(StrictIn):
    name: str = Field(min_length=1, max_length=200)
    attention: dict[str, Any] | None = None
    block_tokens: int = Field(gt=0)
    kv_cache_mib: Table
    linear_state_mib: float | None = Field(None, ge=0)


class ModelProfilePatch(PatchIn):
    name: str | None = Field(None, min_length=1, max_length=200)
    attention: dict[str, Any] | None = None
    block_tokens: int | None = Field(None, gt=0)
    kv_cache_mib: Table | None = None
    linear_state_mib: float | None = Field(None, ge=0)


class ModelProfileOut(VersionedOut):
    name: str
    attention: dict[str, Any] | None
    block_tokens: int
    kv_cache_mib: Table
    linear_state_mib: float | None


class PerformanceProfileIn(StrictIn):
    accelerator_id: int
    model_id: int
    gpus_per_instance: int = Field(gt=0)
    prefill_seconds: Table
    decode_max_batch: int | None = Field(None, gt=0)
    decode_step_seconds: float | None = Field(None, gt=0)


class PerformanceProfilePatch(PatchIn):
    accelerator_id: int | None = None
    model_id: int | None = None
    gpus_per_instance: int | None = Field(None, gt=0)
    prefill_seconds: Table | None = None
    decode_max_batch: int | None = Field(None, gt=0)
    decode_step_seconds: float | None = Field(None, gt=0)


class PerformanceProfileOut(VersionedOut):
    accelerator_id: int
    model_id: int
    gpus_per_instance: int
    prefill_seconds: Table
    decode_max_batch: int | None
    decode_step_seconds: float | None


class ClusterIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    kind: Kind
    site_id: int
    accelerator_id: int
    model_id: int


class ClusterPatch(PatchIn):
    name: str | None = Field(None, min_length=1, max_length=100)
    kind: Kind | None = None
    site_id: int | None = None
    accelerator_id: int | None = None
    model_id: int | None = None


class ClusterOut(VersionedOut):
    name: str
    kind: str
    site_id: int
    site: str
    accelerator_id: int
    accelerator: str
    model_id: int
    model: str

    @staticmethod
    def resolve_site(obj: Any) -> str:
        return str(obj.site.name)

    @staticmethod
    def resolve_accelerator(obj: Any) -> str:
        return str(obj.accelerator.name)

    @staticmethod
    def resolve_model(obj: Any) -> str:
        return str(obj.model.name)


class InstanceIn(StrictIn):
    cluster_id: int
    name: str = Field(min_length=1, max_length=150)
    role: Role
    state: State = "active"
    endpoint: str = Field("", max_length=500)
    labels: dict[str, str] = {}


class InstancePatch(PatchIn):
    cluster_id: int | None = None
    name: str | None = Field(None, min_length=1, max_length=150)
    role: Role | None = None
    state: State | None = None
    endpoint: str | None = Field(None, max_length=500)
    labels: dict[str, str] | None = None


class InstanceOut(VersionedOut):
    cluster_id: int
    cluster: str
    name: str
    role: str
    state: str
    endpoint: str
    labels: dict[str, str]

    @staticmethod
    def resolve_cluster(obj: Any) -> str:
        return str(obj.cluster.name)


class LinkIn(StrictIn):
    source_id: int
    target_id: int
    gbps: float = Field(ge=0, description="0 means the link is down")
    rtt_ms: float = Field(ge=0)
    kv_budget_bytes: int | None = Field(None, gt=0)


class LinkPatch(PatchIn):
    source_id: int | None = None
    target_id: int | None = None
    gbps: float | None = Field(None, ge=0)
    rtt_ms: float | None = Field(None, ge=0)
    kv_budget_bytes: int | None = Field(None, gt=0)


class LinkOut(VersionedOut):
    source_id: int
    source: str
    target_id: int
    target: str
    gbps: float
    rtt_ms: float
    kv_budget_bytes: int | None

    @staticmethod
    def resolve_source(obj: Any) -> str:
        return str(obj.source.name)

    @staticmethod
    def resolve_target(obj: Any) -> str:
        return str(obj.target.name)


# Fields that may be set to null explicitly in a PATCH; for all others null means "not sent".
NULLABLE_FIELDS = frozenset(
    {"attention", "linear_state_mib", "decode_max_batch", "decode_step_seconds", "kv_budget_bytes"}
)


TABLE_FIELDS = frozenset({"kv_cache_mib", "prefill_seconds"})


def payload_fields(payload: Schema, *, exclude: set[str] | None = None) -> dict[str, Any]:
    """The fields a request sets, tables as JSON lists; for a PATCH only those sent.

    A null for a field that cannot be empty is refused rather than read as "not sent".
    """
    sent = payload.model_dump(exclude_unset=True, exclude=exclude)
    for key, value in sent.items():
        if value is None and key not in NULLABLE_FIELDS:
            raise Invalid(f"{key}: may not be null")
        if key in TABLE_FIELDS:
            sent[key] = [list(point) for point in value]
    return sent
