"""Live views: the one place that owns websocket group names, message shapes and publishing.

Every frame a browser receives is a :class:`Frame`: ``{"type", "group", "epoch", "seq",
"data"}``. ``seq`` comes from one Redis ``INCR`` per group, so any number of web processes,
workers and beat publishing to the same group produce distinct, increasing numbers: a consumer
drops a frame it has already passed (no duplicates) and treats a missing number as a gap
(a lost frame), answered with a full snapshot. ``epoch`` names the life of the Redis data: a
Redis restart without persistence resets the counters, and the new epoch tells every client
that old numbers mean nothing any more (also answered with a snapshot).

Key layout (one store, all under ``views:``):

``views:{seq}:epoch``    STRING  random id, set once (``SET NX``) by the first publisher.
``views:{seq}:{group}``  STRING  last sequence number given out in ``group``.

(The braces of ``{seq}`` are literal: one hash tag, so the script that reads both runs in one
slot of a Redis Cluster.)

Writers call :func:`live_publish` (sync; deferred to ``transaction.on_commit`` so that a
rolled-back write never reaches a screen) or :func:`live_apublish` (async, immediate).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from functools import partial
from typing import Any, Literal, TypedDict

import redis
import redis.asyncio as aioredis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from controlplane.redis_connection import redis_async, redis_sync
from controlplane.redis_scripts import LuaScript, lua_script

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Groups. A consumer subscribes to exactly one group; its snapshot is built per group.

OVERVIEW = "overview"  # link samples, queue depths, decision mix, policy, plan events, alerts
PLANS = "plans"  # plan lifecycle events (list and detail pages)
ALERTS = "alerts"  # the active alerts only: the banner every page shows
WHATIF_PREFIX = "whatif."  # one group per what-if run: ``whatif.{run_id}``

# Channels group names allow only ASCII alphanumerics, hyphens, underscores and periods.
_GROUP_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def whatif_group(run_id: int | str) -> str:
    return f"{WHATIF_PREFIX}{run_id}"


def group_valid(group: str) -> bool:
    """A group a browser may subscribe to: one of the fixed ones or a what-if run's."""
    if group in (OVERVIEW, PLANS, ALERTS):
        return True
    run = group.removeprefix(WHATIF_PREFIX)
    return group.startswith(WHATIF_PREFIX) and run.isdigit() and len(group) < 90


# ---------------------------------------------------------------------------------------------
# Message shapes. ``data`` of a frame is one of these, by ``type``.

FrameType = Literal[
    "snapshot",
    "link_samples",
    "queue_depths",
    "decision_mix",
    "plan_event",
    "policy_event",
    "alerts",
    "link_budgets",
    "service_levels",
    "whatif_progress",
]


@dataclass(frozen=True)
class LinkEgress:
    """Egress of one prfaas->pd link (live-state key ``source->target``) at ``ts``, in Gbps.

    Capacity and budget are in the snapshot: a frame carries only what changes.
    """

    link: str
    ts: float
    gbps: float


@dataclass(frozen=True)
class LinkSamples:
    """The link samples of one telemetry batch: one frame, however many links it carries."""

    samples: tuple[LinkEgress, ...]


@dataclass(frozen=True)
class InstanceQueue:
    """Requests waiting and running on one instance (by name) as its last sample said."""

    instance: str
    queued: int
    running: int


@dataclass(frozen=True)
class QueueDepths:
    ts: float
    instances: tuple[InstanceQueue, ...]


@dataclass(frozen=True)
class DecisionMix:
    """Where recent requests arriving at one pd cluster went and why, over ``window_s``."""

    cluster: str
    ts: float
    window_s: int
    arrivals: int
    offloads: int
    reasons: dict[str, int]
    threshold: float | None = None
    effective_threshold: float | None = None

    @property
    def offload_rate(self) -> float:
        return self.offloads / self.arrivals if self.arrivals else 0.0


@dataclass(frozen=True)
class PlanEvent:
    """A plan changed state (proposed, approved, rejected, applied, rolled back)."""

    plan_id: int
    state: str
    ts: float
    actor: str = ""


@dataclass(frozen=True)
class PolicyEvent:
    """A new policy version is in force; ``thresholds`` maps pd cluster name to t."""

    version: int
    ts: float
    thresholds: dict[str, int] = field(default_factory=dict)


AlertCode = Literal[
    "link_budget_exhausted",
    "offloads_refused",
    "link_congested",
    "pd_queue_growing",
    "instance_down",
    "instance_silent",
    "telemetry_stale",
    "prefix_index_degraded",
]


@dataclass(frozen=True)
class Alert:
    """A condition operators should see; ``active=False`` clears a previous one."""

    code: AlertCode
    subject: str
    message: str
    ts: float
    active: bool = True


@dataclass(frozen=True)
class AlertSet:
    """Every alert active now; replaces the previous set on screen."""

    ts: float
    alerts: tuple[Alert, ...]


@dataclass(frozen=True)
class LinkBudget:
    """One link's in-flight KV bytes against its budget, and the capacity in force, at ``ts``
    (the capacity follows a fault or an inventory change without a reload); and over the last
    ``guard_window_s`` the offloads it carried, those its guard kept local by cause, and the
    share of them the plan in force predicted (None: no prediction)."""

    link: str
    inflight_bytes: float
    budget_bytes: float
    capacity_gbps: float
    egress_budget_gbps: float
    guard_window_s: float = 0.0
    offloads: int = 0
    refused_budget: int = 0
    refused_saturation: int = 0
    predicted_refused_share: float | None = None


@dataclass(frozen=True)
class LinkBudgets:
    """Every link's :class:`LinkBudget` of one overview tick."""

    ts: float
    links: tuple[LinkBudget, ...]


@dataclass(frozen=True)
class ClusterService:
    """What one PD cluster served over ``[start, end]``: request rate and TTFT quantiles
    (None: no first token in the window), against the configured TTFT SLO."""

    cluster: str
    start: float
    end: float
    rate_rps: float
    first_tokens: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    slo_s: float


@dataclass(frozen=True)
class ServiceLevels:
    """Every PD cluster's :class:`ClusterService` of one overview tick."""

    ts: float
    clusters: tuple[ClusterService, ...]


@dataclass(frozen=True)
class WhatIfProgress:
    """How far a what-if simulation run is; ``state`` ends in ``finished`` or ``failed``."""

    run_id: int
    state: Literal["queued", "running", "finished", "failed"]
    done: float
    total: float
    message: str = ""


LiveMessage = (
    LinkSamples
    | QueueDepths
    | DecisionMix
    | PlanEvent
    | PolicyEvent
    | AlertSet
    | LinkBudgets
    | ServiceLevels
    | WhatIfProgress
)

_TYPE_OF: dict[type, FrameType] = {
    LinkSamples: "link_samples",
    QueueDepths: "queue_depths",
    DecisionMix: "decision_mix",
    PlanEvent: "plan_event",
    PolicyEvent: "policy_event",
    AlertSet: "alerts",
    LinkBudgets: "link_budgets",
    ServiceLevels: "service_levels",
    WhatIfProgress: "whatif_progress",
}


class Frame(TypedDict):
    """What goes over the websocket, as JSON."""

    type: FrameType
    group: str
    epoch: str
    seq: int
    data: dict[str, Any]


def message_data(message: LiveMessage) -> dict[str, Any]:
    """A message as JSON-ready data, derived properties included (the page shows them)."""
    data = asdict(message) if is_dataclass(message) else dict(message)
    if isinstance(message, DecisionMix):
        data["offload_rate"] = message.offload_rate
    return data


# ---------------------------------------------------------------------------------------------
# Sequence numbers.

EPOCH_KEY = "views:{seq}:epoch"


def _seq_key(group: str) -> str:
    return f"views:{{seq}}:{group}"


# Sets the epoch if missing, then gives out the next number: one round trip, one atomic step.
_NEXT_SEQ_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return {redis.call('GET', KEYS[1]), redis.call('INCR', KEYS[2])}
"""
# The current position without giving a number out (for snapshots).
_CURRENT_SEQ_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return {redis.call('GET', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0')}
"""
NEXT_SEQ_SCRIPT = lua_script(_NEXT_SEQ_LUA, "live next sequence")
CURRENT_SEQ_SCRIPT = lua_script(_CURRENT_SEQ_LUA, "live current sequence")


def _decode(pair: list[Any]) -> tuple[str, int]:
    epoch = pair[0].decode() if isinstance(pair[0], bytes) else str(pair[0])
    return epoch, int(pair[1])


def _eval_sync(client: redis.Redis, script: LuaScript, group: str) -> tuple[str, int]:
    keys = [EPOCH_KEY, _seq_key(group)]
    for attempt in (1, 2):
        try:
            return _decode(script.run(client, keys, [secrets.token_hex(8)]))
        except redis.ConnectionError:
            # A pooled connection from before a Redis restart fails once; a fresh one works.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _eval_async(client: aioredis.Redis, script: LuaScript, group: str) -> tuple[str, int]:
    keys = [EPOCH_KEY, _seq_key(group)]
    for attempt in (1, 2):
        try:
            return _decode(await script.run_async(client, keys, [secrets.token_hex(8)]))
        except redis.ConnectionError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def sequence_next(group: str, client: redis.Redis | None = None) -> tuple[str, int]:
    """Give out the next ``(epoch, seq)`` of ``group``."""
    return _eval_sync(client or redis_sync(), NEXT_SEQ_SCRIPT, group)


async def asequence_next(group: str, client: aioredis.Redis | None = None) -> tuple[str, int]:
    return await _eval_async(client or redis_async(), NEXT_SEQ_SCRIPT, group)


async def asequence_current(group: str, client: aioredis.Redis | None = None) -> tuple[str, int]:
    """The ``(epoch, seq)`` of the last frame given out in ``group`` (0 before any)."""
    return await _eval_async(client or redis_async(), CURRENT_SEQ_SCRIPT, group)


# ---------------------------------------------------------------------------------------------
# Publishing.

# The channel-layer event type consumers handle (``live_frame``).
FRAME_EVENT = "live.frame"


def frame_make(group: str, message: LiveMessage, epoch: str, seq: int) -> Frame:
    return Frame(
        type=_TYPE_OF[type(message)], group=group, epoch=epoch, seq=seq, data=message_data(message)
    )


async def live_apublish(group: str, message: LiveMessage) -> Frame:
    """Number ``message`` in ``group`` and send it to every subscribed consumer now."""
    epoch, seq = await asequence_next(group)
    frame = frame_make(group, message, epoch, seq)
    layer = get_channel_layer()
    if layer is not None:
        event = {"type": FRAME_EVENT, "frame": frame, "sent_at": time.time()}
        try:
            await layer.group_send(group, event)
        except redis.ConnectionError:
            # A pooled connection from before a Redis restart fails once; a fresh one works.
            await layer.group_send(group, event)
    return frame


def _publish_now(group: str, message: LiveMessage) -> None:
    try:
        async_to_sync(live_apublish)(group, message)
    except (redis.RedisError, OSError) as exc:
        # A screen missing one update is better than a failed write: the gap makes clients
        # resync from a snapshot once Redis answers again.
        logger.warning("live publish to %s failed: %s", group, exc)


def live_publish(group: str, message: LiveMessage) -> None:
    """Publish ``message`` to ``group`` once the current transaction commits (now if none).

    For sync code: services and Celery tasks. Never raises for Redis trouble.
    """
    transaction.on_commit(partial(_publish_now, group, message))
