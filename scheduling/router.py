"""The per-request routing decision of PrfaaS, as one pure function.

``route_decide(request, policy, topology, live) -> Decision`` decides, for one LLM request that
arrived at a PD cluster (its *origin*), whether its prefill runs locally (a PD-P instance of
the origin) or is offloaded to a PrfaaS cluster, on which prefill and decode instances, and
why. It imports no Django, does no I/O and keeps no state: the control-plane server (live
state read from Redis), the simulator (a simulated fleet) and the router client (a cached
policy snapshot, no live state) all call this same code with plain frozen dataclasses.

The rules are the paper's (``../shared/paper/PRFAAS.md`` sections 3.2, 4.1, 4.2):

* *incremental length* = prompt tokens - the longest cached prefix usable where prefill runs;
  a request is offloaded when it is above the (effective) threshold ``t`` of its origin.
* bandwidth **scarce** (link egress utilisation or PrfaaS backlog above the guards): the
  offload test uses ``prompt - local PD hit``; a PrfaaS-side hit only shortens the PrfaaS
  prefill, it never changes the decision, and no cache moves between clusters.
* bandwidth **abundant**: the offload test uses ``prompt - max(PrfaaS hit, PD hit)``; when the
  cluster holding the longer prefix is not the one that prefills, the decision asks for a
  cross-cluster cache transfer (only for ``exact`` index entries, and only when the policy
  allows transfers and the link budget has room for it).
* the effective threshold rises under congestion and decays back with hysteresis
  (:func:`control_update`, a pure state transition the caller ticks);
* a per-link budget of in-flight KV bytes is never exceeded: the decision names the bytes to
  reserve on one link, checked here against the live in-flight bytes; the server reserves them
  atomically and, if that fails, calls :func:`route_fallback_local`.

Units: tokens, seconds, bytes (MiB = 2**20 bytes in tables), Gbps = 1e9 bit/s.
Every ``*_at``/``now`` value is seconds on one clock chosen by the caller (epoch seconds for
the server, simulated seconds for the simulator).
"""

from __future__ import annotations

import math
import zlib
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from scheduling.core.link import (
    DEFAULT_LINK_BUDGET_SECONDS,
    link_admits,
    link_budget_bytes,
    link_target_utilisation,
)

__all__ = [
    "CLUSTER_KINDS",
    "DEFAULT_LINK_BUDGET_SECONDS",
    "INSTANCE_ROLES",
    "INSTANCE_STATES",
    "REASONS",
    "REASON_DESCRIPTIONS",
    "SNAPSHOT_FORMAT",
    "STALE_MODES",
    "CacheTransfer",
    "ClusterSpec",
    "ControlSignals",
    "ControlState",
    "Decision",
    "DecodeProfile",
    "Guards",
    "InstanceLoad",
    "InstanceSpec",
    "LinkLoad",
    "LinkReservation",
    "LinkSpec",
    "LiveState",
    "ModelSpec",
    "PiecewiseLinear",
    "Placement",
    "Policy",
    "PolicySnapshot",
    "PrefixMatch",
    "Reason",
    "RouteError",
    "RouteInputError",
    "RouteRequest",
    "RouteUnavailable",
    "SnapshotFormatError",
    "Topology",
    "TtftEstimate",
    "control_initial",
    "control_signals",
    "control_update",
    "decision_from_dict",
    "decision_to_dict",
    "live_is_stale",
    "policy_snapshot_from_dict",
    "policy_snapshot_to_dict",
    "reservation_fits",
    "route_decide",
    "route_decide_many",
    "route_fallback_local",
    "route_fallback_local_many",
]

CLUSTER_KINDS = ("prfaas", "pd")
INSTANCE_ROLES = ("prefill", "decode")
INSTANCE_STATES = ("active", "draining", "down")
STALE_MODES = ("static", "local")
SNAPSHOT_FORMAT = 1


_MIB = float(1 << 20)
# Used when a link is fully busy: the transfer estimate then assumes this share of the line
# rate, so that a saturated link gives a large but finite TTFT instead of a division by zero.
_MIN_BANDWIDTH_SHARE = 0.05


class Reason:
    """Reason codes: why a decision went where it went (one per decision)."""

    BELOW_THRESHOLD = "below_threshold"
    ABOVE_THRESHOLD = "above_threshold"
    LINK_CONGESTED = "link_congested"
    PRFAAS_BACKLOG = "prfaas_backlog"
    CACHE_AFFINITY = "cache_affinity"
    TELEMETRY_STALE = "telemetry_stale"
    PRFAAS_UNAVAILABLE = "prfaas_unavailable"
    ORIGIN_UNAVAILABLE = "origin_unavailable"
    NO_DECODE_CAPACITY = "no_decode_capacity"


REASON_DESCRIPTIONS: dict[str, str] = {
    Reason.BELOW_THRESHOLD: "local: the prompt (minus nothing or little cached) is not above the "
    "threshold; it would stay local even without any prefix cache",
    Reason.ABOVE_THRESHOLD: "prfaas: the incremental length is above the effective threshold "
    "and a linked PrfaaS cluster had link and queue headroom",
    Reason.LINK_CONGESTED: "local: the request would have been offloaded, but the link is "
    "congested (the threshold was raised by egress congestion, the link is saturated, or its "
    "in-flight KV budget has no room for this request's bytes)",
    Reason.PRFAAS_BACKLOG: "local: the request would have been offloaded, but the PrfaaS queue "
    "is backed up (the threshold was raised by PrfaaS backlog, or the backlog is above the "
    "hard limit guards.prfaas_backlog_reject_s)",
    Reason.CACHE_AFFINITY: "local: the prompt is above the threshold but a cached prefix "
    "(local, or moved from a PrfaaS cluster by a cache transfer) brings the incremental "
    "length under it",
    Reason.TELEMETRY_STALE: "live state is missing or older than guards.stale_after_s: the "
    "policy's static rule was applied (or everything kept local, guards.stale_mode='local')",
    Reason.PRFAAS_UNAVAILABLE: "local: the request is above the threshold but no PrfaaS "
    "cluster linked to the origin has an active prefill instance",
    Reason.ORIGIN_UNAVAILABLE: "prfaas: the origin has no active prefill instance, so the "
    "prefill was offloaded whatever its length (also the code of RouteUnavailable when no "
    "prefill can run anywhere)",
    Reason.NO_DECODE_CAPACITY: "code of RouteUnavailable: the origin has no active decode "
    "instance, so the request cannot be served",
}
REASONS = tuple(REASON_DESCRIPTIONS)


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
    same as ``scheduling.performance.Table``, its numpy twin for whole arrays). Scalar
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
    """

    name: str
    kind: str
    prefill_seconds: tuple[tuple[float, float], ...]
    accelerator: str = ""
    site: str = ""
    decode: DecodeProfile | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One model replica. ``role``: prefill|decode; ``state``: active|draining|down.

    ``endpoint`` is where a router sends the work (URL or host:port), returned verbatim.
    Only ``active`` instances are ever chosen.
    """

    name: str
    cluster: str
    role: str
    state: str = "active"
    endpoint: str = ""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The Ethernet path from a PrfaaS cluster (``source``) to a PD cluster (``target``).

    ``inflight_budget_bytes``: the most KV bytes that may be in flight on it at once (reserved
    when a decision is taken, released when the transfer ends); ``None`` means
    ``gbps * 1e9 / 8 * DEFAULT_LINK_BUDGET_SECONDS``. ``target_utilisation``: the egress
    share at which this link's bandwidth is scarce (``None``: ``guards.scarce_utilisation``);
    the planner plans its mean egress to at most that share. One model for all three:
    :mod:`scheduling.core.link`.
    """

    source: str
    target: str
    gbps: float
    rtt_ms: float = 0.0
    inflight_budget_bytes: int | None = None
    target_utilisation: float | None = None

    @property
    def budget_bytes(self) -> int:
        return link_budget_bytes(self.gbps, self.inflight_budget_bytes)

    def scarce_at(self, guards: Guards) -> float:
        """Egress utilisation at or above which this link's bandwidth is scarce."""
        if self.target_utilisation is None:
            return guards.scarce_utilisation
        return link_target_utilisation(self.target_utilisation)

    def abundant_at(self, guards: Guards) -> float:
        """Egress utilisation at or below which it is abundant again (never above scarce)."""
        return min(guards.abundant_utilisation, self.scarce_at(guards))

    @property
    def key(self) -> tuple[str, str]:
        return (self.source, self.target)


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
    links: tuple[LinkSpec, ...]

    cluster_by_name: dict[str, ClusterSpec] = field(init=False, repr=False, compare=False)
    instance_by_name: dict[str, InstanceSpec] = field(init=False, repr=False, compare=False)
    prefill_by_cluster: dict[str, tuple[InstanceSpec, ...]] = field(
        init=False, repr=False, compare=False
    )
    decode_by_cluster: dict[str, tuple[InstanceSpec, ...]] = field(
        init=False, repr=False, compare=False
    )
    link_by_pair: dict[tuple[str, str], LinkSpec] = field(init=False, repr=False, compare=False)
    links_into: dict[str, tuple[LinkSpec, ...]] = field(init=False, repr=False, compare=False)
    prefill_rows: dict[str, tuple[tuple[str, InstanceSpec, bool], ...]] = field(
        init=False, repr=False, compare=False
    )
    decode_rows: dict[str, tuple[tuple[str, InstanceSpec, bool], ...]] = field(
        init=False, repr=False, compare=False
    )
    prefill_curve: dict[str, PiecewiseLinear] = field(init=False, repr=False, compare=False)
    kv_curve: PiecewiseLinear = field(init=False, repr=False, compare=False)
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
        pairs: dict[tuple[str, str], LinkSpec] = {}
        into: dict[str, list[LinkSpec]] = {name: [] for name in clusters}
        for link in self.links:
            src, tgt = clusters.get(link.source), clusters.get(link.target)
            if src is None or tgt is None:
                raise ValueError(f"link {link.source}->{link.target}: unknown cluster")
            if src.kind != "prfaas" or tgt.kind != "pd":
                raise ValueError(
                    f"link {link.source}->{link.target}: must go from a prfaas to a pd cluster"
                )
            if not link.gbps > 0:
                raise ValueError(f"link {link.source}->{link.target}: gbps must be positive")
            if link.rtt_ms < 0:
                raise ValueError(f"link {link.source}->{link.target}: rtt_ms must not be negative")
            if link.inflight_budget_bytes is not None and link.inflight_budget_bytes < 0:
                raise ValueError(
                    f"link {link.source}->{link.target}: inflight_budget_bytes must not be negative"
                )
            if link.target_utilisation is not None and not (0.0 < link.target_utilisation <= 1.0):
                raise ValueError(
                    f"link {link.source}->{link.target}: target_utilisation must be within (0, 1]"
                )
            if link.key in pairs:
                raise ValueError(f"link {link.source}->{link.target} is listed twice")
            pairs[link.key] = link
            into[link.target].append(link)
        set_(self, "cluster_by_name", clusters)
        set_(self, "instance_by_name", instances)
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
# Policy: the versioned parameters routers obey
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Guards:
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

    scarce_utilisation: float = 0.8
    abundant_utilisation: float = 0.6
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
class Policy:
    """Versioned routing parameters: the threshold ``t`` (tokens) per PD cluster and guards.

    A PD cluster without a threshold never offloads (its ``t`` is infinite).
    """

    version: int
    thresholds: Mapping[str, int]
    guards: Guards = field(default_factory=Guards)

    def threshold(self, pd_cluster: str) -> float:
        t = self.thresholds.get(pd_cluster)
        return math.inf if t is None else float(t)


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """What ``GET /api/v1/policy`` serves and routers cache: a policy and its topology."""

    policy: Policy
    topology: Topology


# --------------------------------------------------------------------------------------
# Live state: what is happening now (one snapshot per request or per batch)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """Latest load of one instance.

    ``queue_depth``: requests waiting for prefill; ``queued_prefill_tokens``: their uncached
    tokens; ``queued_prefill_s``: their prefill seconds if the reporter knows them (otherwise
    derived as ``depth * T(tokens / depth)`` on the instance's hardware). ``running``,
    ``waiting``: requests in the engine (decode load); ``kv_usage``: KV memory used (0..1).
    ``state``: overrides the inventory state when set (e.g. health checks saw it down).
    """

    queue_depth: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_s: float | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    updated_at: float | None = None
    state: str | None = None


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """Latest load of one link: recent egress rate and KV bytes reserved in flight."""

    egress_gbps: float = 0.0
    inflight_bytes: int = 0
    updated_at: float | None = None


@dataclass(frozen=True, slots=True)
class ControlState:
    """Short-term control state of one PD cluster (its links and PrfaaS queues).

    ``threshold_factor`` (>= 1) multiplies the policy's ``t`` into the effective threshold, so
    a new policy version needs no rebasing. ``congested_since``: start of the current
    congestion, ``None`` when not congested. ``scarce``: hysteresis latch of the bandwidth
    mode used while utilisation sits between the abundant and scarce guards.
    ``cause``: ``link`` or ``backlog``, what raised the threshold last.
    """

    threshold_factor: float = 1.0
    congested_since: float | None = None
    updated_at: float | None = None
    scarce: bool = False
    cause: str | None = None

    def effective_threshold(self, base_threshold: float) -> float:
        # Never below the policy's t: control only ever raises it.
        factor = self.threshold_factor
        return base_threshold * factor if factor > 1.0 else base_threshold


@dataclass(frozen=True, slots=True)
class ControlSignals:
    """Inputs of :func:`control_update`: worst egress utilisation (0..1) of the links into
    the PD cluster, and worst queued prefill seconds per instance of its PrfaaS clusters."""

    egress_utilisation: float
    prfaas_backlog_s: float


@dataclass(frozen=True, slots=True)
class LiveState:
    """One snapshot of the fleet's live state.

    ``instances``/``links``: latest loads by instance name and by ``(source, target)``;
    missing entries count as idle. ``control``: ControlState per PD cluster (missing: not
    congested). ``stale``: the caller knows the state is missing or unreliable (Redis down,
    client without live state). ``telemetry_at``: time of the newest telemetry the snapshot
    reflects; older than ``guards.stale_after_s`` also makes it stale.
    """

    now: float = 0.0
    instances: Mapping[str, InstanceLoad] = field(default_factory=dict)
    links: Mapping[tuple[str, str], LinkLoad] = field(default_factory=dict)
    control: Mapping[str, ControlState] = field(default_factory=dict)
    stale: bool = False
    telemetry_at: float | None = None


_first = itemgetter(0)
_second = itemgetter(1)


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
    link share its budget) before the transfers of this decision start."""

    source: str
    target: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer. ``incremental_tokens`` = prompt - ``cached_tokens``, the tokens prefill
    computes where it runs; ``threshold`` is the effective one compared against;
    ``reason`` is one of :data:`REASONS`; ``kv_bytes``: KV bytes the prefill hands to decode
    (over the link when ``route == 'prfaas'``)."""

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


# --------------------------------------------------------------------------------------
# Control: effective threshold with hysteresis
# --------------------------------------------------------------------------------------


def control_initial(now: float | None = None) -> ControlState:
    """The state of a PD cluster with no congestion history."""
    return ControlState(updated_at=now)


def control_update(
    state: ControlState, signals: ControlSignals, guards: Guards, now: float
) -> ControlState:
    """Advance one PD cluster's control state to ``now`` given fresh congestion signals.

    Congested (utilisation >= scarce guard or backlog >= backlog guard): the threshold factor
    jumps to ``threshold_raise_factor`` on entry and doubles every
    ``threshold_rise_doubling_s`` while congestion lasts, capped at ``threshold_max_factor``.
    Clear (utilisation <= abundant guard and backlog <= clear guard): the excess over 1
    decays with ``threshold_decay_half_life_s``. In between, the factor holds (hysteresis).
    Time-based, so the result does not depend on how often it is called.
    """
    dt = 0.0 if state.updated_at is None else max(0.0, now - state.updated_at)
    link_hot = signals.egress_utilisation >= guards.scarce_utilisation
    backlog_hot = signals.prfaas_backlog_s >= guards.prfaas_backlog_s
    clear = (
        signals.egress_utilisation <= guards.abundant_utilisation
        and signals.prfaas_backlog_s <= guards.prfaas_backlog_clear_s
    )
    factor = state.threshold_factor
    if link_hot or backlog_hot:
        cause = "backlog" if backlog_hot and not link_hot else "link"
        if state.congested_since is None:
            factor = max(factor, guards.threshold_raise_factor)
            since: float | None = now
        else:
            factor = max(factor, guards.threshold_raise_factor) * 2.0 ** (
                dt / guards.threshold_rise_doubling_s
            )
            since = state.congested_since
        factor = min(factor, guards.threshold_max_factor)
        return ControlState(factor, since, now, True, cause)
    if clear:
        excess = (factor - 1.0) * 0.5 ** (dt / guards.threshold_decay_half_life_s)
        if excess < 1e-3:
            excess = 0.0
        return ControlState(1.0 + excess, None, now, False, state.cause if excess else None)
    # Between the guards: keep the factor and the latch, congestion episode over or not.
    return ControlState(factor, state.congested_since, now, state.scarce, state.cause)


def control_signals(pd_cluster: str, topology: Topology, live: LiveState) -> ControlSignals:
    """The congestion signals of one PD cluster from a live snapshot (what the server's tick
    and the simulator feed :func:`control_update`)."""
    util = 0.0
    backlog = 0.0
    for link in topology.links_into.get(pd_cluster, ()):
        load = live.links.get(link.key)
        if load is not None:
            util = max(util, load.egress_gbps / link.gbps)
        pool = _prefill_pool(topology, live, link.source)
        if pool:
            backlog = max(backlog, sum(e[1] for e in pool) / len(pool))
    return ControlSignals(egress_utilisation=util, prfaas_backlog_s=backlog)


def live_is_stale(live: LiveState, guards: Guards) -> bool:
    """True when the snapshot must not be trusted (flagged, or older than the guard)."""
    if live.stale:
        return True
    return live.telemetry_at is not None and live.now - live.telemetry_at > guards.stale_after_s


def reservation_fits(reservation: LinkReservation, topology: Topology, live: LiveState) -> bool:
    """Whether ``reservation`` fits the link's in-flight budget given the live in-flight
    bytes (the pure twin of the server's atomic Redis reservation)."""
    link = topology.link_by_pair.get((reservation.source, reservation.target))
    if link is None:
        return False
    load = live.links.get(link.key)
    inflight = load.inflight_bytes if load is not None else 0
    return link_admits(0.0, inflight, reservation.bytes, link.budget_bytes)


# --------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------


def _prefill_pool(topology: Topology, live: LiveState, cluster: str) -> list[list[Any]]:
    """Active prefill instances of ``cluster`` as ``[instance, backlog_s]`` entries.

    Backlog: ``queued_prefill_s`` when reported, else ``depth * T(tokens / depth)`` on the
    cluster's hardware. This loop runs for every instance of the origin on every request,
    so the table lookup is inlined (reporters that send ``queued_prefill_s`` skip it).
    """
    loads = live.instances
    pool: list[list[Any]] = []
    curve = topology.prefill_curve.get(cluster)
    if curve is None:
        return pool
    xs, ys, slopes = curve._xs, curve._ys, curve._slopes
    last = len(slopes) - 1
    append = pool.append
    for name, inst, active in topology.prefill_rows.get(cluster, ()):
        load = loads.get(name)
        if load is None:
            if active:
                append([inst, 0.0])
            continue
        state = load.state
        if (state != "active") if state is not None else not active:
            continue
        q = load.queued_prefill_s
        if q is None:
            tokens = load.queued_prefill_tokens
            if tokens > 0:
                depth = load.queue_depth
                if depth < 1:
                    depth = 1
                x = tokens / depth
                i = bisect_right(xs, x) - 1
                if i < 0:
                    i = 0
                elif i > last:
                    i = last
                q = depth * (ys[i] + slopes[i] * (x - xs[i]))
                if q < 0.0:
                    q = 0.0
            else:
                q = 0.0
        elif q < 0.0:
            q = 0.0
        append([inst, q])
    return pool


class _Context:
    """Per-snapshot work shared by every request decided against one live state: active
    pools, backlogs and link loads, plus what this batch itself has already placed."""

    __slots__ = ("decode", "extra_inflight", "live", "policy", "pool_index", "pools", "topology")

    def __init__(self, policy: Policy, topology: Topology, live: LiveState) -> None:
        self.policy = policy
        self.topology = topology
        self.live = live
        # cluster -> [[instance, backlog_s], ...] (lists: a batch adds its own work)
        self.pools: dict[str, list[list[Any]]] = {}
        self.decode: dict[str, list[list[Any]]] = {}
        self.extra_inflight: dict[tuple[str, str], int] = {}
        # cluster -> {instance name: pool entry}, built only when a request has hits there
        self.pool_index: dict[str, dict[str, list[Any]]] = {}

    def prefill_pool(self, cluster: str) -> list[list[Any]]:
        got = self.pools.get(cluster)
        if got is None:
            got = _prefill_pool(self.topology, self.live, cluster)
            self.pools[cluster] = got
        return got

    def decode_pool(self, cluster: str) -> list[list[Any]]:
        """Active decode instances of ``cluster`` as ``[score, instance]``: the ordering key
        (has KV room, active requests, KV usage) folded into one number, so that picking is
        one C-level ``min``; a batch adds 1 per request it places there."""
        got = self.decode.get(cluster)
        if got is None:
            loads = self.live.instances
            cap = self.policy.guards.decode_kv_usage_max
            got = []
            append = got.append
            for name, inst, active in self.topology.decode_rows.get(cluster, ()):
                load = loads.get(name)
                if load is None:
                    if active:
                        append([0.0, inst])
                    continue
                state = load.state
                if (state == "active") if state is not None else active:
                    kv = load.kv_usage
                    # kv is within [0, 1]: half of it never outweighs one request.
                    score = load.running + load.waiting + 0.5 * kv
                    if kv >= cap:
                        score += 1e12
                    append([score, inst])
            self.decode[cluster] = got
        return got

    def index_of(self, cluster: str) -> dict[str, list[Any]]:
        got = self.pool_index.get(cluster)
        if got is None:
            got = {e[0].name: e for e in self.prefill_pool(cluster)}
            self.pool_index[cluster] = got
        return got

    def link_inflight(self, link: LinkSpec) -> int:
        load = self.live.links.get(link.key)
        base = load.inflight_bytes if load is not None else 0
        return base + self.extra_inflight.get(link.key, 0)


class _Hits:
    """The request's usable cached prefixes, per cluster and per instance."""

    __slots__ = ("best", "by_cluster", "by_instance", "pool")

    def __init__(self) -> None:
        # cluster -> (tokens, instance or None, exact)
        self.best: dict[str, tuple[int, str | None, bool]] = {}
        # instance -> tokens, and the same per cluster
        self.by_instance: dict[str, int] = {}
        self.by_cluster: dict[str, dict[str, int]] = {}
        # cluster -> tokens in the cluster-wide pool
        self.pool: dict[str, int] = {}

    def cluster_hit(self, cluster: str) -> tuple[int, str | None, bool]:
        return self.best.get(cluster, (0, None, True))


def _collect_hits(
    request: RouteRequest, topology: Topology, guards: Guards, loads: Mapping[str, InstanceLoad]
) -> _Hits:
    """The request's prefix matches that can be used: on a known active prefill instance of
    the named cluster (or a cluster-wide pool), degraded ones discounted, capped below the
    prompt. A cache on a draining or down instance is not counted anywhere."""
    hits = _Hits()
    if not request.prefix_matches and not request.cached_tokens:
        return hits
    block = topology.model.block_tokens
    # At least one token is always computed: the engine needs it for the first output token.
    cap = request.prompt_tokens - 1
    instances = topology.instance_by_name
    clusters = topology.cluster_by_name
    matches: Iterable[PrefixMatch] = request.prefix_matches
    if request.cached_tokens:
        matches = list(matches) + [
            PrefixMatch(cluster=c, tokens=n) for c, n in request.cached_tokens.items()
        ]
    for m in matches:
        if m.cluster not in clusters or m.tokens <= 0:
            continue
        tokens = m.tokens
        if not m.exact:
            tokens = int(tokens * guards.degraded_match_factor) // block * block
        tokens = min(tokens, cap)
        if tokens <= 0:
            continue
        if m.instance is not None:
            inst = instances.get(m.instance)
            if inst is None or inst.cluster != m.cluster or inst.role != "prefill":
                continue
            load = loads.get(m.instance)
            state = load.state if load is not None and load.state is not None else inst.state
            if state != "active":
                continue
            if tokens > hits.by_instance.get(m.instance, 0):
                hits.by_instance[m.instance] = tokens
                hits.by_cluster.setdefault(m.cluster, {})[m.instance] = tokens
        elif tokens > hits.pool.get(m.cluster, 0):
            hits.pool[m.cluster] = tokens
        prev = hits.best.get(m.cluster)
        if prev is None or tokens > prev[0] or (tokens == prev[0] and m.exact and not prev[2]):
            hits.best[m.cluster] = (tokens, m.instance, m.exact)
    return hits


def _spread_key(request: RouteRequest) -> int:
    key = request.request_id or f"{request.origin}:{request.prompt_tokens}"
    return zlib.crc32(key.encode())


def _pick_prefill(
    ctx: _Context,
    cluster: str,
    request: RouteRequest,
    hits: _Hits,
    extra_cached: int,
    use_load: bool,
) -> tuple[list[Any], int] | None:
    """The active prefill instance of ``cluster`` that finishes this request first:
    least ``backlog + T(prompt - its usable prefix)``, i.e. cache-affine but load-aware.

    Returns (pool entry ``[instance, backlog_s]``, cached tokens there), or None when the
    cluster has no active prefill instance. ``extra_cached``: tokens a cache transfer would
    bring to whichever instance wins. Without trustworthy load (``use_load=False``) the
    longest hit wins and ties are spread by a hash of the request.
    """
    pool = ctx.prefill_pool(cluster)
    if not pool:
        return None
    prompt = request.prompt_tokens
    base_cached = hits.pool.get(cluster, 0)
    if extra_cached > base_cached:
        base_cached = extra_cached
    own = hits.by_cluster.get(cluster)
    if not use_load:
        longest = base_cached
        ties: list[list[Any]] = []
        for entry in pool:
            c = own.get(entry[0].name, 0) if own else 0
            if c < base_cached:
                c = base_cached
            if c > longest:
                longest, ties = c, [entry]
            elif c == longest:
                ties.append(entry)
        return ties[_spread_key(request) % len(ties)], longest
    # The least backlogged instance, or one holding a longer prefix: any other instance
    # has at least that backlog and no better prefix, so it cannot finish first.
    topology = ctx.topology
    best = min(pool, key=_second)
    best_cached = base_cached
    if own:
        c = own.get(best[0].name, 0)
        if c > best_cached:
            best_cached = c
    best_cost = best[1] + topology.prefill_seconds(cluster, prompt - best_cached)
    if own:
        index = ctx.index_of(cluster)
        for name, tokens in own.items():
            held = index.get(name)
            if held is None or held is best:
                continue
            entry = held
            cached = tokens if tokens > base_cached else base_cached
            cost = entry[1] + topology.prefill_seconds(cluster, prompt - cached)
            if cost < best_cost:
                best, best_cost, best_cached = entry, cost, cached
    return best, best_cached


def _pick_decode(ctx: _Context, request: RouteRequest, guards: Guards, use_load: bool) -> list[Any]:
    """Least loaded active decode instance of the origin with KV room (any active one when
    none has room), as its pool entry ``[score, instance]``; raises RouteUnavailable when
    the origin has no active decode instance."""
    origin = request.origin
    pool = ctx.decode_pool(origin)
    if not pool:
        raise RouteUnavailable(
            f"pd cluster {origin!r} has no active decode instance", code=Reason.NO_DECODE_CAPACITY
        )
    if not use_load:
        # No trustworthy load: spread requests by a hash instead of piling onto one.
        return pool[_spread_key(request) % len(pool)]
    return min(pool, key=_first)


class _Option:
    """One PrfaaS cluster considered for this request (internal, mutable scratch)."""

    __slots__ = (
        "backlog",
        "cached",
        "cluster",
        "decision_tokens",
        "entry",
        "kv_bytes",
        "link",
        "move_in",
        "move_out",
        "reserve_bytes",
        "scarce",
        "ttft",
        "util",
    )

    cluster: str
    link: LinkSpec
    util: float
    backlog: float
    scarce: bool
    #: the offload test's incremental length for this cluster
    decision_tokens: int
    #: (holder instance, tokens, bytes) of a PrfaaS-held prefix that could move to the origin
    move_out: tuple[str | None, int, int] | None
    #: (holder instance, tokens, bytes) of a PD-held prefix moved here if offloaded
    move_in: tuple[str | None, int, int] | None
    entry: list[Any]
    cached: int
    kv_bytes: int
    reserve_bytes: int
    ttft: float


def _placement(inst: InstanceSpec) -> Placement:
    return Placement(inst.cluster, inst.name, inst.endpoint)


def _headroom(ctx: _Context, link: LinkSpec) -> int:
    return link.budget_bytes - ctx.link_inflight(link)


def _admits(ctx: _Context, opt: _Option) -> bool:
    """The link admits this offload (scheduling.core.link: not saturated, budget has room)."""
    return link_admits(
        opt.util, ctx.link_inflight(opt.link), opt.reserve_bytes, opt.link.budget_bytes
    )


def _transfer_seconds(nbytes: float, link: LinkSpec, util: float) -> float:
    share = max(_MIN_BANDWIDTH_SHARE, 1.0 - util)
    return nbytes * 8.0 / (link.gbps * 1e9 * share)


def _validate(request: RouteRequest, topology: Topology) -> None:
    origin = topology.cluster_by_name.get(request.origin)
    if origin is None:
        raise RouteInputError(f"unknown origin cluster {request.origin!r}", code="unknown_origin")
    if origin.kind != "pd":
        raise RouteInputError(
            f"origin {request.origin!r} is a {origin.kind} cluster; requests arrive at pd clusters",
            code="invalid_origin",
        )
    tokens = request.prompt_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RouteInputError("prompt_tokens must be a positive integer", code="invalid_tokens")


def _evaluate_prfaas(
    ctx: _Context,
    request: RouteRequest,
    hits: _Hits,
    link: LinkSpec,
    l_pd: int,
    pd_holder: str | None,
    pd_exact: bool,
    stale: bool,
) -> _Option | None:
    """How offloading to ``link.source`` would go; None if it has no active prefill."""
    topology = ctx.topology
    guards = ctx.policy.guards
    cluster = link.source
    pool = ctx.prefill_pool(cluster)
    if not pool:
        return None
    prompt = request.prompt_tokens
    l_c, c_holder, c_exact = hits.cluster_hit(cluster)
    if stale:
        # The static rule: local cache only, no transfers, no load.
        util, backlog, scarce = 0.0, 0.0, True
    else:
        load = ctx.live.links.get(link.key)
        util = (load.egress_gbps / link.gbps) if load is not None else 0.0
        backlog = sum(e[1] for e in pool) / len(pool)
        if util >= link.scarce_at(guards) or backlog >= guards.prfaas_backlog_s:
            scarce = True
        elif util <= link.abundant_at(guards) and backlog <= guards.prfaas_backlog_clear_s:
            scarce = False
        else:
            control = ctx.live.control.get(request.origin)
            scarce = control.scarce if control is not None else True
    transfers_ok = guards.allow_cache_transfer and not scarce

    opt = _Option()
    opt.cluster, opt.link, opt.util, opt.backlog, opt.scarce = cluster, link, util, backlog, scarce
    # Paper's offload test: scarce -> prompt - l_pd; abundant -> prompt - max(l_prfaas, l_pd),
    # where l_prfaas counts only when it can really be moved to the PD cluster.
    movable = l_c if (transfers_ok and c_exact and l_c > l_pd) else 0
    opt.decision_tokens = prompt - max(l_pd, movable)
    opt.move_out = (c_holder, l_c, topology.prefix_bytes(l_c)) if movable else None
    opt.move_in = None
    extra = 0
    if transfers_ok and pd_exact and l_pd > l_c:
        extra = l_pd
    picked = _pick_prefill(ctx, cluster, request, hits, extra, not stale)
    assert picked is not None
    entry, cached = picked
    reserve = 0
    ttft = entry[1] + link.rtt_ms / 1000.0
    if extra and cached == extra and hits.by_instance.get(entry[0].name, 0) < extra:
        move_bytes = topology.prefix_bytes(extra)
        opt.move_in = (pd_holder, extra, move_bytes)
        reserve += move_bytes
        ttft += _transfer_seconds(move_bytes, link, util)
    opt.entry, opt.cached = entry, cached
    # KV the decode side needs: everything but the prefix the PD cluster already holds.
    opt.kv_bytes = topology.kv_transfer_bytes(prompt, l_pd)
    reserve += opt.kv_bytes
    compute = topology.prefill_seconds(cluster, prompt - cached)
    # Layer-wise pipelining hides the KV transfer behind compute; only the excess shows.
    ttft += compute + max(0.0, _transfer_seconds(opt.kv_bytes, link, util) - compute)
    opt.reserve_bytes = reserve
    opt.ttft = ttft
    return opt


def _book_prefill(ctx: _Context, entry: list[Any], seconds: float) -> None:
    entry[1] += seconds


def _book_link(ctx: _Context, reservation: LinkReservation | None) -> None:
    if reservation is not None and reservation.bytes:
        key = (reservation.source, reservation.target)
        ctx.extra_inflight[key] = ctx.extra_inflight.get(key, 0) + reservation.bytes


def _book_decode(ctx: _Context, entry: list[Any]) -> None:
    entry[0] += 1.0


def _local_decision(
    ctx: _Context,
    request: RouteRequest,
    hits: _Hits,
    decode: list[Any],
    t_eff: float,
    reason: str,
    ttft_prfaas: float | None,
    stale: bool,
    mover: _Option | None = None,
) -> Decision:
    topology = ctx.topology
    origin = request.origin
    prompt = request.prompt_tokens
    move_tokens = mover.move_out[1] if mover is not None and mover.move_out else 0
    picked = _pick_prefill(ctx, origin, request, hits, move_tokens, not stale)
    if picked is None:
        raise RouteUnavailable(
            f"pd cluster {origin!r} has no active prefill instance", code=Reason.ORIGIN_UNAVAILABLE
        )
    entry, cached = picked
    inst = entry[0]
    compute = topology.prefill_seconds(origin, prompt - cached)
    ttft = entry[1] + compute
    cache_transfer = None
    reservation = None
    if mover is not None and mover.move_out and cached == move_tokens:
        holder, tokens, nbytes = mover.move_out
        cache_transfer = CacheTransfer(mover.cluster, holder, origin, inst.name, tokens, nbytes)
        reservation = LinkReservation(mover.link.source, mover.link.target, nbytes)
        ttft += _transfer_seconds(nbytes, mover.link, mover.util)
        _book_link(ctx, reservation)
    _book_prefill(ctx, entry, compute)
    _book_decode(ctx, decode)
    return Decision(
        route="local",
        prefill=_placement(inst),
        decode=_placement(decode[1]),
        incremental_tokens=prompt - cached,
        cached_tokens=cached,
        threshold=t_eff,
        policy_version=ctx.policy.version,
        reason=reason,
        ttft_estimate_s=TtftEstimate(ttft, ttft_prfaas),
        cache_transfer=cache_transfer,
        reservation=reservation,
        kv_bytes=math.ceil(topology.kv_bytes(prompt)),
        request_id=request.request_id,
        stale=stale,
    )


def _prfaas_decision(
    ctx: _Context,
    request: RouteRequest,
    opt: _Option,
    decode: list[Any],
    t_eff: float,
    reason: str,
    ttft_local: float | None,
    stale: bool,
) -> Decision:
    inst = opt.entry[0]
    prompt = request.prompt_tokens
    cache_transfer = None
    if opt.move_in is not None:
        holder, tokens, nbytes = opt.move_in
        cache_transfer = CacheTransfer(
            request.origin, holder, opt.cluster, inst.name, tokens, nbytes
        )
    reservation = LinkReservation(opt.link.source, opt.link.target, opt.reserve_bytes)
    _book_link(ctx, reservation)
    _book_prefill(ctx, opt.entry, ctx.topology.prefill_seconds(opt.cluster, prompt - opt.cached))
    _book_decode(ctx, decode)
    return Decision(
        route="prfaas",
        prefill=_placement(inst),
        decode=_placement(decode[1]),
        incremental_tokens=prompt - opt.cached,
        cached_tokens=opt.cached,
        threshold=t_eff,
        policy_version=ctx.policy.version,
        reason=reason,
        ttft_estimate_s=TtftEstimate(ttft_local if ttft_local is not None else math.inf, opt.ttft),
        cache_transfer=cache_transfer,
        reservation=reservation,
        kv_bytes=opt.kv_bytes,
        request_id=request.request_id,
        stale=stale,
    )


def _congestion_reason(
    control: ControlState | None, options: Sequence[_Option], guards: Guards
) -> str:
    """Why a raised threshold is raised: the recorded cause, else the live signals."""
    if control is not None and control.cause == "backlog":
        return Reason.PRFAAS_BACKLOG
    if control is not None and control.cause == "link":
        return Reason.LINK_CONGESTED
    if any(o.backlog >= guards.prfaas_backlog_s for o in options) and not any(
        o.util >= guards.scarce_utilisation for o in options
    ):
        return Reason.PRFAAS_BACKLOG
    return Reason.LINK_CONGESTED


def _why_local(prompt: int, decision_tokens: int, t0: float) -> str:
    """Local at the policy's own threshold: thanks to a cached prefix, or short anyway."""
    if prompt > t0 >= decision_tokens:
        return Reason.CACHE_AFFINITY
    return Reason.BELOW_THRESHOLD


def _decide(request: RouteRequest, ctx: _Context, stale: bool) -> Decision:
    topology = ctx.topology
    guards = ctx.policy.guards
    origin = request.origin
    prompt = request.prompt_tokens
    hits = _collect_hits(request, topology, guards, ctx.live.instances)
    t0 = ctx.policy.threshold(origin)
    control = None if stale else ctx.live.control.get(origin)
    t_eff = t0 if control is None else control.effective_threshold(t0)
    decode = _pick_decode(ctx, request, guards, not stale)
    l_pd, pd_holder, pd_exact = hits.cluster_hit(origin)

    if stale and guards.stale_mode == "local":
        return _local_decision(
            ctx, request, hits, decode, t_eff, Reason.TELEMETRY_STALE, None, True
        )

    options: list[_Option] = []
    for link in topology.links_into.get(origin, ()):
        opt = _evaluate_prfaas(ctx, request, hits, link, l_pd, pd_holder, pd_exact, stale)
        if opt is not None:
            options.append(opt)
    ttft_prfaas = min((o.ttft for o in options), default=None)

    local_pool = ctx.prefill_pool(origin)
    if not local_pool:
        # Nowhere to prefill locally: offload whatever the length, if some link has room.
        usable = [o for o in options if stale or _admits(ctx, o)]
        if not usable:
            raise RouteUnavailable(
                f"pd cluster {origin!r} has no active prefill instance and no PrfaaS cluster "
                "can take the request",
                code=Reason.ORIGIN_UNAVAILABLE,
            )
        best = min(usable, key=lambda o: (o.ttft, o.cluster))
        reason = Reason.TELEMETRY_STALE if stale else Reason.ORIGIN_UNAVAILABLE
        return _prfaas_decision(ctx, request, best, decode, t_eff, reason, None, stale)

    def local(reason: str, mover: _Option | None = None) -> Decision:
        return _local_decision(ctx, request, hits, decode, t_eff, reason, ttft_prfaas, stale, mover)

    def local_ttft() -> float:
        picked = _pick_prefill(ctx, origin, request, hits, 0, not stale)
        assert picked is not None
        return picked[0][1] + topology.prefill_seconds(origin, prompt - picked[1])

    incr_local = prompt - l_pd
    if not options:
        if incr_local > t0:
            return local(Reason.TELEMETRY_STALE if stale else Reason.PRFAAS_UNAVAILABLE)
        return local(Reason.TELEMETRY_STALE if stale else _why_local(prompt, incr_local, t0))

    # Offload only when no cluster's rule keeps it local: a prefix that one PrfaaS cluster
    # could move to the origin wins over offloading to another.
    wanting = options if min(o.decision_tokens for o in options) > t_eff else []
    # A PrfaaS backlog raises t to shed queue, not to make requests slower: a request that
    # the policy's own t would offload still goes to PrfaaS when it would start prefilling
    # there sooner than locally, backlog included (shortest expected delay). Link congestion
    # is different: there the budget, not the wait, is the limit.
    if (
        not wanting
        and not stale
        and control is not None
        and control.cause == "backlog"
        and min(o.decision_tokens for o in options) > t0
    ):
        sooner = local_ttft()
        wanting = [o for o in options if o.ttft < sooner]
    if stale:
        if wanting:
            best = min(wanting, key=lambda o: (o.ttft, o.cluster))
            return _prfaas_decision(
                ctx, request, best, decode, t_eff, Reason.TELEMETRY_STALE, local_ttft(), True
            )
        return local(Reason.TELEMETRY_STALE)

    if not wanting:
        # Staying local. With abundant bandwidth a longer exact prefix held by a PrfaaS
        # cluster is moved here (paper 3.4.3), if the link budget has room for it.
        mover: _Option | None = None
        move_tokens = 0
        for o in options:
            out = o.move_out
            if out is not None and out[1] > move_tokens and out[2] <= _headroom(ctx, o.link):
                mover, move_tokens = o, out[1]
        if incr_local > t_eff:
            # Only a PrfaaS-held prefix keeps it local: it moves here, unless the link that
            # would carry a long enough one is full (then whatever fits still helps).
            if prompt - move_tokens <= t_eff:
                return local(Reason.CACHE_AFFINITY, mover)
            return local(Reason.LINK_CONGESTED, mover)
        best_tokens = prompt - max(l_pd, move_tokens)
        if best_tokens > t0:
            return local(_congestion_reason(control, options, guards), mover)
        return local(_why_local(prompt, best_tokens, t0), mover)

    fits: list[_Option] = []
    blocked_by_link = False
    for o in wanting:
        if o.backlog > guards.prfaas_backlog_reject_s:
            continue
        if not _admits(ctx, o):
            blocked_by_link = True
            continue
        fits.append(o)
    if not fits:
        return local(Reason.LINK_CONGESTED if blocked_by_link else Reason.PRFAAS_BACKLOG)
    best = min(fits, key=lambda o: (o.ttft, o.cluster))
    return _prfaas_decision(
        ctx, request, best, decode, t_eff, Reason.ABOVE_THRESHOLD, local_ttft(), False
    )


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


def route_decide(
    request: RouteRequest, policy: Policy, topology: Topology, live: LiveState
) -> Decision:
    """Decide one request. Raises RouteInputError for a request that is wrong in itself and
    RouteUnavailable when the origin cannot serve it at all (no decode, no prefill)."""
    _validate(request, topology)
    ctx = _Context(policy, topology, live)
    return _decide(request, ctx, live_is_stale(live, policy.guards))


def route_decide_many(
    requests: Sequence[RouteRequest], policy: Policy, topology: Topology, live: LiveState
) -> list[Decision]:
    """Decide a batch against one live snapshot, in order.

    The per-snapshot work (active pools, backlogs) is done once, and every decision books its
    own work (prefill seconds, decode slot, reserved link bytes) for the ones after it, so a
    batch spreads over the fleet and never reserves more than a link's budget. Every request
    is validated before any is decided; an error carries the failing ``index``.
    """
    for i, request in enumerate(requests):
        try:
            _validate(request, topology)
        except RouteError as exc:
            exc.index = i
            raise
    ctx = _Context(policy, topology, live)
    stale = live_is_stale(live, policy.guards)
    out: list[Decision] = []
    for i, request in enumerate(requests):
        try:
            out.append(_decide(request, ctx, stale))
        except RouteError as exc:
            exc.index = i
            raise
    return out


def route_fallback_local(
    request: RouteRequest,
    policy: Policy,
    topology: Topology,
    live: LiveState,
    *,
    reason: str = Reason.LINK_CONGESTED,
    original: Decision | None = None,
) -> Decision:
    """The local decision for ``request`` without any cross-cluster transfer.

    For the server when the atomic reservation of ``original.reservation`` fails in Redis:
    the request stays local and says ``reason`` (``link_congested`` by default). The PrfaaS
    TTFT estimate of ``original`` is kept. Raises RouteUnavailable if the origin has no
    active prefill instance.
    """
    _validate(request, topology)
    ctx = _Context(policy, topology, live)
    stale = live_is_stale(live, policy.guards)
    hits = _collect_hits(request, topology, policy.guards, live.instances)
    decode = _pick_decode(ctx, request, policy.guards, not stale)
    t0 = policy.threshold(request.origin)
    control = None if stale else live.control.get(request.origin)
    t_eff = t0 if control is None else control.effective_threshold(t0)
    ttft_prfaas = original.ttft_estimate_s.prfaas if original is not None else None
    return _local_decision(ctx, request, hits, decode, t_eff, reason, ttft_prfaas, stale)


def route_fallback_local_many(
    requests: Sequence[RouteRequest],
    originals: Sequence[Decision | None],
    policy: Policy,
    topology: Topology,
    live: LiveState,
    *,
    reason: str = Reason.LINK_CONGESTED,
) -> list[Decision | None]:
    """:func:`route_fallback_local` for a batch, sharing one pass over the live state.

    ``originals[i]``: the decision whose reservation might fail (None: no fallback needed,
    answered None). The fallbacks book their own work on each other, as if all of them
    happened. An item whose origin has no active prefill instance gets None: if its
    reservation fails it cannot be served.
    """
    if len(requests) != len(originals):
        raise ValueError("requests and originals must have the same length")
    ctx = _Context(policy, topology, live)
    stale = live_is_stale(live, policy.guards)
    out: list[Decision | None] = []
    for request, original in zip(requests, originals, strict=True):
        if original is None:
            out.append(None)
            continue
        _validate(request, topology)
        if not ctx.prefill_pool(request.origin):
            out.append(None)
            continue
        hits = _collect_hits(request, topology, policy.guards, live.instances)
        decode = _pick_decode(ctx, request, policy.guards, not stale)
        t0 = policy.threshold(request.origin)
        control = None if stale else live.control.get(request.origin)
        t_eff = t0 if control is None else control.effective_threshold(t0)
        out.append(
            _local_decision(
                ctx,
                request,
                hits,
                decode,
                t_eff,
                reason,
                original.ttft_estimate_s.prfaas,
                stale,
            )
        )
    return out


# --------------------------------------------------------------------------------------
# Plain-dict (JSON) forms
# --------------------------------------------------------------------------------------


def _num(x: float) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    return None if x is None or not math.isfinite(x) else x


def _link_dict(lk: LinkSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": lk.source,
        "target": lk.target,
        "gbps": lk.gbps,
        "rtt_ms": lk.rtt_ms,
        "inflight_budget_bytes": lk.budget_bytes,
    }
    if lk.target_utilisation is not None:
        out["target_utilisation"] = lk.target_utilisation
    return out


def policy_snapshot_to_dict(snapshot: PolicySnapshot) -> dict[str, Any]:
    """The JSON-able form of a policy and its topology: what ``GET /api/v1/policy`` serves
    and what a router client caches (complete enough to call :func:`route_decide`)."""
    policy, topology = snapshot.policy, snapshot.topology
    g = policy.guards
    model = topology.model
    return {
        "format": SNAPSHOT_FORMAT,
        "policy": {
            "version": policy.version,
            "thresholds": dict(sorted(policy.thresholds.items())),
            "guards": {name: getattr(g, name) for name in Guards.__dataclass_fields__},
        },
        "model": {
            "name": model.name,
            "block_tokens": model.block_tokens,
            "kv_cache_mib": [list(p) for p in model.kv_cache_mib],
            "linear_state_mib": model.linear_state_mib,
        },
        "clusters": [
            {
                "name": c.name,
                "kind": c.kind,
                "accelerator": c.accelerator,
                "site": c.site,
                "prefill_seconds": [list(p) for p in c.prefill_seconds],
                "decode": (
                    None
                    if c.decode is None
                    else {"max_batch": c.decode.max_batch, "step_seconds": c.decode.step_seconds}
                ),
            }
            for c in topology.clusters
        ],
        "instances": [
            {
                "name": i.name,
                "cluster": i.cluster,
                "role": i.role,
                "state": i.state,
                "endpoint": i.endpoint,
            }
            for i in topology.instances
        ],
        "links": [_link_dict(lk) for lk in topology.links],
    }


class _Reader:
    """Strict reading of a snapshot dict: wrong keys and types name their key path."""

    _MISSING = object()

    @staticmethod
    def mapping(value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise SnapshotFormatError(f"{path}: expected an object")
        return value

    @staticmethod
    def only(obj: Mapping[str, Any], path: str, allowed: Iterable[str]) -> None:
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise SnapshotFormatError(f"{path}.{unknown[0]}: unknown key")

    @classmethod
    def get(
        cls, obj: Mapping[str, Any], key: str, path: str, kind: Any, default: Any = _MISSING
    ) -> Any:
        where = f"{path}.{key}" if path else key
        if key not in obj:
            if default is cls._MISSING:
                raise SnapshotFormatError(f"{where}: missing")
            return default
        value = obj[key]
        if value is None and default is None:
            return None
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SnapshotFormatError(f"{where}: expected a number")
            if not math.isfinite(value):
                raise SnapshotFormatError(f"{where}: expected a finite number")
            return float(value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise SnapshotFormatError(f"{where}: expected an integer")
            return value
        if not isinstance(value, kind):
            raise SnapshotFormatError(f"{where}: expected {getattr(kind, '__name__', kind)}")
        return value

    @classmethod
    def table(cls, value: Any, path: str) -> tuple[tuple[float, float], ...]:
        if not isinstance(value, list) or not value:
            raise SnapshotFormatError(f"{path}: expected a non-empty list of [tokens, value]")
        out: list[tuple[float, float]] = []
        for i, point in enumerate(value):
            if (
                not isinstance(point, list | tuple)
                or len(point) != 2
                or any(isinstance(v, bool) or not isinstance(v, int | float) for v in point)
                or not all(math.isfinite(v) for v in point)
            ):
                raise SnapshotFormatError(f"{path}[{i}]: expected [tokens, value] numbers")
            if i and point[0] <= out[-1][0]:
                raise SnapshotFormatError(f"{path}[{i}]: tokens must increase")
            out.append((float(point[0]), float(point[1])))
        return tuple(out)


def policy_snapshot_from_dict(data: Any) -> PolicySnapshot:
    """Read the dict :func:`policy_snapshot_to_dict` writes. Raises SnapshotFormatError
    naming the key path of the first problem (``instances[3].role: ...``)."""
    r = _Reader
    root = r.mapping(data, "snapshot")
    r.only(root, "snapshot", ("format", "policy", "model", "clusters", "instances", "links"))
    fmt = r.get(root, "format", "", int)
    if fmt != SNAPSHOT_FORMAT:
        raise SnapshotFormatError(f"format: unsupported snapshot format {fmt}")

    pol = r.mapping(r.get(root, "policy", "", dict), "policy")
    r.only(pol, "policy", ("version", "thresholds", "guards"))
    version = r.get(pol, "version", "policy", int)
    raw_thresholds = r.mapping(r.get(pol, "thresholds", "policy", dict), "policy.thresholds")
    thresholds = {}
    for name in raw_thresholds:
        value = r.get(raw_thresholds, name, "policy.thresholds", int)
        if value < 0:
            raise SnapshotFormatError(f"policy.thresholds.{name}: must not be negative")
        thresholds[str(name)] = value
    raw_guards = r.mapping(r.get(pol, "guards", "policy", dict, {}), "policy.guards")
    fields = Guards.__dataclass_fields__
    r.only(raw_guards, "policy.guards", fields)
    kwargs: dict[str, Any] = {}
    for name in raw_guards:
        default = fields[name].default
        kind = bool if isinstance(default, bool) else str if isinstance(default, str) else float
        kwargs[name] = r.get(raw_guards, name, "policy.guards", kind)
    try:
        guards = Guards(**kwargs)
    except ValueError as exc:
        raise SnapshotFormatError(f"policy.{exc}") from None

    m = r.mapping(r.get(root, "model", "", dict), "model")
    r.only(m, "model", ("name", "block_tokens", "kv_cache_mib", "linear_state_mib"))
    model = ModelSpec(
        name=r.get(m, "name", "model", str),
        block_tokens=r.get(m, "block_tokens", "model", int),
        kv_cache_mib=r.table(r.get(m, "kv_cache_mib", "model", list), "model.kv_cache_mib"),
        linear_state_mib=r.get(m, "linear_state_mib", "model", float, None),
    )
    clusters = []
    for i, c in enumerate(r.get(root, "clusters", "", list)):
        path = f"clusters[{i}]"
        c = r.mapping(c, path)
        r.only(c, path, ("name", "kind", "accelerator", "site", "prefill_seconds", "decode"))
        d = r.get(c, "decode", path, dict, None)
        decode = None
        if d is not None:
            r.only(d, f"{path}.decode", ("max_batch", "step_seconds"))
            decode = DecodeProfile(
                r.get(d, "max_batch", f"{path}.decode", int),
                r.get(d, "step_seconds", f"{path}.decode", float),
            )
        clusters.append(
            ClusterSpec(
                name=r.get(c, "name", path, str),
                kind=r.get(c, "kind", path, str),
                accelerator=r.get(c, "accelerator", path, str, ""),
                site=r.get(c, "site", path, str, ""),
                prefill_seconds=r.table(
                    r.get(c, "prefill_seconds", path, list), f"{path}.prefill_seconds"
                ),
                decode=decode,
            )
        )
    instances = []
    for i, inst in enumerate(r.get(root, "instances", "", list)):
        path = f"instances[{i}]"
        inst = r.mapping(inst, path)
        r.only(inst, path, ("name", "cluster", "role", "state", "endpoint"))
        instances.append(
            InstanceSpec(
                name=r.get(inst, "name", path, str),
                cluster=r.get(inst, "cluster", path, str),
                role=r.get(inst, "role", path, str),
                state=r.get(inst, "state", path, str, "active"),
                endpoint=r.get(inst, "endpoint", path, str, ""),
            )
        )
    links = []
    for i, lk in enumerate(r.get(root, "links", "", list)):
        path = f"links[{i}]"
        lk = r.mapping(lk, path)
        r.only(
            lk,
            path,
            ("source", "target", "gbps", "rtt_ms", "inflight_budget_bytes", "target_utilisation"),
        )
        links.append(
            LinkSpec(
                source=r.get(lk, "source", path, str),
                target=r.get(lk, "target", path, str),
                gbps=r.get(lk, "gbps", path, float),
                rtt_ms=r.get(lk, "rtt_ms", path, float, 0.0),
                inflight_budget_bytes=r.get(lk, "inflight_budget_bytes", path, int, None),
                target_utilisation=r.get(lk, "target_utilisation", path, float, None),
            )
        )
    try:
        topology = Topology(model, tuple(clusters), tuple(instances), tuple(links))
    except ValueError as exc:
        raise SnapshotFormatError(f"topology: {exc}") from None
    return PolicySnapshot(Policy(version, thresholds, guards), topology)


def _placement_dict(p: Placement) -> dict[str, str]:
    return {"cluster": p.cluster, "instance": p.instance, "endpoint": p.endpoint}


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    """The JSON-able form of a decision (the route API's response body)."""
    ct = decision.cache_transfer
    rv = decision.reservation
    return {
        "request_id": decision.request_id,
        "route": decision.route,
        "prefill": _placement_dict(decision.prefill),
        "decode": _placement_dict(decision.decode),
        "incremental_tokens": decision.incremental_tokens,
        "cached_tokens": decision.cached_tokens,
        "threshold": _num(decision.threshold),
        "policy_version": decision.policy_version,
        "reason": decision.reason,
        "ttft_estimate_s": {
            "local": _num(decision.ttft_estimate_s.local),
            "prfaas": _num(decision.ttft_estimate_s.prfaas)
            if decision.ttft_estimate_s.prfaas is not None
            else None,
        },
        "cache_transfer": None
        if ct is None
        else {
            "source_cluster": ct.source_cluster,
            "source_instance": ct.source_instance,
            "target_cluster": ct.target_cluster,
            "target_instance": ct.target_instance,
            "tokens": ct.tokens,
            "bytes": ct.bytes,
        },
        "reservation": None
        if rv is None
        else {"source": rv.source, "target": rv.target, "bytes": rv.bytes},
        "kv_bytes": decision.kv_bytes,
        "stale": decision.stale,
    }


def decision_from_dict(data: Mapping[str, Any]) -> Decision:
    """Read a decision dict (as :func:`decision_to_dict` writes it; unknown keys ignored so
    that a newer server can add fields). Raises ValueError on a malformed body."""
    try:
        ttft = data["ttft_estimate_s"]
        ct = data.get("cache_transfer")
        rv = data.get("reservation")
        threshold = data.get("threshold")
        return Decision(
            route=str(data["route"]),
            prefill=Placement(
                **{k: str(data["prefill"][k]) for k in ("cluster", "instance", "endpoint")}
            ),
            decode=Placement(
                **{k: str(data["decode"][k]) for k in ("cluster", "instance", "endpoint")}
            ),
            incremental_tokens=int(data["incremental_tokens"]),
            cached_tokens=int(data["cached_tokens"]),
            threshold=math.inf if threshold is None else float(threshold),
            policy_version=int(data["policy_version"]),
            reason=str(data["reason"]),
            ttft_estimate_s=TtftEstimate(
                math.inf if ttft.get("local") is None else float(ttft["local"]),
                None if ttft.get("prfaas") is None else float(ttft["prfaas"]),
            ),
            cache_transfer=None
            if ct is None
            else CacheTransfer(
                str(ct["source_cluster"]),
                None if ct.get("source_instance") is None else str(ct["source_instance"]),
                str(ct["target_cluster"]),
                str(ct["target_instance"]),
                int(ct["tokens"]),
                int(ct["bytes"]),
            ),
            reservation=None
            if rv is None
            else LinkReservation(str(rv["source"]), str(rv["target"]), int(rv["bytes"])),
            kv_bytes=int(data.get("kv_bytes", 0)),
            request_id=data.get("request_id"),
            stale=bool(data.get("stale", False)),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed decision: {exc!r}") from None
