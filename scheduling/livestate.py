"""The fleet's live state in process, refreshed behind the request path, its age bounded.

Instance loads, link samples and in-flight bytes, the control state and the snapshot version
change every few hundred milliseconds (agents post telemetry every second or two), yet reading
and parsing them took most of a route call's Redis time. So each web process keeps the last
read (:class:`LiveRead`) and route calls decide with it while it is younger than
``LIVE_STATE_MAX_AGE_S``; once it is older than ``LIVE_STATE_REFRESH_S`` the first call that
sees it starts ONE background read (calls keep deciding meanwhile), so under traffic the state
is at most about the refresh period plus a Redis round trip old. A read older than the bound
is never used: the call reads itself (concurrent calls share that read), and when Redis does
not answer the call is decided as stale (:mod:`scheduling.decisions`), as before.

What must be exact is not taken from here: link reservations are admitted by Redis' atomic
script, so in-flight bytes a little old can only make a decision try a reservation Redis then
refuses (``link_congested``), never exceed a budget. Telemetry ingested by this process (and
the control tick after it) replaces the read at once; other processes see it within the bound.

The age is reported: ``live_age_s`` of :func:`live_state_age_s`, ``/metrics``
(``prfaas_route_live_state_age_seconds``) and ``GET /api/v1/route/live``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from clusters.live import telemetry
from clusters.live.ejections import ejections_parse, ejections_queue
from controlplane.redis_connection import redis_async
from controlplane.redis_scripts import pipeline_run_async
from scheduling.core import routing
from scheduling.snapshot import SNAPSHOT_VERSION_KEY, Snapshot, parse_version


@dataclass(frozen=True)
class LiveRead:
    """One read of the live state against one snapshot.

    ``live``: loads and control state as of ``read_at`` (wall clock, when the read was sent);
    ``version``: the ``snapshot:version`` counter then.
    """

    snapshot: Snapshot
    version: int
    read_at: float
    live: routing.LiveState

    def at(self, now: float) -> routing.LiveState:
        """The live state judged at ``now``: staleness of telemetry counts from the call."""
        return dataclasses.replace(self.live, now=now)


def refresh_s() -> float:
    return float(settings.LIVE_STATE_REFRESH_S)


def max_age_s() -> float:
    return float(settings.LIVE_STATE_MAX_AGE_S)


_current: LiveRead | None = None
# Bumped by every replacement and reset: a background read that began before one is dropped.
_generation = 0
_inflight: asyncio.Task[LiveRead] | None = None


def live_state_cached() -> LiveRead | None:
    """The read in memory, whatever its age (None before the first)."""
    return _current


def live_state_age_s(now: float | None = None) -> float | None:
    """Seconds since the read in memory was sent (None when there is none)."""
    cur = _current
    if cur is None:
        return None
    return max(0.0, (time.time() if now is None else now) - cur.read_at)


def live_state_reset() -> None:
    """Forget the read in memory (tests; a process whose Redis was replaced)."""
    global _current, _generation, _inflight
    _current = None
    _generation += 1
    _inflight = None


def live_state_install(read: LiveRead) -> None:
    """Replace the read in memory with a newer one (e.g. the control tick's, after ingest)."""
    global _current, _generation
    cur = _current
    if cur is None or read.read_at >= cur.read_at or cur.snapshot is not read.snapshot:
        _current = read
        _generation += 1


async def live_state_read_fresh(snap: Snapshot, now: float | None = None) -> LiveRead:
    """Read the live state from Redis now (one pipeline), control advanced to the read time.

    Raises what Redis raises; the caller bounds the wait.
    """
    now = time.time() if now is None else now

    def reads(pipe: Any) -> None:
        pipe.get(SNAPSHOT_VERSION_KEY)
        telemetry.control_states_queue(pipe)
        ejections_queue(pipe)
        telemetry.instance_states_queue(pipe, snap.instance_names)
        telemetry.link_states_queue(pipe, snap.link_keys, now)

    raw = await pipeline_run_async(redis_async(), reads)
    version = parse_version(raw[0])
    control_raw = telemetry.control_states_parse(raw[1])
    ejected = ejections_parse(raw[2], now)
    at = 3
    inst: dict[str, telemetry.InstanceSample] = {}
    if snap.instance_names:
        inst = telemetry.instance_states_parse(snap.instance_names, raw[at])
        at += 1
    links = telemetry.link_states_parse(snap.link_keys, raw[at:])
    live = _live(snap, inst, links, control_raw, now, ejected)
    return LiveRead(snapshot=snap, version=version, read_at=now, live=live)


def _live(
    snap: Snapshot,
    inst: dict[str, telemetry.InstanceSample],
    links: dict[str, telemetry.LinkState],
    control_raw: dict[str, dict[str, object]],
    now: float,
    ejected: frozenset[str] = frozenset(),
) -> routing.LiveState:
    newest: float | None = None
    loads: dict[str, routing.InstanceLoad] = {}
    for name, s in inst.items():
        loads[name] = routing.InstanceLoad(
            queue_depth=s.queue_depth,
            queued_prefill_tokens=s.queued_prefill_tokens,
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            updated_at=s.ts,
        )
        newest = s.ts if newest is None else max(newest, s.ts)
    # A router saw these fail or hang (its outlier detection): down until their ejection ends.
    for name in ejected:
        load = loads.get(name)
        loads[name] = dataclasses.replace(load or routing.InstanceLoad(), state="down")
    link_loads: dict[tuple[str, str], routing.LinkLoad] = {}
    for pair, key in zip(snap.link_pairs, snap.link_keys, strict=True):
        ls = links.get(key)
        if ls is None:
            continue
        link_loads[pair] = routing.LinkLoad(
            egress_gbps=ls.gbps, inflight_bytes=ls.reserved_bytes, updated_at=ls.ts or None
        )
        if ls.ts:
            newest = ls.ts if newest is None else max(newest, ls.ts)
    control: dict[str, routing.ControlState] = {}
    for cluster, fields in control_raw.items():
        try:
            control[cluster] = routing.ControlState(**fields)  # type: ignore[arg-type]
        except TypeError:
            continue
    live = routing.LiveState(
        now=now,
        instances=loads,
        links=link_loads,
        control=control,
        stale=newest is None,
        telemetry_at=newest,
    )
    if live.stale:
        return live
    # Advance each PD cluster's control state to the read (pure; the telemetry path persists it).
    guards = snap.policy.guards
    advanced = {
        pd: routing.control_update(
            control.get(pd) or routing.control_initial(),
            routing.control_signals(pd, snap.topology, live),
            guards,
            now,
        )
        for pd in snap.pd_clusters
    }
    return dataclasses.replace(live, control=advanced)


async def _refresh(snap: Snapshot) -> LiveRead:
    generation = _generation
    read = await live_state_read_fresh(snap)
    if generation == _generation:
        live_state_install(read)
    return read


def _task(snap: Snapshot) -> asyncio.Task[LiveRead]:
    """The read in flight on this event loop for ``snap``, started if there is none."""
    global _inflight
    task = _inflight
    loop = asyncio.get_running_loop()
    if task is None or task.done() or task.get_loop() is not loop:
        task = _inflight = loop.create_task(_refresh(snap))
        # A background read's failure is the next call's to meet (it reads itself): retrieve
        # the exception so asyncio does not log it as never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def live_state_get_async(snap: Snapshot, now: float) -> LiveRead:
    """A read against ``snap`` no older than the bound at ``now``.

    Young enough: returned at once (a background read starts when it is past the refresh
    period). Too old, missing, or of another snapshot: read now, sharing a read already in
    flight. Redis errors and timeouts propagate (the caller decides as stale).
    """
    cur = _current
    if cur is not None and cur.snapshot is snap:
        age = now - cur.read_at
        if -1.0 <= age <= max_age_s():
            if age >= refresh_s():
                _task(snap)
            return cur
    task = _task(snap)
    read = await asyncio.shield(task)
    if read.snapshot is not snap:
        # The read in flight was against the previous snapshot: read against this one.
        read = await asyncio.shield(_task(snap))
    return read
