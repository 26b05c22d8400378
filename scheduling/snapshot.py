"""The in-process topology and policy snapshot the request path decides with.

The route endpoint must not query the database per request, so each web process builds the
pure :class:`scheduling.core.routing.Topology` and :class:`scheduling.core.routing.RoutingPolicy` from the
database once and keeps them in memory, together with the serialised ``GET /api/v1/policy``
body and its ETag.

When to rebuild: inventory and policy writes bump the Redis counter ``snapshot:version``
after commit (policy service; ``post_save``/``post_delete`` of inventory models, wired in
:func:`inventory_signals_connect`). The request path reads that counter in its one pipelined
Redis read and rebuilds when it moved. As a safety net a snapshot older than
``settings.SNAPSHOT_MAX_AGE_S`` is rebuilt too. When the database is unreachable the last
snapshot keeps serving (rebuilds are retried at most every ``settings.DB_RETRY_S``), and
:func:`snapshot_age_s` past that bound makes route answers say ``stale`` (the staleness bound).

With no policy in the database, every PD cluster gets ``DEFAULT_THRESHOLD_TOKENS`` and the
policy version is 0. The rebalancer replaces it with a threshold solved from traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete, post_save

from clusters.models import (
    Accelerator,
    Cluster,
    ClusterKind,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    table_errors,
)
from controlplane.errors import ApiError
from controlplane.health import db_call, db_connection_reset
from controlplane.redis_connection import redis_async, redis_sync
from scheduling.core import bounds, routing
from scheduling.models import Policy

log = logging.getLogger(__name__)

SNAPSHOT_VERSION_KEY = "snapshot:version"
# No policy yet: a moderate threshold (tokens). Long prompts offload, short ones stay local;
# the rebalancer's first plan replaces it with the threshold solved from observed traffic.
DEFAULT_THRESHOLD_TOKENS = 8192


class SnapshotUnavailable(ApiError):
    """No snapshot could be built and none was built before (database down at start): 503."""

    status = 503
    code = "unavailable"


@dataclass(frozen=True)
class Snapshot:
    """Everything the request path needs that changes only with inventory or policy."""

    policy: routing.RoutingPolicy
    topology: routing.Topology
    redis_version: int | None
    built_at: float
    body: bytes
    etag: str
    cluster_of: dict[str, str]
    instance_names: tuple[str, ...]
    link_pairs: tuple[tuple[str, str], ...]
    link_keys: tuple[str, ...]
    pd_clusters: tuple[str, ...]
    hybrid: bool
    block_tokens: int
    skipped: tuple[str, ...] = ()
    # Every instance and link of the inventory, routable or not (telemetry may name them).
    known_instances: frozenset[str] = frozenset()
    known_links: frozenset[str] = frozenset()
    # Every instance's cluster (a token bound to clusters reports for their instances).
    known_cluster_of: dict[str, str] = field(default_factory=dict)


def _model_spec(model: ModelProfile) -> routing.ModelSpec:
    return routing.ModelSpec(
        name=model.name,
        block_tokens=model.block_tokens,
        kv_cache_mib=tuple((float(x), float(y)) for x, y in model.kv_cache_mib),
        linear_state_mib=model.linear_state_mib,
    )


def _out_of_bounds(checks: Iterable[tuple[str, bounds.Bound, Any]]) -> str | None:
    """The first ``field: problem`` of ``(field, bound, value)`` checks (None values are
    "not set" and pass), or None: a row written past the API (SQL, an old migration) must be
    left out of the snapshot, not overflow the router."""
    for name, bound, value in checks:
        if value is None:
            continue
        problem = bound.error(value)
        if problem is not None:
            return f"{name} {problem}"
    return None


def _table_problem(name: str, table: Any, values: bounds.Bound) -> str | None:
    errors = table_errors(table) or bounds.table_bound_errors(table, values)
    return f"{name}{errors[0]}" if errors else None


def _model_problem(m: ModelProfile) -> str | None:
    return _out_of_bounds(
        [
            ("block_tokens", bounds.BLOCK_TOKENS, m.block_tokens),
            ("linear_state_mib", bounds.LINEAR_STATE_MIB, m.linear_state_mib),
        ]
    ) or _table_problem("kv_cache_mib", m.kv_cache_mib, bounds.KV_CACHE_MIB)


def _profile_problem(p: PerformanceProfile) -> str | None:
    return _out_of_bounds(
        [
            ("gpus_per_instance", bounds.GPUS_PER_INSTANCE, p.gpus_per_instance),
            ("decode_max_batch", bounds.DECODE_MAX_BATCH, p.decode_max_batch),
            ("decode_step_seconds", bounds.DECODE_STEP_SECONDS, p.decode_step_seconds),
        ]
    ) or _table_problem("prefill_seconds", p.prefill_seconds, bounds.PREFILL_SECONDS)


def _link_problem(lk: Link) -> str | None:
    return _out_of_bounds(
        [
            ("gbps", bounds.LINK_GBPS, lk.gbps),
            ("rtt_ms", bounds.LINK_RTT_MS, lk.rtt_ms),
            ("kv_budget_bytes", bounds.LINK_KV_BUDGET_BYTES, lk.kv_budget_bytes),
            ("target_utilisation", bounds.LINK_TARGET_UTILISATION, lk.target_utilisation),
        ]
    )


def _leave_out(skipped: list[str], reason: str) -> None:
    log.error("routing snapshot leaves out %s (outside its physical bounds)", reason)
    skipped.append(reason)


def _choose_model(clusters: list[Cluster]) -> ModelProfile | None:
    """The served model: the one most PD clusters serve (one model per deployment)."""
    counts: dict[int, tuple[int, ModelProfile]] = {}
    for c in clusters:
        n, _ = counts.get(c.model_id, (0, c.model))
        counts[c.model_id] = (n + (2 if c.kind == ClusterKind.PD else 1), c.model)
    if not counts:
        return None
    return max(counts.values(), key=lambda item: (item[0], -item[1].pk))[1]


def snapshot_build(redis_version: int | None = None) -> Snapshot:
    """Read inventory and the current policy from the database into a new snapshot.

    Parts the pure router cannot use are left out and listed in ``skipped`` (a cluster with
    no performance profile for its accelerator and model, a cluster serving another model, a
    link of 0 Gbps, which is down: requests then stay local). A row outside the physical
    bounds (scheduling.core.bounds; written past the API's checks) is left out the same way,
    and logged: routing keeps answering without it.
    """
    clusters = list(Cluster.objects.select_related("model", "accelerator", "site"))
    profiles = {(p.accelerator_id, p.model_id): p for p in PerformanceProfile.objects.all()}
    model = _choose_model(clusters)
    skipped: list[str] = []
    model_problem = None if model is None else _model_problem(model)
    if model is not None and model_problem is not None:
        _leave_out(skipped, f"model {model.name}: {model_problem}")
        model = None
    specs: list[routing.ClusterSpec] = []
    for c in clusters:
        if model is None or c.model_id != model.pk:
            skipped.append(f"cluster {c.name}: serves another model")
            continue
        prof = profiles.get((c.accelerator_id, c.model_id))
        if prof is None:
            skipped.append(f"cluster {c.name}: no performance profile")
            continue
        problem = _profile_problem(prof)
        if problem is not None:
            _leave_out(skipped, f"cluster {c.name}: performance profile {problem}")
            continue
        decode = None
        if prof.decode_max_batch is not None and prof.decode_step_seconds is not None:
            decode = routing.DecodeProfile(prof.decode_max_batch, prof.decode_step_seconds)
        specs.append(
            routing.ClusterSpec(
                name=c.name,
                kind=c.kind,
                prefill_seconds=tuple((float(x), float(y)) for x, y in prof.prefill_seconds),
                accelerator=c.accelerator.name,
                site=c.site.name,
                decode=decode,
                kv_connector=c.kv_connector,
            )
        )
    kept = {s.name for s in specs}
    all_instances = list(Instance.objects.select_related("cluster"))
    instances = tuple(
        routing.InstanceSpec(
            name=i.name, cluster=i.cluster.name, role=i.role, state=i.state, endpoint=i.endpoint
        )
        for i in all_instances
        if i.cluster.name in kept
    )
    links: list[routing.Link] = []
    all_links = list(Link.objects.select_related("source", "target"))
    for lk in all_links:
        if lk.source.name not in kept or lk.target.name not in kept:
            continue
        problem = _link_problem(lk)
        if problem is not None:
            _leave_out(skipped, f"link {lk.key}: {problem}")
            continue
        if lk.gbps <= 0:
            skipped.append(f"link {lk.key}: 0 Gbps (down)")
            continue
        links.append(
            routing.Link(
                source=lk.source.name,
                target=lk.target.name,
                gbps=lk.gbps,
                rtt_ms=lk.rtt_ms,
                kv_budget_bytes=lk.kv_budget_bytes,
                target_utilisation=lk.target_utilisation,
            )
        )
    if model is None:
        model_spec = routing.ModelSpec(name="", block_tokens=16, kv_cache_mib=((1.0, 0.0),))
    else:
        model_spec = _model_spec(model)
    topology = routing.Topology(
        model=model_spec, clusters=tuple(specs), instances=instances, links=tuple(links)
    )
    pd_clusters = tuple(s.name for s in specs if s.kind == ClusterKind.PD)
    current = Policy.objects.order_by("-version").first()
    if current is None:
        policy = routing.RoutingPolicy(
            version=0, thresholds={name: DEFAULT_THRESHOLD_TOKENS for name in pd_clusters}
        )
    else:
        policy = routing.RoutingPolicy(
            version=current.version,
            # A PD cluster the policy does not name yet (added since) gets the default, the
            # same value the rebalancer takes as its current setting.
            thresholds={
                name: int(current.thresholds.get(name, DEFAULT_THRESHOLD_TOKENS))
                for name in pd_clusters
            },
            guards=routing.route_guards_from_dict(current.guards),
        )
    data = routing.policy_snapshot_to_dict(routing.PolicySnapshot(policy=policy, topology=topology))
    body = orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    return Snapshot(
        policy=policy,
        topology=topology,
        redis_version=redis_version,
        built_at=time.monotonic(),
        body=body,
        etag='"' + hashlib.sha256(body).hexdigest()[:32] + '"',
        cluster_of={i.name: i.cluster for i in instances},
        instance_names=tuple(i.name for i in instances),
        link_pairs=tuple(lk.pair for lk in links),
        link_keys=tuple(lk.key for lk in links),
        pd_clusters=pd_clusters,
        hybrid=topology.linear_state_bytes > 0,
        block_tokens=model_spec.block_tokens,
        skipped=tuple(skipped),
        known_instances=frozenset(i.name for i in all_instances),
        known_cluster_of={i.name: i.cluster.name for i in all_instances},
        known_links=frozenset(lk.key for lk in all_links),
    )


# --- the process's snapshot ----------------------------------------------------------------

_lock = threading.Lock()
_current: Snapshot | None = None
_dirty = False
_last_failure = 0.0


def snapshot_cached() -> Snapshot | None:
    """The snapshot in memory, without any I/O (None before the first build)."""
    return _current


def snapshot_needs_refresh(snap: Snapshot | None, redis_version: int | None) -> bool:
    """Whether ``snap`` is out of date given the version counter just read from Redis."""
    if snap is None or _dirty:
        return True
    if redis_version is not None and redis_version != snap.redis_version:
        return True
    return snapshot_age_s(snap) > float(settings.SNAPSHOT_MAX_AGE_S)


def snapshot_age_s(snap: Snapshot) -> float:
    """Seconds since ``snap`` was read from the database."""
    return time.monotonic() - snap.built_at


def snapshot_stale(snap: Snapshot) -> bool:
    """Whether ``snap`` is older than its bound (its rebuilds failed: the database is away)."""
    return snapshot_age_s(snap) > float(settings.SNAPSHOT_MAX_AGE_S)


def snapshot_refresh(redis_version: int | None = None, *, force: bool = False) -> Snapshot:
    """Rebuild the process's snapshot (sync; database access).

    On a database error the previous snapshot is kept and returned, and no rebuild is tried
    again for ``DB_RETRY_S``; with no previous snapshot, :class:`SnapshotUnavailable`. A
    connection the database dropped is closed first, so a restored database is found again.
    """
    global _current, _dirty, _last_failure
    if redis_version is None:
        redis_version = _redis_version_or_none()
    with _lock:
        snap = _current
        if not force and snap is not None and not snapshot_needs_refresh(snap, redis_version):
            return snap
        retry_s = float(settings.DB_RETRY_S)
        if snap is not None and not force and time.monotonic() - _last_failure < retry_s:
            return snap
        try:
            _dirty = False
            snap = db_call(lambda: snapshot_build(redis_version))
        except Exception as exc:
            db_connection_reset()
            _last_failure = time.monotonic()
            if _current is None:
                raise SnapshotUnavailable(f"cannot build the routing snapshot: {exc}") from exc
            log.warning("snapshot rebuild failed, serving the last one: %s", exc)
            return _current
        _current = snap
        return snap


async def snapshot_refresh_async(redis_version: int | None = None) -> Snapshot:
    return await sync_to_async(snapshot_refresh, thread_sensitive=True)(redis_version)


async def snapshot_get_async() -> Snapshot:
    """The cached snapshot, building it first if this process has none."""
    snap = _current
    if snap is None:
        snap = await snapshot_refresh_async()
    return snap


async def snapshot_current_async(timeout_s: float = 0.2) -> Snapshot:
    """The snapshot, refreshed first if the version counter in Redis moved (one GET).

    For callers off the route path (policy, ingestion); Redis trouble is not an error here:
    the cached snapshot is served.
    """
    version: int | None = None
    try:
        raw = await asyncio.wait_for(redis_async().get(SNAPSHOT_VERSION_KEY), timeout_s)
        version = parse_version(raw)
    except (Exception, asyncio.TimeoutError):  # noqa: UP041 - distinct on 3.10, same on 3.11
        version = None
    snap = _current
    if snap is None or snapshot_needs_refresh(snap, version):
        snap = await snapshot_refresh_async(version)
    return snap


def snapshot_reset() -> None:
    """Forget the process's snapshot (tests; after a database reset)."""
    global _current, _dirty, _last_failure
    with _lock:
        _current = None
        _dirty = False
        _last_failure = 0.0


def _redis_version_or_none() -> int | None:
    try:
        raw = redis_sync().get(SNAPSHOT_VERSION_KEY)
    except Exception:
        return None
    return int(raw) if raw is not None else 0


def parse_version(raw: Any) -> int:
    return int(raw) if raw is not None else 0


def snapshot_version_bump() -> None:
    """Tell every process that inventory or policy changed (call after commit)."""
    global _dirty
    _dirty = True
    try:
        redis_sync().incr(SNAPSHOT_VERSION_KEY)
    except Exception as exc:  # the write committed; other processes catch up by age
        log.warning("could not bump %s: %s", SNAPSHOT_VERSION_KEY, exc)


def _on_inventory_change(sender: Any, **kwargs: Any) -> None:
    transaction.on_commit(snapshot_version_bump)


INVENTORY_MODELS: Iterable[type] = (
    Site,
    Accelerator,
    ModelProfile,
    PerformanceProfile,
    Cluster,
    Instance,
    Link,
)


def inventory_signals_connect() -> None:
    """Bump the snapshot version after any inventory write commits (from AppConfig.ready)."""
    for model in INVENTORY_MODELS:
        post_save.connect(_on_inventory_change, sender=model, dispatch_uid=f"snap-{model.__name__}")
        post_delete.connect(
            _on_inventory_change, sender=model, dispatch_uid=f"snap-del-{model.__name__}"
        )
