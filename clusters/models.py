"""Inventory of a PrfaaS deployment: where the hardware is, what it serves, how it is joined.

Every row carries a ``version`` (bumped by each write, used for optimistic concurrency) and
created/updated timestamps. What must always hold is a database constraint. Two rules span
tables (a link goes from a ``prfaas`` cluster to a ``pd`` cluster; a ``prfaas`` cluster has no
decode instance); PostgreSQL CHECK constraints cannot look at another table, so the cluster's
kind is denormalised onto links (``source_kind``, ``target_kind``) and instances
(``cluster_kind``), where CHECK constraints guard it. ``save()`` copies the kind from the
cluster, and ``cluster_update`` refuses a kind change that would break a rule and otherwise
propagates the new kind in the same transaction, so the copies never go stale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import models
from django.db.models import Q

from scheduling.core import bounds
from scheduling.core.bounds import Bound
from scheduling.core.kinds import ClusterKind as ClusterKind
from scheduling.core.kinds import InstanceRole as InstanceRole
from scheduling.core.kinds import InstanceState as InstanceState
from scheduling.core.kinds import KvConnector as KvConnector
from scheduling.core.link import link_key
from scheduling.core.scale_targets import ScaleTargetError, scale_targets_read

# The choices come from the core's enums (one definition of each value); the labels the pages
# show are the models' own.
CLUSTER_KIND_LABELS: dict[str, str] = {
    ClusterKind.PRFAAS: "PrfaaS (prefill only)",
    ClusterKind.PD: "PD (prefill and decode)",
}
KV_CONNECTOR_LABELS: dict[str, str] = {
    KvConnector.NIXL: "NixlConnector (kv_transfer_params)",
    KvConnector.SHARED_STORAGE: "shared storage (ExampleConnector, LMCache)",
}


def _choices(enum: type[StrEnum], labels: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    return [(m.value, (labels or {}).get(m, m.value)) for m in enum]


def _values(enum: type[StrEnum]) -> list[str]:
    return [m.value for m in enum]


class InstanceOrigin(models.TextChoices):
    """Where an instance comes from: declared (topology as code, the API, the admin) or
    registered by the agent beside its engine. Only registered instances are ever retired."""

    DECLARED = "declared", "declared"
    REGISTERED = "registered", "registered by its agent"


def table_errors(value: Any, *, positive_values: bool = True) -> list[str]:
    """Problems with a ``[[tokens, value], ...]`` table, each naming the entry (``[2]``).

    Tokens must be positive integers, strictly increasing; values positive numbers (or
    non-negative when ``positive_values`` is false). Interpolation needs a segment, so at least
    two points (the scenario reader asks the same).
    """
    if not isinstance(value, list) or len(value) < 2:
        return ["must be a list of at least two [tokens, value] points"]
    errors: list[str] = []
    previous: int | None = None
    for i, point in enumerate(value):
        if (
            not isinstance(point, list | tuple)
            or len(point) != 2
            or any(isinstance(p, bool) or not isinstance(p, int | float) for p in point)
        ):
            errors.append(f"[{i}]: must be a [tokens, value] pair of numbers")
            continue
        tokens, amount = point
        if tokens != int(tokens) or tokens <= 0:
            errors.append(f"[{i}][0]: tokens must be a positive integer")
        if amount < 0 or (positive_values and amount == 0):
            errors.append(f"[{i}][1]: must be {'positive' if positive_values else '>= 0'}")
        if previous is not None and tokens <= previous:
            errors.append(f"[{i}][0]: tokens must be strictly increasing (sorted by tokens)")
        previous = int(tokens)
    return errors


def _positive(value: Any) -> None:
    if value is not None and value <= 0:
        raise ValidationError("must be positive")


def _non_negative(value: Any) -> None:
    if value is not None and value < 0:
        raise ValidationError("must be >= 0")


def _fraction(value: Any) -> None:
    if value is not None and not (0 < value <= 1):
        raise ValidationError("must be within (0, 1]")


def _finite(value: Any) -> None:
    # A NaN passes every comparison validator; infinity is caught by the upper bounds.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError("must be a finite number")


def _at_most(bound: Bound) -> list[Any]:
    """Validators of ``bound``'s upper end (the lower end has its own, older validators)."""
    return [_finite, MaxValueValidator(bound.high)]


def _table_check(value: Any) -> None:
    errors = table_errors(value)
    if errors:
        raise ValidationError("; ".join(errors))


def _kv_table_check(value: Any) -> None:
    errors = table_errors(value) or bounds.table_bound_errors(value, bounds.KV_CACHE_MIB)
    if errors:
        raise ValidationError("; ".join(errors))


def _prefill_table_check(value: Any) -> None:
    errors = table_errors(value) or bounds.table_bound_errors(value, bounds.PREFILL_SECONDS)
    if errors:
        raise ValidationError("; ".join(errors))


def _at_most_q(field: str, bound: Bound, *, nullable: bool = False) -> Q:
    """``field <= bound.high`` for a CHECK constraint (PostgreSQL orders NaN and infinity
    above every number, so this refuses them too)."""
    q = Q(**{f"{field}__lte": bound.high})
    return Q(**{f"{field}__isnull": True}) | q if nullable else q


class Versioned(models.Model):
    """Shared bookkeeping: optimistic-concurrency version and timestamps."""

    version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


def _version_positive(name: str) -> models.CheckConstraint:
    return models.CheckConstraint(condition=Q(version__gte=1), name=f"{name}_version_positive")


class Site(Versioned):
    """A datacenter. Clusters live at sites; links between sites cross ordinary Ethernet."""

    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            _version_positive("site"),
            models.CheckConstraint(condition=~Q(name=""), name="site_name_not_empty"),
        ]

    def __str__(self) -> str:
        return self.name


class Accelerator(Versioned):
    """A kind of GPU (H200, H20, ...) with its relative price per GPU-hour."""

    name = models.CharField(max_length=100, unique=True)
    gpu_hour_cost = models.FloatField(
        help_text="relative price per GPU-hour (> 0)",
        validators=[_positive, *_at_most(bounds.GPU_HOUR_COST)],
    )

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            _version_positive("accelerator"),
            models.CheckConstraint(condition=~Q(name=""), name="accelerator_name_not_empty"),
            models.CheckConstraint(
                condition=Q(gpu_hour_cost__gt=0), name="accelerator_gpu_hour_cost_positive"
            ),
            models.CheckConstraint(
                condition=_at_most_q("gpu_hour_cost", bounds.GPU_HOUR_COST),
                name="accelerator_gpu_hour_cost_bounded",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ModelProfile(Versioned):
    """The served LLM as far as KVCache is concerned: how big one prefill's KVCache is at a
    given input length (S_kv), the prefix-cache block size, and the linear-attention state."""

    name = models.CharField(max_length=200, unique=True)
    attention = models.JSONField(
        null=True, blank=True, help_text="descriptive layout, e.g. {linear: KDA, full: MLA}"
    )
    block_tokens = models.PositiveIntegerField(
        help_text="prefix-cache block size in tokens",
        validators=[_positive, *_at_most(bounds.BLOCK_TOKENS)],
    )
    kv_cache_mib = models.JSONField(
        help_text="[[input_tokens, MiB], ...] sorted by tokens", validators=[_kv_table_check]
    )
    linear_state_mib = models.FloatField(
        null=True,
        blank=True,
        validators=[_non_negative, *_at_most(bounds.LINEAR_STATE_MIB)],
        help_text="request-level linear/SWA state; empty = table extrapolated to 0 tokens",
    )

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            _version_positive("modelprofile"),
            models.CheckConstraint(condition=~Q(name=""), name="modelprofile_name_not_empty"),
            models.CheckConstraint(
                condition=Q(block_tokens__gt=0), name="modelprofile_block_tokens_positive"
            ),
            models.CheckConstraint(
                condition=Q(linear_state_mib__isnull=True) | Q(linear_state_mib__gte=0),
                name="modelprofile_linear_state_non_negative",
            ),
            models.CheckConstraint(
                condition=_at_most_q("block_tokens", bounds.BLOCK_TOKENS),
                name="modelprofile_block_tokens_bounded",
            ),
            models.CheckConstraint(
                condition=_at_most_q("linear_state_mib", bounds.LINEAR_STATE_MIB, nullable=True),
                name="modelprofile_linear_state_bounded",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class PerformanceProfile(Versioned):
    """How fast one instance of an accelerator runs a model: prefill seconds by input length,
    and (for accelerators that decode) the decode batch and step time."""

    accelerator = models.ForeignKey(
        Accelerator, on_delete=models.PROTECT, related_name="performance_profiles"
    )
    model = models.ForeignKey(
        ModelProfile, on_delete=models.PROTECT, related_name="performance_profiles"
    )
    gpus_per_instance = models.PositiveIntegerField(
        validators=[_positive, *_at_most(bounds.GPUS_PER_INSTANCE)]
    )
    prefill_seconds = models.JSONField(
        help_text="[[input_tokens, seconds], ...] sorted by tokens",
        validators=[_prefill_table_check],
    )
    decode_max_batch = models.PositiveIntegerField(
        null=True, blank=True, validators=[_positive, *_at_most(bounds.DECODE_MAX_BATCH)]
    )
    decode_step_seconds = models.FloatField(
        null=True, blank=True, validators=[_positive, *_at_most(bounds.DECODE_STEP_SECONDS)]
    )

    class Meta:
        ordering = ["accelerator__name", "model__name", "id"]
        constraints = [
            _version_positive("performanceprofile"),
            models.UniqueConstraint(
                fields=["accelerator", "model"], name="performanceprofile_unique_accelerator_model"
            ),
            models.CheckConstraint(
                condition=Q(gpus_per_instance__gt=0), name="performanceprofile_gpus_positive"
            ),
            # Decode is described completely or not at all.
            models.CheckConstraint(
                condition=(
                    Q(decode_max_batch__isnull=True, decode_step_seconds__isnull=True)
                    # isnull=False spelt out: a comparison with NULL passes a CHECK.
                    | Q(
                        decode_max_batch__isnull=False,
                        decode_step_seconds__isnull=False,
                        decode_max_batch__gt=0,
                        decode_step_seconds__gt=0,
                    )
                ),
                name="performanceprofile_decode_complete_and_positive",
            ),
            models.CheckConstraint(
                condition=_at_most_q("gpus_per_instance", bounds.GPUS_PER_INSTANCE),
                name="performanceprofile_gpus_bounded",
            ),
            models.CheckConstraint(
                condition=_at_most_q("decode_max_batch", bounds.DECODE_MAX_BATCH, nullable=True)
                & _at_most_q("decode_step_seconds", bounds.DECODE_STEP_SECONDS, nullable=True),
                name="performanceprofile_decode_bounded",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.accelerator} x {self.model}"

    def clean(self) -> None:
        if (self.decode_max_batch is None) != (self.decode_step_seconds is None):
            raise ValidationError(
                {"decode_step_seconds": "decode_max_batch and decode_step_seconds go together"}
            )


class Cluster(Versioned):
    """One kind of hardware at one site serving one model. ``prfaas`` clusters only prefill
    (long uncached prompts, KVCache shipped over a link); ``pd`` clusters prefill and decode.
    ``kv_connector`` says which disaggregated protocol its engines speak."""

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=10, choices=_choices(ClusterKind, CLUSTER_KIND_LABELS))
    site = models.ForeignKey(Site, on_delete=models.PROTECT, related_name="clusters")
    accelerator = models.ForeignKey(Accelerator, on_delete=models.PROTECT, related_name="clusters")
    model = models.ForeignKey(ModelProfile, on_delete=models.PROTECT, related_name="clusters")
    kv_connector = models.CharField(
        max_length=20,
        choices=_choices(KvConnector, KV_CONNECTOR_LABELS),
        default=KvConnector.NIXL,
        help_text="the engines' KV-transfer protocol, as a gateway drives it",
    )
    # Per role, the Kubernetes object whose /scale the ``kubernetes`` actuator patches
    # (scheduling.core.scale_targets); stored with presets resolved, every field spelt out.
    scale_targets = models.JSONField(
        default=dict,
        blank=True,
        help_text="{role: {kind | api_version + plural, namespace, name, removal, context}}",
    )

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            _version_positive("cluster"),
            models.CheckConstraint(condition=~Q(name=""), name="cluster_name_not_empty"),
            models.CheckConstraint(
                condition=Q(kind__in=_values(ClusterKind)), name="cluster_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(kv_connector__in=_values(KvConnector)),
                name="cluster_kv_connector_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        try:
            targets = scale_targets_read(self.scale_targets, (), cluster_kind=self.kind)
        except ScaleTargetError as exc:
            raise ValidationError({"scale_targets": str(exc)}) from None
        # Stored resolved, so that a preset's defaults are visible and never change under it.
        self.scale_targets = {t.role: t.to_json() for t in targets}


class Instance(Versioned):
    """One model replica (e.g. 8 GPUs) in a cluster, serving as prefill or decode. Draining
    instances finish their work and take no new requests; down and unreachable instances take
    nothing. ``engine`` and ``engine_version`` are what its agent registered (empty when
    declared)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="instances")
    # Copy of cluster.kind so that a CHECK constraint can refuse decode in a prfaas cluster.
    cluster_kind = models.CharField(
        max_length=10, choices=_choices(ClusterKind, CLUSTER_KIND_LABELS), editable=False
    )
    name = models.CharField(max_length=150, unique=True)
    role = models.CharField(max_length=10, choices=_choices(InstanceRole))
    state = models.CharField(
        max_length=12, choices=_choices(InstanceState), default=InstanceState.ACTIVE
    )
    endpoint = models.URLField(max_length=500, blank=True, default="")
    labels = models.JSONField(default=dict, blank=True)
    origin = models.CharField(
        max_length=10, choices=InstanceOrigin.choices, default=InstanceOrigin.DECLARED
    )
    engine = models.CharField(max_length=40, blank=True, default="")
    engine_version = models.CharField(max_length=40, blank=True, default="")

    class Meta:
        ordering = ["cluster__name", "name", "id"]
        constraints = [
            _version_positive("instance"),
            models.CheckConstraint(condition=~Q(name=""), name="instance_name_not_empty"),
            models.CheckConstraint(
                condition=Q(role__in=_values(InstanceRole)), name="instance_role_valid"
            ),
            models.CheckConstraint(
                condition=Q(state__in=_values(InstanceState)), name="instance_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(origin__in=InstanceOrigin.values), name="instance_origin_valid"
            ),
            models.CheckConstraint(
                condition=~Q(cluster_kind=ClusterKind.PRFAAS, role=InstanceRole.DECODE),
                name="instance_no_decode_in_prfaas_cluster",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.cluster_kind = self.cluster.kind
        super().save(*args, **kwargs)

    def clean(self) -> None:
        if self.cluster_id is not None:
            self.cluster_kind = self.cluster.kind
        if (
            self.cluster_id is not None
            and self.role == InstanceRole.DECODE
            and self.cluster.kind == ClusterKind.PRFAAS
        ):
            raise ValidationError(
                {"role": "a prfaas cluster only prefills: it cannot hold a decode instance"}
            )
        if not isinstance(self.labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise ValidationError({"labels": "must be an object of string values"})


class Link(Versioned):
    """The Ethernet path that carries KVCache from a prfaas cluster to a pd cluster.

    ``gbps`` may be 0: a link that is down is still part of the topology (the router then
    keeps everything local); negative capacities are refused. ``kv_budget_bytes`` bounds the
    KVCache in flight on the link (reserved from the routing decision to the transfer's end);
    empty means derived from capacity. ``target_utilisation`` is the mean egress share the
    planner may plan onto it and at which the router calls its bandwidth scarce; empty means
    the router's guard. One model for router, planner and simulator: scheduling.core.link.
    """

    source = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="outgoing_links")
    target = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="incoming_links")
    source_kind = models.CharField(
        max_length=10, choices=_choices(ClusterKind, CLUSTER_KIND_LABELS), editable=False
    )
    target_kind = models.CharField(
        max_length=10, choices=_choices(ClusterKind, CLUSTER_KIND_LABELS), editable=False
    )
    gbps = models.FloatField(
        help_text="capacity in Gbps (10^9 bit/s); 0 means down",
        validators=[_non_negative, *_at_most(bounds.LINK_GBPS)],
    )
    rtt_ms = models.FloatField(
        help_text="round-trip time in milliseconds",
        validators=[_non_negative, *_at_most(bounds.LINK_RTT_MS)],
    )
    kv_budget_bytes = models.BigIntegerField(
        null=True,
        blank=True,
        validators=[_positive, *_at_most(bounds.LINK_KV_BUDGET_BYTES)],
        help_text="in-flight KVCache budget; empty = derived",
    )
    target_utilisation = models.FloatField(
        null=True,
        blank=True,
        validators=[_finite, _fraction],
        help_text="mean egress share planned at most, in (0, 1]; empty = the router's guard",
    )

    class Meta:
        ordering = ["source__name", "target__name", "id"]
        constraints = [
            _version_positive("link"),
            models.UniqueConstraint(fields=["source", "target"], name="link_unique_source_target"),
            models.CheckConstraint(
                condition=Q(source_kind=ClusterKind.PRFAAS), name="link_source_is_prfaas"
            ),
            models.CheckConstraint(
                condition=Q(target_kind=ClusterKind.PD), name="link_target_is_pd"
            ),
            models.CheckConstraint(condition=Q(gbps__gte=0), name="link_gbps_non_negative"),
            models.CheckConstraint(condition=Q(rtt_ms__gte=0), name="link_rtt_non_negative"),
            models.CheckConstraint(
                condition=Q(kv_budget_bytes__isnull=True) | Q(kv_budget_bytes__gt=0),
                name="link_kv_budget_positive",
            ),
            models.CheckConstraint(
                condition=Q(target_utilisation__isnull=True)
                | (Q(target_utilisation__gt=0) & Q(target_utilisation__lte=1)),
                name="link_target_utilisation_fraction",
            ),
            models.CheckConstraint(
                condition=_at_most_q("gbps", bounds.LINK_GBPS)
                & _at_most_q("rtt_ms", bounds.LINK_RTT_MS)
                & _at_most_q("kv_budget_bytes", bounds.LINK_KV_BUDGET_BYTES, nullable=True),
                name="link_physically_bounded",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.source_kind = self.source.kind
        self.target_kind = self.target.kind
        super().save(*args, **kwargs)

    def clean(self) -> None:
        if self.source_id is not None:
            self.source_kind = self.source.kind
        if self.target_id is not None:
            self.target_kind = self.target.kind
        errors: dict[str, str] = {}
        if self.source_id is not None and self.source.kind != ClusterKind.PRFAAS:
            errors["source"] = (
                f"must be a prfaas cluster ({self.source.name} is {self.source.kind})"
            )
        if self.target_id is not None and self.target.kind != ClusterKind.PD:
            errors["target"] = f"must be a pd cluster ({self.target.name} is {self.target.kind})"
        if errors:
            raise ValidationError(errors)

    @property
    def key(self) -> str:
        """The link's name in live state, plans and bindings (the core's one spelling)."""
        return link_key(self.source.name, self.target.name)
