"""The rebalancer's vocabulary: hold reasons, the traffic and instance views a tick decides on,
the guards, settings, predictions and the decision itself (frozen dataclasses), and the planner
port. :mod:`scheduling.core.rebalancer` decides with them and re-exports them.
Pure Python: no Django import here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from scheduling.core.kinds import InstanceRole

InstanceStateName = Literal["active", "draining", "down", "unreachable"]

# Hold reasons, stable codes shown to operators and stored with each tick.
HOLD_MISSING_METRICS = "missing_metrics"
HOLD_STALE_METRICS = "stale_metrics"
HOLD_INVALID_METRICS = "invalid_metrics"
HOLD_NO_TRAFFIC = "no_traffic"
HOLD_WINDOW_TOO_SMALL = "window_too_small"
HOLD_WARMING_UP = "instances_warming_up"
HOLD_COOLDOWN = "cooldown"
HOLD_ALREADY_OPTIMAL = "already_optimal"
HOLD_DEAD_BAND = "inside_dead_band"
HOLD_AWAITING_PERSISTENCE = "awaiting_persistence"
HOLD_REVERSAL_LIMITED = "reversal_limited"
HOLD_NO_ELIGIBLE_INSTANCE = "no_eligible_instance"
HOLD_INFEASIBLE = "infeasible_bounds"
# The analytical model liked the candidate, but simulating it on the recent traffic did not
# confirm the gain (or the bounded simulation could not finish): it is not proposed.
HOLD_SIMULATION_REJECTED = "simulation_rejected"
HOLD_SIMULATION_INCOMPLETE = "simulation_incomplete"
# Holds that saw a real candidate: it stays pending, so persistence counts consecutive ticks.
PENDING_REASONS = (HOLD_AWAITING_PERSISTENCE, HOLD_REVERSAL_LIMITED, HOLD_COOLDOWN)

HOLD_REASONS = (
    HOLD_MISSING_METRICS,
    HOLD_STALE_METRICS,
    HOLD_INVALID_METRICS,
    HOLD_NO_TRAFFIC,
    HOLD_WINDOW_TOO_SMALL,
    HOLD_WARMING_UP,
    HOLD_COOLDOWN,
    HOLD_ALREADY_OPTIMAL,
    HOLD_DEAD_BAND,
    HOLD_AWAITING_PERSISTENCE,
    HOLD_REVERSAL_LIMITED,
    HOLD_NO_ELIGIBLE_INSTANCE,
    HOLD_INFEASIBLE,
    HOLD_SIMULATION_REJECTED,
    HOLD_SIMULATION_INCOMPLETE,
)


@dataclass(frozen=True)
class TrafficSummary:
    """What the route path observed for one origin PD cluster over ``[start_s, end_s)``.

    ``incremental_tokens`` is a histogram of uncached prompt lengths: ``(tokens, count)``
    points, the empirical distribution the planner evaluates. ``samples`` is how many recorder
    buckets (of ``bucket_s`` seconds) the window holds; ``recorder_seen_at`` is the last time
    the recorder was known alive, even with no requests, which is what separates true zero
    traffic from missing data.
    """

    start_s: float
    end_s: float
    arrivals: int
    offloads: int
    incremental_tokens: tuple[tuple[float, float], ...]
    output_tokens_mean: float | None
    cache_hit_tokens: float
    prompt_tokens: float
    samples: int
    bucket_s: float
    recorder_seen_at: float | None
    #: fleet seconds per second of the window's clock: the arrival rate reads in the fleet's
    #: clock, the one of its capacities (an emulated fleet may run faster than the wall clock)
    clock_speed: float = 1.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def arrival_rate(self) -> float:
        if self.duration_s <= 0:
            return 0.0
        return self.arrivals / self.duration_s / self.clock_speed

    @property
    def offload_fraction(self) -> float:
        return self.offloads / self.arrivals if self.arrivals else 0.0

    @property
    def cache_hit_fraction(self) -> float:
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens > 0 else 0.0

    @property
    def coverage(self) -> float:
        """Share of the window's buckets that the recorder actually wrote."""
        expected = self.duration_s / self.bucket_s if self.bucket_s > 0 else 0.0
        return min(1.0, self.samples / expected) if expected > 0 else 0.0


@dataclass(frozen=True)
class InstanceView:
    """One PD instance as the rebalancer sees it: role, state, load and telemetry age."""

    name: str
    role: InstanceRole
    state: InstanceStateName
    warming_up: bool = False
    load: float | None = None
    seen_at: float | None = None
    # Set where the role's controller removes the highest ordinal first (a StatefulSet, an
    # LWS): the plan can then only flip the instances that shrinking the role removes.
    ordinal: int | None = None


@dataclass(frozen=True)
class RebalanceGuards:
    """Per-cluster guards; :mod:`scheduling.core.rebalancer`'s docstring documents each default."""

    dead_band: float = 0.05
    max_change_fraction: float = 0.10
    min_changes: int = 1
    cooldown_s: float = 300.0
    min_window_requests: int = 100
    min_window_coverage: float = 0.5
    max_staleness_s: float = 120.0
    persist_ticks: int = 2
    urgent_gain: float = 0.25
    reversal_window_s: float = 3600.0
    reversal_gain: float = 0.10
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int | None = None
    max_decode: int | None = None
    threshold_tolerance: float = 0.02

    def with_overrides(self, overrides: Mapping[str, object]) -> RebalanceGuards:
        """These guards with some fields replaced. Unknown names, wrong types (a whole number
        where a count is meant; ``None`` only for the role ceilings) and negative values are
        errors naming the guard."""
        known = set(self.__dataclass_fields__)
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown guard(s): {', '.join(unknown)}")
        for name, value in overrides.items():
            if name in _CEILINGS and value is None:
                continue
            counts = name in _COUNTS or name in _CEILINGS
            number_ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not number_ok or (counts and not isinstance(value, int)):
                kind = "a whole number" if counts else "a number"
                raise ValueError(f"{name}: must be {kind}, got {value!r}")
            assert isinstance(value, int | float)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
            if name in _FRACTIONS and value > 1:
                raise ValueError(f"{name}: must be between 0 and 1, got {value!r}")
        return replace(self, **overrides)  # type: ignore[arg-type]

    def max_changes(self, cluster_size: int) -> int:
        return max(self.min_changes, math.floor(self.max_change_fraction * cluster_size))


_COUNTS = frozenset(
    {"min_changes", "min_window_requests", "persist_ticks", "min_prefill", "min_decode"}
)
_CEILINGS = frozenset({"max_prefill", "max_decode"})
_FRACTIONS = frozenset({"max_change_fraction", "min_window_coverage", "threshold_tolerance"})


@dataclass(frozen=True)
class Setting:
    """A PD cluster's long-term setting: the offload threshold and the P/D split."""

    threshold: float
    n_p: int
    n_d: int


@dataclass(frozen=True)
class Prediction:
    """The throughput model's verdict on one setting for the observed window."""

    setting: Setting
    capacity_rps: float
    throughput_rps: float
    offload_fraction: float
    ttft_mean_s: float
    ttft_p90_s: float
    egress_gbps: float
    bottleneck: str
    #: queue-aware prediction at the observed arrival rate (scheduling.core.operating)
    at_rate_ttft_mean_s: float | None = None
    at_rate_ttft_p90_s: float | None = None
    at_rate_link_utilisation: float | None = None
    #: the share of the offloads offered to the cluster's links that their guard keeps local
    #: (predicted at the observed rate; scheduling.rebalance.selectors.PREDICTED_REFUSAL_KEY)
    offload_refused_fraction: float | None = None


@dataclass(frozen=True)
class Change:
    """One past change of a setting's component: when, and which way (+1 up, -1 down)."""

    at: float
    direction: int


@dataclass(frozen=True)
class Pending:
    """A candidate seen on the last tick but not yet proposed (persistence)."""

    at: float
    split_direction: int
    threshold_direction: int
    count: int = 1


@dataclass(frozen=True)
class History:
    """What the rebalancer remembers between ticks of one cluster."""

    last_applied_at: float | None = None
    last_split_change: Change | None = None
    last_threshold_change: Change | None = None
    pending: Pending | None = None
    last_reversal_at: float | None = None


@dataclass(frozen=True)
class RoleChange:
    """Flip one instance's role (through drain-then-flip when applied)."""

    instance: str
    from_role: InstanceRole
    to_role: InstanceRole


@dataclass(frozen=True)
class RebalanceDecision:
    """Hold (``action == "hold"``, with ``reason``) or propose (``action == "propose"``)."""

    action: Literal["hold", "propose"]
    reason: str
    detail: str = ""
    current: Prediction | None = None
    proposed: Prediction | None = None
    target: Prediction | None = None
    gain: float | None = None
    role_changes: tuple[RoleChange, ...] = ()
    split_direction: int = 0
    threshold_direction: int = 0

    @property
    def is_hold(self) -> bool:
        return self.action == "hold"


class PlannerPort(Protocol):
    """The planner as the rebalancer needs it (adapted from ``scheduling.core.planner``)."""

    def evaluate(self, window: TrafficSummary, setting: Setting) -> Prediction: ...

    def best(self, window: TrafficSummary, n_total: int, n_p_range: tuple[int, int]) -> Prediction:
        """The best (threshold, split) with ``n_p`` restricted to the inclusive range."""
        ...


@dataclass(frozen=True)
class RebalanceInput:
    """Everything one tick of one PD cluster decides on."""

    cluster: str
    now: float
    window: TrafficSummary | None
    instances: tuple[InstanceView, ...]
    threshold: float
    guards: RebalanceGuards = field(default_factory=RebalanceGuards)
    history: History = field(default_factory=History)
