"""The deployment and request types of the routing decision, and their guards.

What exists (model, clusters, instances, links: :class:`Topology`), what routers obey
(:class:`RoutingPolicy` with its :class:`RouteGuards`), what one request is
(:class:`RouteRequest`) and what the answer is (:class:`RouteDecision`). Frozen dataclasses;
construction checks consistency and raises ``ValueError`` naming the problem.

Units: tokens, seconds, bytes (MiB = 2**20 bytes in tables), Gbps = 1e9 bit/s.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduling.core.kinds import ClusterKind, InstanceRole, InstanceState, KvConnector
from scheduling.core.link import (
    DEFAULT_ABUNDANT_UTILISATION,
    DEFAULT_TARGET_UTILISATION,
    Link,
    link_target_utilisation,
)
from scheduling.core.routing.reasons import Reason

CLUSTER_KINDS = tuple(k.value for k in ClusterKind)
INSTANCE_ROLES = tuple(r.value for r in InstanceRole)
INSTANCE_STATES = tuple(s.value for s in InstanceState)
STALE_MODES = ("static", "local")
#: The engines' disaggregated KV protocols a gateway drives (:class:`~scheduling.core.kinds.KvConnector`).
KV_CONNECTORS = tuple(c.value for c in KvConnector)
SNAPSHOT_FORMAT = 1


_MIB = float(1 << 20)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class RouteError(ValueError):
    """A request that cannot be decided; ``code`` is stable and machine-readable."""

    code = "route_error"

    def __init__(self, detail: str, *, code: str | None = None, index: int | None = None):
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        #: position in the batch given to :func:`route_decide_many`, when there was one
        self.index = index


class RouteInputError(RouteError):
    """The request itself is wrong (unknown origin, impossible token counts, ...)."""

    code = "invalid_request"


class RouteUnavailable(RouteError):
    """The request is valid but the fleet cannot serve it now (no decode, no prefill)."""

    code = Reason.NO_DECODE_CAPACITY


class SnapshotFormatError(ValueError):
    """A policy snapshot dict that does not describe a valid policy and topology.

    The message starts with the key path of the problem, e.g. ``instances[3].role``.
    """


# --------------------------------------------------------------------------------------
# Piecewise-linear tables
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PiecewiseLinear:
    """A ``[[x, y], ...]`` profile table read by linear interpolation.

    Beyond either end the nearest segment is extrapolated (the scenario schema's rule, the
    same as ``scheduling.core.performance.Table``, its numpy twin for whole arrays). Scalar
    ``bisect`` per call: for one value on the request path this is several times faster.
    """

    points: tuple[tuple[float, float], ...]
    _xs: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _ys: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _slopes: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pts = tuple((float(x), float(y)) for x, y in self.points)
        if not pts:
            raise ValueError("a table needs at least one [x, y] point")
        for i in range(1, len(pts)):
            if pts[i][0] <= pts[i - 1][0]:
                raise ValueError(f"table x values must be strictly increasing (point {i})")
        for i, (x, y) in enumerate(pts):
            if not (math.isfinite(x) and math.isfinite(y)):
                raise ValueError(f"table point {i} is not a finite number")
        xs = tuple(p[0] for p in pts)
        ys = tuple(p[1] for p in pts)
        if len(pts) == 1:
            slopes: tuple[float, ...] = (0.0,)
        else:
            slopes = tuple((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1))
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_xs", xs)
        object.__setattr__(self, "_ys", ys)
        object.__setattr__(self, "_slopes", slopes)

    def at(self, x: float) -> float:
        """The table's value at ``x``."""
        xs = self._xs
        i = bisect_right(xs, x) - 1
        if i < 0:
            i = 0
        elif i >= len(self._slopes):
            i = len(self._slopes) - 1
        return self._ys[i] + self._slopes[i] * (x - xs[i])

    def to_list(self) -> list[list[float]]:
        return [[x, y] for x, y in self.points]


# --------------------------------------------------------------------------------------
# Topology: what exists (changes only with a new policy/inventory version)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The served model, as far as routing needs it.

    ``block_tokens``: prefix-cache block size; cached prefixes are whole blocks.
    ``kv_cache_mib``: S_kv table, KVCache MiB produced by one prefill at an input length.
    ``linear_state_mib``: request-level linear-attention/SWA state, shipped whole with any
    KV transfer; ``None`` means the S_kv table extrapolated to 0 tokens.
    """

    name: str
    block_tokens: int
    kv_cache_mib: tuple[tuple[float, float], ...]
    linear_state_mib: float | None = None


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    """Decode capacity of one instance: ``max_batch`` requests at ``step_seconds`` per token."""

    max_batch: int
    step_seconds: float


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One kind of hardware at one site.

    ``kind``: ``prfaas`` (prefill only) or ``pd``. ``prefill_seconds``: T_prefill table of one
    instance of this cluster's accelerator. ``decode``: decode profile (pd clusters).
    ``kv_connector``: how its engines hand KV over (one of ``KV_CONNECTORS``); the decision
    never reads it, the gateway that carries the decision out does.
    """

    name: str
    kind: str
    prefill_seconds: tuple[tuple[float, float], ...]
    accelerator: str = ""
    site: str = ""
    decode: DecodeProfile | None = None
    kv_connector: str = "nixl"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One model replica. ``role``: prefill|decode; ``state``: active|draining|down|unreachable.

    ``endpoint`` is where a router sends the work (URL or host:port), returned verbatim.
    Only ``active`` instances are ever chosen.
    """

    name: str
    cluster: str
    role: str
    state: str = "active"
    endpoint: str = ""


def link_scarce_at(link: Link, guards: RouteGuards) -> float:
    """Egress utilisation at or above which ``link``'s bandwidth is scarce: its target
    utilisation, else the guards' scarce share."""
    if link.target_utilisation is None:
        return guards.scarce_utilisation
    return link_target_utilisation(link.target_utilisation)


def link_abundant_at(link: Link, guards: RouteGuards) -> float:
    """Egress utilisation at or below which it is abundant again (never above scarce)."""
    return min(guards.abundant_utilisation, link_scarce_at(link, guards))


@dataclass(frozen=True, slots=True)
class Topology:
    """Model, clusters, instances and links, with lookups precomputed once.

    Build one per policy/inventory version and reuse it for every request. Construction
    checks consistency (kinds, roles, states, references, link direction) and raises
    ``ValueError`` naming the problem.
    """

    model: ModelSpec
    clusters: tuple[ClusterSpec, ...]
    instances: tuple[InstanceSpec, ...]
    links: tuple[Link, ...]

    cluster_by_name: dict[str, ClusterSpec] = field(init=False, repr=False, compare=False)
    instance_by_name: dict[str, InstanceSpec] = field(init=False, repr=False, compare=False)
    prefill_by_cluster: dict[str, tuple[InstanceSpec, ...]] = field(
        init=False, repr=False, compare=False
    )
    decode_by_cluster: dict[str, tuple[InstanceSpec, ...]] = field(
        init=False, repr=False, compare=False
    )
    link_by_pair: dict[tuple[str, str], Link] = field(init=False, repr=False, compare=False)
    links_into: dict[str, tuple[Link, ...]] = field(init=False, repr=False, compare=False)
    prefill_rows: dict[str, tuple[tuple[str, InstanceSpec, bool], ...]] = field(
        init=False, repr=False, compare=False
    )
    decode_rows: dict[str, tuple[tuple[str, InstanceSpec, bool], ...]] = field(
        init=False, repr=False, compare=False
    )
    prefill_curve: dict[str, PiecewiseLinear] = field(init=False, repr=False, compare=False)
    kv_curve: PiecewiseLinear = field(init=False, repr=False, compare=False)
    # instance name -> where a decision places work on it (immutable, so shared by every
    # decision instead of one object per decision).
    placement_by_name: dict[str, Placement] = field(init=False, repr=False, compare=False)
    linear_state_bytes: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "clusters", tuple(self.clusters))
        set_(self, "instances", tuple(self.instances))
        set_(self, "links", tuple(self.links))
        if self.model.block_tokens < 1:
            raise ValueError("model.block_tokens must be at least 1")
        try:
            kv_curve = PiecewiseLinear(tuple(self.model.kv_cache_mib))
        except ValueError as exc:
            raise ValueError(f"model.kv_cache_mib: {exc}") from None
        linear_mib = self.model.linear_state_mib
        if linear_mib is None:
            linear_mib = max(0.0, kv_curve.at(0.0))
        if linear_mib < 0:
            raise ValueError("model.linear_state_mib must not be negative")
        set_(self, "kv_curve", kv_curve)
        set_(self, "linear_state_bytes", linear_mib * _MIB)

        clusters: dict[str, ClusterSpec] = {}
        curves: dict[str, PiecewiseLinear] = {}
        for c in self.clusters:
            if c.name in clusters:
                raise ValueError(f"cluster {c.name!r} is listed twice")
            if c.kind not in CLUSTER_KINDS:
                raise ValueError(f"cluster {c.name!r}: kind must be one of {CLUSTER_KINDS}")
            try:
                curves[c.name] = PiecewiseLinear(tuple(c.prefill_seconds))
            except ValueError as exc:
                raise ValueError(f"cluster {c.name!r} prefill_seconds: {exc}") from None
            clusters[c.name] = c
        instances: dict[str, InstanceSpec] = {}
        prefill: dict[str, list[InstanceSpec]] = {name: [] for name in clusters}
        decode: dict[str, list[InstanceSpec]] = {name: [] for name in clusters}
        for inst in self.instances:
            if inst.name in instances:
                raise ValueError(f"instance {inst.name!r} is listed twice")
            cluster = clusters.get(inst.cluster)
            if cluster is None:
                raise ValueError(f"instance {inst.name!r}: unknown cluster {inst.cluster!r}")
            if inst.role not in INSTANCE_ROLES:
                raise ValueError(f"instance {inst.name!r}: role must be one of {INSTANCE_ROLES}")
            if inst.state not in INSTANCE_STATES:
                raise ValueError(f"instance {inst.name!r}: state must be one of {INSTANCE_STATES}")
            if inst.role == "decode" and cluster.kind == "prfaas":
                raise ValueError(f"instance {inst.name!r}: a prfaas cluster has no decode role")
            instances[inst.name] = inst
            (prefill if inst.role == "prefill" else decode)[inst.cluster].append(inst)
        pairs: dict[tuple[str, str], Link] = {}
        into: dict[str, list[Link]] = {name: [] for name in clusters}
        for link in self.links:
            src, tgt = clusters.get(link.source), clusters.get(link.target)
            if src is None or tgt is None:
                raise ValueError(f"link {link.key}: unknown cluster")
            if src.kind != "prfaas" or tgt.kind != "pd":
                raise ValueError(f"link {link.key}: must go from a prfaas to a pd cluster")
            if not link.gbps > 0:
                raise ValueError(f"link {link.key}: gbps must be positive")
            if link.rtt_ms < 0:
                raise ValueError(f"link {link.key}: rtt_ms must not be negative")
            if link.kv_budget_bytes is not None and link.kv_budget_bytes < 0:
                raise ValueError(f"link {link.key}: kv_budget_bytes must not be negative")
            if link.target_utilisation is not None and not (0.0 < link.target_utilisation <= 1.0):
                raise ValueError(f"link {link.key}: target_utilisation must be within (0, 1]")
            if link.pair in pairs:
                raise ValueError(f"link {link.key} is listed twice")
            pairs[link.pair] = link
            into[link.target].append(link)
        set_(self, "cluster_by_name", clusters)
        set_(self, "instance_by_name", instances)
        set_(
            self,
            "placement_by_name",
            {n: Placement(i.cluster, i.name, i.endpoint) for n, i in instances.items()},
        )
        set_(self, "prefill_by_cluster", {k: tuple(v) for k, v in prefill.items()})
        set_(self, "decode_by_cluster", {k: tuple(v) for k, v in decode.items()})
        # (name, instance, active in the inventory): what the per-request loops read.
        set_(
            self,
            "prefill_rows",
            {k: tuple((i.name, i, i.state == "active") for i in v) for k, v in prefill.items()},
        )
        set_(
            self,
            "decode_rows",
            {k: tuple((i.name, i, i.state == "active") for i in v) for k, v in decode.items()},
        )
        set_(self, "link_by_pair", pairs)
        set_(
            self,
            "links_into",
            {k: tuple(sorted(v, key=lambda lk: lk.source)) for k, v in into.items()},
        )
        set_(self, "prefill_curve", curves)

    def prefill_seconds(self, cluster: str, tokens: float) -> float:
        """T_prefill of ``tokens`` uncached tokens on one instance of ``cluster`` (never < 0)."""
        if tokens <= 0:
            return 0.0
        return max(0.0, self.prefill_curve[cluster].at(tokens))

    def kv_bytes(self, tokens: float) -> float:
        """S_kv: KVCache bytes a prefill of ``tokens`` tokens produces (never < 0)."""
        if tokens <= 0:
            return 0.0
        return max(0.0, self.kv_curve.at(tokens) * _MIB)

    def kv_transfer_bytes(self, prompt_tokens: int, held_tokens: int) -> int:
        """Bytes to move so that a cluster already holding ``held_tokens`` of the prefix has
        the whole KV of ``prompt_tokens``: the block KV of the missing tokens plus the
        request-level linear state (which is never partially reusable)."""
        full = self.kv_bytes(prompt_tokens)
        if held_tokens <= 0:
            return math.ceil(full)
        blocks_missing = full - self.kv_bytes(held_tokens)
        return math.ceil(min(full, max(0.0, blocks_missing) + self.linear_state_bytes))

    def prefix_bytes(self, tokens: int) -> int:
        """Bytes of a cached prefix of ``tokens`` tokens moved by a cache transfer (block KV
        only: the linear state of a prefix is recomputed where prefill runs)."""
        if tokens <= 0:
            return 0
        return math.ceil(max(0.0, self.kv_bytes(tokens) - self.linear_state_bytes))


# --------------------------------------------------------------------------------------
# RoutingPolicy: the versioned parameters routers obey
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteGuards:
    """Short-term control parameters (the paper gives none; these defaults are ours).

    * ``scarce_utilisation``: link egress utilisation (0..1) at or above which bandwidth is
      *scarce* and the link congested; ``abundant_utilisation``: at or below which it is
      *abundant* again. In between the last state holds (hysteresis latch in ControlState).
    * ``prfaas_backlog_s``: queued prefill seconds per active PrfaaS instance at or above which
      the PrfaaS cluster is congested (also makes bandwidth mode *scarce*);
      ``prfaas_backlog_clear_s``: at or below which it is clear again.
    * ``prfaas_backlog_reject_s``: hard limit: above it no request is offloaded to that cluster.
    * ``threshold_raise_factor``: on entering congestion the effective threshold jumps to
      ``t * factor``; while congestion lasts it doubles every ``threshold_rise_doubling_s``,
      up to ``t * threshold_max_factor``.
    * ``threshold_decay_half_life_s``: once clear, the excess over ``t`` halves this often.
    * ``stale_after_s``: live state older than this is stale; ``stale_mode``: ``static`` (the
      policy's static rule: uncached length vs t, local cache only, no cache transfer) or
      ``local`` (keep everything local).
    * ``allow_cache_transfer``: whether cross-cluster prefix-cache transfers may be requested.
    * ``degraded_match_factor``: share (0..1) of a ``degraded`` prefix-index entry believed;
      degraded entries are never the source of a cross-cluster transfer.
    * ``decode_kv_usage_max``: a decode instance with KV usage at or above this has no room.
    """

    scarce_utilisation: float = DEFAULT_TARGET_UTILISATION
    abundant_utilisation: float = DEFAULT_ABUNDANT_UTILISATION
    prfaas_backlog_s: float = 4.0
    prfaas_backlog_clear_s: float = 2.0
    prfaas_backlog_reject_s: float = 30.0
    threshold_raise_factor: float = 1.5
    threshold_rise_doubling_s: float = 10.0
    threshold_max_factor: float = 4.0
    threshold_decay_half_life_s: float = 30.0
    stale_after_s: float = 5.0
    stale_mode: str = "static"
    allow_cache_transfer: bool = True
    degraded_match_factor: float = 0.5
    decode_kv_usage_max: float = 0.95

    def __post_init__(self) -> None:
        for name in (
            "scarce_utilisation",
            "abundant_utilisation",
            "degraded_match_factor",
            "decode_kv_usage_max",
        ):
            value = getattr(self, name)
            if not (0.0 <= value <= 1.0):
                raise ValueError(f"guards.{name} must be between 0 and 1")
        if self.abundant_utilisation > self.scarce_utilisation:
            raise ValueError("guards.abundant_utilisation must not exceed scarce_utilisation")
        if self.prfaas_backlog_clear_s > self.prfaas_backlog_s:
            raise ValueError("guards.prfaas_backlog_clear_s must not exceed prfaas_backlog_s")
        for name in (
            "prfaas_backlog_s",
            "prfaas_backlog_clear_s",
            "prfaas_backlog_reject_s",
            "stale_after_s",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"guards.{name} must be a non-negative number")
        for name in ("threshold_rise_doubling_s", "threshold_decay_half_life_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"guards.{name} must be a positive number")
        if not (1.0 <= self.threshold_raise_factor <= self.threshold_max_factor):
            raise ValueError("guards: need 1 <= threshold_raise_factor <= threshold_max_factor")
        if not math.isfinite(self.threshold_max_factor):
            raise ValueError("guards.threshold_max_factor must be finite")
        if self.stale_mode not in STALE_MODES:
            raise ValueError(f"guards.stale_mode must be one of {STALE_MODES}")


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Versioned routing parameters: the threshold ``t`` (tokens) per PD cluster and guards.

    A PD cluster without a threshold never offloads (its ``t`` is infinite).
    """

    version: int
    thresholds: Mapping[str, int]
    guards: RouteGuards = field(default_factory=RouteGuards)

    def threshold(self, pd_cluster: str) -> float:
        t = self.thresholds.get(pd_cluster)
        return math.inf if t is None else float(t)


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """What ``GET /api/v1/policy`` serves and routers cache: a policy and its topology."""

    policy: RoutingPolicy
    topology: Topology


# --------------------------------------------------------------------------------------
# Request and decision
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A cached prefix of this request: ``tokens`` matched in ``cluster``, on ``instance`` (or
    ``None`` for a cluster-wide cache pool any instance can read). ``exact=False`` marks a
    ``degraded`` index entry (event gap): believed only in part, never transferred."""

    cluster: str
    tokens: int
    instance: str | None = None
    exact: bool = True


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One LLM request, described by token counts only (never prompt text).

    ``origin``: PD cluster where it arrived (where it decodes). ``block_hashes``: its prefix
    block chain (the server turns it into ``prefix_matches``; the router ignores it).
    ``cached_tokens``: router-known cached tokens per cluster (treated as exact cluster-wide
    matches). ``expected_output_tokens``: informational, carried for traffic records.
    """

    origin: str
    prompt_tokens: int
    prefix_matches: tuple[PrefixMatch, ...] = ()
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    block_hashes: tuple[int | str, ...] = ()
    request_id: str | None = None
    expected_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one stage runs."""

    cluster: str
    instance: str
    endpoint: str


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """Predicted time to first token of both options, in seconds: queue wait + prefill of the
    incremental tokens on that hardware (+ RTT, cache-transfer time and the part of the KV
    transfer not hidden by layer-wise pipelining, for PrfaaS). ``prfaas`` is ``None`` when
    no PrfaaS cluster is usable."""

    local: float
    prfaas: float | None


@dataclass(frozen=True, slots=True)
class CacheTransfer:
    """A cross-cluster prefix-cache transfer to start before prefill: ``tokens`` cached
    tokens (``bytes`` of KV) from ``source_instance`` (``None``: the cluster's pool) to the
    prefill instance ``target_instance``."""

    source_cluster: str
    source_instance: str | None
    target_cluster: str
    target_instance: str
    tokens: int
    bytes: int


@dataclass(frozen=True, slots=True)
class LinkReservation:
    """KV bytes to reserve in flight on the link ``source -> target`` (both directions of a
    link share its budget) before the transfers of this decision start. ``id``: set by whoever
    took the reservation atomically, so that its holder can release it when the transfer ends
    (``None`` in a decision not yet reserved)."""

    source: str
    target: str
    bytes: int
    id: str | None = None


#: Why a link's guard kept an offload local (``LinkRefusal.cause``).
REFUSAL_BUDGET = "budget"
REFUSAL_SATURATION = "saturation"


@dataclass(frozen=True, slots=True)
class LinkRefusal:
    """The link guard kept this request local although its length asked for an offload:
    the link ``source -> target`` and the cause, ``budget`` (its in-flight KV budget had no
    room for the request's bytes, when decided or when the reservation was taken) or
    ``saturation`` (its egress was at capacity, or congestion control had raised the
    threshold because of its egress)."""

    source: str
    target: str
    cause: str


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The answer. ``incremental_tokens`` = prompt - ``cached_tokens``, the tokens prefill
    computes where it runs; ``threshold`` is the effective one compared against;
    ``reason`` is one of :data:`REASONS`; ``kv_bytes``: KV bytes the prefill hands to decode
    (over the link when ``route == 'prfaas'``); ``link_refusal``: set when the link guard kept
    an offload local (``link_congested``)."""

    route: str
    prefill: Placement
    decode: Placement
    incremental_tokens: int
    cached_tokens: int
    threshold: float
    policy_version: int
    reason: str
    ttft_estimate_s: TtftEstimate
    cache_transfer: CacheTransfer | None = None
    reservation: LinkReservation | None = None
    kv_bytes: int = 0
    request_id: str | None = None
    stale: bool = False
    link_refusal: LinkRefusal | None = None
