"""Request and response shapes of the inventory API.

``<Entity>In`` creates, ``<Entity>Patch`` updates (only the fields sent change; ``version`` is the
one the caller last read), ``<Entity>Out`` is what every read returns. Inputs refuse unknown
fields, so a misspelt field is a 422 rather than silently ignored.
"""

from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from ninja import Schema
from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from controlplane.errors import Invalid
from scheduling.core import bounds
from scheduling.core.kinds import ClusterKind, InstanceRole, InstanceState, KvConnector

# A table as read back: [[tokens, value], ...]. Pairs are fixed-length arrays rather than tuples
# because some OpenAPI tools (schemathesis among them) mis-read ``prefixItems`` in responses.
Table = list[Annotated[list[int | float], Field(min_length=2, max_length=2)]]


# What a request may send as a table: at least two points (interpolation needs a segment) of a
# positive token count and a positive value, no point twice. That tokens increase, which JSON
# Schema cannot say, is checked by the model (422).
_TABLE = Field(
    min_length=2,
    max_length=1_000,
    description="[[tokens, value], ...] with tokens strictly increasing",
    json_schema_extra={"uniqueItems": True},
)
_TOKENS = Annotated[int, Field(ge=bounds.TABLE_TOKENS.low, le=bounds.TABLE_TOKENS.high)]
KvTableIn = Annotated[
    list[
        tuple[
            _TOKENS,
            Annotated[
                float,
                Field(allow_inf_nan=False, gt=0, le=bounds.KV_CACHE_MIB.high),
            ],
        ]
    ],
    _TABLE,
]
PrefillTableIn = Annotated[
    list[
        tuple[
            _TOKENS,
            Annotated[
                float,
                Field(allow_inf_nan=False, gt=0, le=bounds.PREFILL_SECONDS.high),
            ],
        ]
    ],
    _TABLE,
]
# Finite numbers within their physical bounds (scheduling.core.bounds), as the schema says.
Gbps = Annotated[
    float,
    Field(
        allow_inf_nan=False,
        ge=0,
        le=bounds.LINK_GBPS.high,
        description="0 means the link is down",
    ),
]
RttMs = Annotated[float, Field(allow_inf_nan=False, ge=0, le=bounds.LINK_RTT_MS.high)]
KvBudgetBytes = Annotated[int, Field(gt=0, le=int(bounds.LINK_KV_BUDGET_BYTES.high))]
TargetUtilisation = Annotated[
    float,
    Field(allow_inf_nan=False, gt=0, le=1, description="mean egress share planned at most"),
]
GpuHourCost = Annotated[float, Field(allow_inf_nan=False, gt=0, le=bounds.GPU_HOUR_COST.high)]
BlockTokens = Annotated[int, Field(ge=1, le=bounds.BLOCK_TOKENS.high)]
LinearStateMib = Annotated[float, Field(allow_inf_nan=False, ge=0, le=bounds.LINEAR_STATE_MIB.high)]
GpusPerInstance = Annotated[int, Field(ge=1, le=bounds.GPUS_PER_INSTANCE.high)]
DecodeMaxBatch = Annotated[int, Field(ge=1, le=bounds.DECODE_MAX_BATCH.high)]
DecodeStepSeconds = Annotated[
    float, Field(allow_inf_nan=False, gt=0, le=bounds.DECODE_STEP_SECONDS.high)
]
# PostgreSQL integer columns: a larger number is a bad request, not a database error.
MAX_INT = 2**31 - 1
MAX_BIGINT = 2**63 - 1
# A reference to another row: a 64-bit integer, as JSON parsers and the database read it (an
# unknown one is a 404 naming it).
RefId = Annotated[int, Field(ge=-MAX_BIGINT - 1, le=MAX_BIGINT)]


# Fields that may be set to null explicitly in a PATCH; any other field may be left out, not null.
NULLABLE_FIELDS = frozenset(
    {
        "attention",
        "linear_state_mib",
        "decode_max_batch",
        "decode_step_seconds",
        "kv_budget_bytes",
        "target_utilisation",
    }
)

TABLE_FIELDS = frozenset({"kv_cache_mib", "prefill_seconds"})

# A PATCH field that may be left out but not sent as null: the schema shows only its type, and
# ``PatchIn`` refuses a null for it (422), as the schema says.
Omitted = SkipJsonSchema[None]


def _is_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    return any(_is_number(arg) for arg in get_args(annotation))


def _not_a_json_number(value: Any) -> bool:
    return isinstance(value, bool | str)


class StrictIn(Schema):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_as_json_means_them(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic's lax mode would read true or "5" as a number; the schema says number."""
        name = info.field_name or ""
        if name in TABLE_FIELDS and isinstance(value, list):
            for point in value:
                if isinstance(point, list) and any(_not_a_json_number(p) for p in point):
                    raise ValueError("a point must be a pair of numbers")
        elif _not_a_json_number(value) and _is_number(cls.model_fields[name].annotation):
            raise ValueError("must be a number")
        return value


class PatchIn(StrictIn):
    @field_validator("*", mode="before")
    @classmethod
    def _null_only_where_meaningful(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name not in NULLABLE_FIELDS:
            raise ValueError("may not be null")
        return value

    version: int = Field(ge=1, le=MAX_INT, description="the version you last read; stale -> 409")


class VersionedOut(Schema):
    id: int
    version: int
    created_at: datetime
    updated_at: datetime


class SiteIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    description: str = ""


class SitePatch(PatchIn):
    name: Annotated[str, Field(min_length=1, max_length=100)] | Omitted = None
    description: str | Omitted = None


class SiteOut(VersionedOut):
    name: str
    description: str


class AcceleratorIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    gpu_hour_cost: GpuHourCost


class AcceleratorPatch(PatchIn):
    name: Annotated[str, Field(min_length=1, max_length=100)] | Omitted = None
    gpu_hour_cost: GpuHourCost | Omitted = None


class AcceleratorOut(VersionedOut):
    name: str
    gpu_hour_cost: float


class ModelProfileIn(StrictIn):
    name: str = Field(min_length=1, max_length=200)
    attention: dict[str, Any] | None = None
    block_tokens: BlockTokens
    kv_cache_mib: KvTableIn
    linear_state_mib: LinearStateMib | None = None


class ModelProfilePatch(PatchIn):
    name: Annotated[str, Field(min_length=1, max_length=200)] | Omitted = None
    attention: dict[str, Any] | None = None
    block_tokens: BlockTokens | Omitted = None
    kv_cache_mib: KvTableIn | Omitted = None
    linear_state_mib: LinearStateMib | None = None


class ModelProfileOut(VersionedOut):
    name: str
    attention: dict[str, Any] | None
    block_tokens: int
    kv_cache_mib: Table
    linear_state_mib: float | None


class PerformanceProfileIn(StrictIn):
    accelerator_id: RefId
    model_id: RefId
    gpus_per_instance: GpusPerInstance
    prefill_seconds: PrefillTableIn
    decode_max_batch: DecodeMaxBatch | None = None
    decode_step_seconds: DecodeStepSeconds | None = None


class PerformanceProfilePatch(PatchIn):
    accelerator_id: RefId | Omitted = None
    model_id: RefId | Omitted = None
    gpus_per_instance: GpusPerInstance | Omitted = None
    prefill_seconds: PrefillTableIn | Omitted = None
    decode_max_batch: DecodeMaxBatch | None = None
    decode_step_seconds: DecodeStepSeconds | None = None


class PerformanceProfileOut(VersionedOut):
    accelerator_id: int
    model_id: int
    gpus_per_instance: int
    prefill_seconds: Table
    decode_max_batch: int | None
    decode_step_seconds: float | None


class ScaleTargetIn(StrictIn):
    """One role's Kubernetes object with ``/scale`` (docs/actuators.md): a known ``kind``, or
    ``api_version`` and ``plural`` for any other."""

    name: str = Field(min_length=1, max_length=253)
    kind: Annotated[str, Field(min_length=1, max_length=63)] | Omitted = None
    api_version: Annotated[str, Field(min_length=1, max_length=253)] | Omitted = None
    plural: Annotated[str, Field(min_length=1, max_length=63)] | Omitted = None
    namespace: Annotated[str, Field(min_length=1, max_length=63)] | Omitted = None
    removal: Literal["deletion_cost", "highest_ordinal"] | Omitted = None
    context: Annotated[str, Field(min_length=1, max_length=253)] | Omitted = None


class ScaleTargetsIn(StrictIn):
    prefill: ScaleTargetIn | Omitted = None
    decode: ScaleTargetIn | Omitted = None


class ClusterIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    kind: ClusterKind
    site_id: RefId
    accelerator_id: RefId
    model_id: RefId
    kv_connector: KvConnector = KvConnector.NIXL
    scale_targets: ScaleTargetsIn | Omitted = None


class ClusterPatch(PatchIn):
    name: Annotated[str, Field(min_length=1, max_length=100)] | Omitted = None
    kind: ClusterKind | Omitted = None
    site_id: RefId | Omitted = None
    accelerator_id: RefId | Omitted = None
    model_id: RefId | Omitted = None
    kv_connector: KvConnector | Omitted = None
    scale_targets: ScaleTargetsIn | Omitted = None


class ClusterOut(VersionedOut):
    name: str
    kind: str
    kv_connector: str
    scale_targets: dict[str, dict[str, str]]
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
    cluster_id: RefId
    name: str = Field(min_length=1, max_length=150)
    role: InstanceRole
    state: InstanceState = InstanceState.ACTIVE
    endpoint: str = Field("", max_length=500)
    labels: dict[str, str] = {}


class InstancePatch(PatchIn):
    cluster_id: RefId | Omitted = None
    name: Annotated[str, Field(min_length=1, max_length=150)] | Omitted = None
    role: InstanceRole | Omitted = None
    state: InstanceState | Omitted = None
    endpoint: Annotated[str, Field(max_length=500)] | Omitted = None
    labels: dict[str, str] | Omitted = None


class InstanceOut(VersionedOut):
    cluster_id: int
    cluster: str
    name: str
    role: str
    state: str
    endpoint: str
    labels: dict[str, str]
    origin: str = Field(description="declared (topology, API) or registered by its agent")
    engine: str = Field(description="what its agent registered, e.g. vllm (empty: declared)")
    engine_version: str

    @staticmethod
    def resolve_cluster(obj: Any) -> str:
        return str(obj.cluster.name)


class LinkIn(StrictIn):
    source_id: RefId
    target_id: RefId
    gbps: Gbps
    rtt_ms: RttMs
    kv_budget_bytes: KvBudgetBytes | None = None
    target_utilisation: TargetUtilisation | None = Field(
        None, description="mean egress share planned at most; null: router's guard"
    )


class LinkPatch(PatchIn):
    source_id: RefId | Omitted = None
    target_id: RefId | Omitted = None
    gbps: Gbps | Omitted = None
    rtt_ms: RttMs | Omitted = None
    kv_budget_bytes: KvBudgetBytes | None = None
    target_utilisation: TargetUtilisation | None = None


class LinkOut(VersionedOut):
    source_id: int
    source: str
    target_id: int
    target: str
    gbps: float
    rtt_ms: float
    kv_budget_bytes: int | None
    target_utilisation: float | None

    @staticmethod
    def resolve_source(obj: Any) -> str:
        return str(obj.source.name)

    @staticmethod
    def resolve_target(obj: Any) -> str:
        return str(obj.target.name)


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
