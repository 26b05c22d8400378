"""The per-request routing decision of PrfaaS, as one pure function.

``route_decide(request, policy, topology, live) -> RouteDecision`` decides, for one LLM request that
arrived at a PD cluster (its *origin*), whether its prefill runs locally (a PD-P instance of
the origin) or is offloaded to a PrfaaS cluster, on which prefill and decode instances, and
why. It imports no Django, does no I/O and keeps no state: the control-plane server (live
state read from Redis), the simulator (a simulated fleet) and the router client (a cached
policy snapshot, no live state) all call this same code with plain frozen dataclasses.

The rules are the paper's (``docs/paper.md`` sections 3.2, 4.1, 4.2):

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
* a per-link budget of in-flight KV bytes is never exceeded, but by one request bigger than the
  whole budget, admitted alone on an idle link (:func:`scheduling.core.link.link_admits`): the
  decision names the bytes to reserve on one link, checked here against the live in-flight
  bytes; the server reserves them atomically and, if that fails, calls
  :func:`route_fallback_local`.

Units: tokens, seconds, bytes (MiB = 2**20 bytes in tables), Gbps = 1e9 bit/s.
Every ``*_at``/``now`` value is seconds on one clock chosen by the caller (epoch seconds for
the server, simulated seconds for the simulator).
"""

from scheduling.core.link import DEFAULT_LINK_BUDGET_SECONDS
from scheduling.core.routing.decide import (
    route_decide,
    route_decide_many,
    route_fallback_local,
    route_fallback_local_many,
)
from scheduling.core.routing.live import (
    ControlSignals,
    ControlState,
    InstanceLoad,
    LinkLoad,
    LiveState,
    control_initial,
    control_signals,
    control_update,
    live_is_stale,
    reservation_fits,
)
from scheduling.core.routing.reasons import (
    REASON_DESCRIPTIONS,
    REASONS,
    Reason,
)
from scheduling.core.routing.types import (
    CLUSTER_KINDS,
    INSTANCE_ROLES,
    INSTANCE_STATES,
    KV_CONNECTORS,
    REFUSAL_BUDGET,
    REFUSAL_SATURATION,
    SNAPSHOT_FORMAT,
    STALE_MODES,
    CacheTransfer,
    ClusterSpec,
    DecodeProfile,
    InstanceSpec,
    Link,
    LinkRefusal,
    LinkReservation,
    ModelSpec,
    PiecewiseLinear,
    Placement,
    PolicySnapshot,
    PrefixMatch,
    RouteDecision,
    RouteError,
    RouteGuards,
    RouteInputError,
    RouteRequest,
    RouteUnavailable,
    RoutingPolicy,
    SnapshotFormatError,
    Topology,
    TtftEstimate,
    link_abundant_at,
    link_scarce_at,
)
from scheduling.core.routing.wire import (
    decision_from_dict,
    decision_to_dict,
    live_state_from_dict,
    live_state_to_dict,
    policy_snapshot_from_dict,
    policy_snapshot_to_dict,
    route_guards_from_dict,
)

__all__ = [
    "CLUSTER_KINDS",
    "DEFAULT_LINK_BUDGET_SECONDS",
    "INSTANCE_ROLES",
    "INSTANCE_STATES",
    "KV_CONNECTORS",
    "REASONS",
    "REASON_DESCRIPTIONS",
    "REFUSAL_BUDGET",
    "REFUSAL_SATURATION",
    "SNAPSHOT_FORMAT",
    "STALE_MODES",
    "CacheTransfer",
    "ClusterSpec",
    "ControlSignals",
    "ControlState",
    "DecodeProfile",
    "InstanceLoad",
    "InstanceSpec",
    "Link",
    "LinkLoad",
    "LinkRefusal",
    "LinkReservation",
    "LiveState",
    "ModelSpec",
    "PiecewiseLinear",
    "Placement",
    "PolicySnapshot",
    "PrefixMatch",
    "Reason",
    "RouteDecision",
    "RouteError",
    "RouteGuards",
    "RouteInputError",
    "RouteRequest",
    "RouteUnavailable",
    "RoutingPolicy",
    "SnapshotFormatError",
    "Topology",
    "TtftEstimate",
    "control_initial",
    "control_signals",
    "control_update",
    "decision_from_dict",
    "decision_to_dict",
    "link_abundant_at",
    "link_scarce_at",
    "live_is_stale",
    "live_state_from_dict",
    "live_state_to_dict",
    "policy_snapshot_from_dict",
    "policy_snapshot_to_dict",
    "reservation_fits",
    "route_decide",
    "route_decide_many",
    "route_fallback_local",
    "route_fallback_local_many",
    "route_guards_from_dict",
]
