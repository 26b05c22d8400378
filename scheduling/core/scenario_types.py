"""The scenario's domain types: what a scenario file describes, as frozen dataclasses.

The reader (:mod:`scheduling.core.scenario`) builds them, the writer
(:mod:`scheduling.core.scenario_writer`) turns them back into the file format, and the planner
and simulator consume them. Pure Python: no Django import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scheduling.core.scale_targets import ScaleTarget

ROOT = "<scenario>"

ClusterKindName = Literal["prfaas", "pd"]
TableT = tuple[tuple[float, float], ...]


class ScenarioError(ValueError):
    """A scenario that cannot be used, with the key path of the first problem found."""

    def __init__(self, path: str, message: str):
        self.path = path or ROOT
        self.message = message
        super().__init__(f"{self.path}: {self.message}")


def location_path(loc: Sequence[str | int]) -> str:
    """Render a location as a key path: ``("profiles", 1, "prefill_seconds")`` ->
    ``profiles[1].prefill_seconds``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# --------------------------------------------------------------------------------------------
# Domain dataclasses (frozen: the pure core passes them around without defensive copies)


@dataclass(frozen=True)
class ScenarioModel:
    """The served model: how much KVCache one prefill produces at each input length."""

    name: str
    attention: Mapping[str, Any]
    block_tokens: int
    kv_cache_mib: TableT
    linear_state_mib: float | None = None


@dataclass(frozen=True)
class AcceleratorSpec:
    """A kind of accelerator and its relative price per GPU-hour."""

    name: str
    gpu_hour_cost: float


@dataclass(frozen=True)
class DecodeSpec:
    """Decode capacity of one instance: concurrent requests and the time of one step."""

    max_batch: int
    step_seconds: float


@dataclass(frozen=True)
class ProfileSpec:
    """Performance of one model instance on one accelerator."""

    accelerator: str
    gpus_per_instance: int
    prefill_seconds: TableT
    decode: DecodeSpec | None = None


@dataclass(frozen=True)
class ScenarioCluster:
    """One kind of hardware at one site; ``prfaas`` clusters only prefill."""

    name: str
    kind: ClusterKindName
    site: str
    accelerator: str
    prefill_instances: int
    decode_instances: int = 0
    # The engines' disaggregated KV protocol, as a gateway drives it (clusters.models.KvConnector).
    kv_connector: str = "nixl"
    # Per role, the Kubernetes object with /scale (scheduling.core.scale_targets); None when
    # the file does not say (an apply then leaves the inventory's alone).
    scale_targets: tuple[ScaleTarget, ...] | None = None

    @property
    def instances(self) -> int:
        return self.prefill_instances + self.decode_instances

    def instance_roles(self) -> dict[str, str]:
        """The cluster's instances by name, as topology as code names them:
        ``<cluster>-0 .. <cluster>-(P+D-1)``, the first P prefill and the rest decode."""
        return {
            f"{self.name}-{k}": "prefill" if k < self.prefill_instances else "decode"
            for k in range(self.instances)
        }


@dataclass(frozen=True)
class ScenarioLink:
    """The Ethernet path from a PrfaaS cluster to a PD cluster (0 Gbps = link down).

    ``kv_budget_mib``: the most KVCache in flight on it (reserved from the routing decision to
    the transfer's end); ``target_utilisation``: the mean egress share the planner may plan
    onto it. ``None``: the router's defaults (:mod:`scheduling.core.link`).
    ``max_refused_share``: the operator's cap on the share of the PD cluster's decisions the
    link's guard may refuse, within (0, 1]; ``None`` (default): no cap, refused offloads
    prefill locally and the planner plans them so.
    """

    source: str
    target: str
    gbps: float
    rtt_ms: float = 0.0
    kv_budget_mib: float | None = None
    target_utilisation: float | None = None
    max_refused_share: float | None = None

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}"


@dataclass(frozen=True)
class LognormalDist:
    """Log-normal lengths truncated to [min, max]."""

    mu: float
    sigma: float
    min: float
    max: float


@dataclass(frozen=True)
class FixedDist:
    """Every request has the same length."""

    value: float


@dataclass(frozen=True)
class EmpiricalDist:
    """Discrete lengths with weights (points sorted by tokens, weights need not sum to 1)."""

    points: TableT


Distribution = LognormalDist | FixedDist | EmpiricalDist


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive; ``rate_per_s`` None means a tool searches for it."""

    process: Literal["poisson"] = "poisson"
    rate_per_s: float | None = None


@dataclass(frozen=True)
class TraceSpec:
    """A request trace replayed instead of length distributions (``path`` is absolute)."""

    path: Path
    format: Literal["mooncake", "azure"]
    dequantize: str = "none"
    rate_scale: float = 1.0


@dataclass(frozen=True)
class PhaseSpec:
    """One consecutive stretch of a workload overriding some of its settings."""

    duration_s: float
    ramp: bool = False
    arrival: ArrivalSpec | None = None
    input_tokens: Distribution | None = None
    output_tokens: Distribution | None = None
    prefix_hit_fraction: float | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """The traffic: arrivals, lengths (distributions or a trace) and where it arrives."""

    arrival: ArrivalSpec
    input_tokens: Distribution | None
    output_tokens: Distribution | None
    trace: TraceSpec | None
    phases: tuple[PhaseSpec, ...]
    origins: Mapping[str, float]
    prefix_hit_fraction: float | None


@dataclass(frozen=True)
class LinkEvent:
    """At ``at_s`` the link's capacity becomes ``gbps``."""

    at_s: float
    source: str
    target: str
    gbps: float


@dataclass(frozen=True)
class StateEvent:
    """At ``at_s`` an instance (or a whole cluster) goes ``down`` or comes back ``active``."""

    at_s: float
    state: Literal["down", "active"]
    instance: str | None = None
    cluster: str | None = None


@dataclass(frozen=True)
class RateEvent:
    """At ``at_s`` the traffic arriving at a cluster is scaled by ``rate_scale``."""

    at_s: float
    cluster: str
    rate_scale: float


Event = LinkEvent | StateEvent | RateEvent


@dataclass(frozen=True)
class CacheSpec:
    """Prefix-cache capacity of each instance of a cluster."""

    gib_per_instance: float


@dataclass(frozen=True)
class SloSpec:
    """Service objectives: per-request decode speed."""

    decode_tokens_per_s: float


@dataclass(frozen=True)
class Scenario:
    """A validated scenario: deployment plus workload (see ``scenarios/SCHEMA.md``)."""

    version: int
    name: str
    description: str
    model: ScenarioModel
    accelerators: tuple[AcceleratorSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    clusters: tuple[ScenarioCluster, ...]
    links: tuple[ScenarioLink, ...]
    workload: WorkloadSpec | None
    events: tuple[Event, ...] = ()
    caches: Mapping[str, CacheSpec] = field(default_factory=dict)
    slo: SloSpec | None = None
    expected: Mapping[str, Any] | None = None
    source: Path | None = None

    def accelerator(self, name: str) -> AcceleratorSpec:
        for acc in self.accelerators:
            if acc.name == name:
                return acc
        raise KeyError(name)

    def profile_for(self, accelerator: str) -> ProfileSpec:
        for prof in self.profiles:
            if prof.accelerator == accelerator:
                return prof
        raise KeyError(accelerator)

    def cluster(self, name: str) -> ScenarioCluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def prfaas_clusters(self) -> tuple[ScenarioCluster, ...]:
        return tuple(c for c in self.clusters if c.kind == "prfaas")

    @property
    def pd_clusters(self) -> tuple[ScenarioCluster, ...]:
        return tuple(c for c in self.clusters if c.kind == "pd")


# --------------------------------------------------------------------------------------------
# Loading and merging
