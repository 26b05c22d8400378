"""What a rebalance tick reads: the traffic window, the instances' live views, the history of
earlier ticks, the planner port of a cluster and the threshold in force.

All reads (PostgreSQL and the live stores); the pure decision gets them as frozen dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings as django_settings

from clusters.models import Cluster, Instance, InstanceState
from scheduling.actuators import instance_pod
from scheduling.core import rebalancer
from scheduling.core.scale_targets import ScaleTargetError, pod_ordinal, scale_targets_of
from scheduling.models import (
    ActuatorKind,
    Plan,
    Policy,
    RebalanceSettings,
    RebalanceTick,
)
from scheduling.rebalance.selectors import rebalance_settings_for
from scheduling.rebalance.simulation import inventory_fleet
from scheduling.snapshot import DEFAULT_THRESHOLD_TOKENS
from scheduling.traffic import traffic_window_read

HOLD_PLAN_IN_PROGRESS = "plan_in_progress"
# A proposal is being reviewed: a newer one waits until it is older than PLAN_REVIEW_STALE_S.
HOLD_PLAN_UNDER_REVIEW = "plan_under_review"


HOLD_INVENTORY_INCOMPLETE = "inventory_incomplete"


WARMUP_S = 60.0


# Builds the planner port of a cluster (tests may pass their own).
PlannerFactory = Callable[[Cluster, Mapping[str, Any]], rebalancer.PlannerPort]


def window_from_traffic(
    raw: Any, *, recorder_seen_at: float | None, default_output_tokens: float
) -> rebalancer.TrafficSummary:
    """The rebalancer's window from the traffic store's (``scheduling.traffic.TrafficWindow``).

    Routers rarely know output lengths; without any, the cluster's configured mean is used.
    The recorder's liveness is the freshest telemetry of the cluster's instances: with fresh
    telemetry and no recorded request, the traffic really was zero.
    """
    output_mean = (
        raw.output_tokens / raw.output_known if raw.output_known else float(default_output_tokens)
    )
    return rebalancer.TrafficSummary(
        start_s=raw.start,
        end_s=raw.end,
        arrivals=raw.arrivals,
        offloads=raw.offloads,
        incremental_tokens=rebalancer.histogram_points(raw.bin_edges, raw.histogram),
        output_tokens_mean=output_mean,
        cache_hit_tokens=float(raw.cache_hit_tokens),
        prompt_tokens=float(raw.cache_hit_tokens + raw.incremental_tokens),
        samples=raw.minutes,
        bucket_s=60.0,
        recorder_seen_at=recorder_seen_at,
        clock_speed=float(django_settings.FLEET_CLOCK_SPEED),
    )


def instance_views(
    instances: list[Instance],
    samples: Mapping[str, Any],
    now: float,
    warmup_s: float,
    ordinal_roles: frozenset[str] = frozenset(),
) -> tuple[rebalancer.InstanceView, ...]:
    """The rebalancer's view of ``instances``; in ``ordinal_roles`` (scaled by a controller
    that removes the highest ordinal first) each carries its pod's ordinal."""
    out = []
    for inst in instances:
        sample = samples.get(inst.name)
        out.append(
            rebalancer.InstanceView(
                name=inst.name,
                role=inst.role,  # type: ignore[arg-type]
                state=inst.state,  # type: ignore[arg-type]
                warming_up=inst.state == InstanceState.ACTIVE
                and now - inst.updated_at.timestamp() < warmup_s,
                load=(
                    float(sample.queue_depth + sample.running + sample.waiting)
                    if sample is not None
                    else None
                ),
                seen_at=sample.ts if sample is not None else None,
                ordinal=(
                    pod_ordinal(instance_pod(inst.name, inst.labels))
                    if inst.role in ordinal_roles
                    else None
                ),
            )
        )
    return tuple(out)


def ordinal_roles_for(cluster: Cluster, row: RebalanceSettings) -> frozenset[str]:
    """The roles whose Kubernetes controller removes the highest ordinal first, when the
    ``kubernetes`` actuator scales the cluster (the plan must then drain exactly that pod)."""
    if row.actuator != ActuatorKind.KUBERNETES:
        return frozenset()
    try:
        targets = scale_targets_of(cluster.scale_targets, cluster.kind)
    except ScaleTargetError:
        return frozenset()
    return frozenset(r for r, t in targets.items() if t.removal == "highest_ordinal")


def history_for(cluster: Cluster, period_start: datetime) -> rebalancer.History:
    """What earlier ticks and plans of the cluster mean for anti-flapping: the applied (and
    rolled back) plans replayed in order, and the candidate the previous tick kept pending."""
    changes: list[tuple[float, int, int]] = []
    done = Plan.objects.filter(
        cluster=cluster, applied_at__isnull=False, applied_at__lt=period_start
    ).order_by("-applied_at")[:50]
    for plan in done:
        assert plan.applied_at is not None
        split = (plan.n_p_after > plan.n_p_before) - (plan.n_p_after < plan.n_p_before)
        thr = (plan.threshold_after > plan.threshold_before) - (
            plan.threshold_after < plan.threshold_before
        )
        changes.append((plan.applied_at.timestamp(), split, thr))
        if plan.rolled_back_at is not None and plan.rolled_back_at < period_start:
            changes.append((plan.rolled_back_at.timestamp(), -split, -thr))
    history = rebalancer.History()
    for at, split, thr in sorted(changes):
        history = rebalancer.history_record_change(history, at, split, thr)
    interval = float(django_settings.REBALANCE_INTERVAL_S)
    previous = (
        RebalanceTick.objects.filter(
            cluster=cluster,
            period_start__lt=period_start,
            period_start__gte=period_start - timedelta(seconds=2 * interval),
        )
        .order_by("-period_start")
        .first()
    )
    if (
        previous is not None
        and previous.reason in rebalancer.PENDING_REASONS
        and previous.pending_count
    ):
        history = replace(
            history,
            pending=rebalancer.Pending(
                at=previous.period_start.timestamp(),
                split_direction=previous.split_direction,
                threshold_direction=rebalancer.threshold_move(
                    previous.split_direction, previous.threshold_direction
                ),
                count=previous.pending_count,
            ),
        )
    return history


def planner_for_cluster(cluster: Cluster, context: Mapping[str, Any]) -> rebalancer.FleetPlanner:
    """The planner port for one PD cluster alone, over the inventory as a scenario; PrfaaS
    clusters count only their active instances. (The tick plans jointly with the PD clusters
    sharing its PrfaaS clusters: :func:`scheduling.rebalance.simulation.planner_joint`.)"""
    return rebalancer.FleetPlanner(inventory_fleet(), cluster.name)


def tick_context(
    window: rebalancer.TrafficSummary,
    start: float,
    end: float,
    row: RebalanceSettings,
    policy: Policy | None,
) -> dict[str, Any]:
    """What the planner port and the proposal's simulation read of other PD clusters: their
    traffic windows over the same period and the thresholds routers apply to them."""

    def window_of(peer: Cluster) -> rebalancer.TrafficSummary:
        peer_row = rebalance_settings_for(peer)
        return window_from_traffic(
            traffic_window_read(peer.name, start, end),
            recorder_seen_at=end,
            default_output_tokens=peer_row.default_output_tokens or row.default_output_tokens,
        )

    return {
        "window": window,
        "window_of": window_of,
        "threshold_of": lambda peer: policy_threshold(policy, peer),
    }


def policy_threshold(policy: Policy | None, cluster: Cluster) -> float:
    """The threshold routers apply to ``cluster`` now (the snapshot's rule, default included)."""
    if policy is None:
        return float(DEFAULT_THRESHOLD_TOKENS)
    return float(policy.thresholds.get(cluster.name, DEFAULT_THRESHOLD_TOKENS))


def prediction_json(p: rebalancer.Prediction | None) -> dict[str, Any] | None:
    return asdict(p) if p is not None else None
