"""Alerts: the conditions that govern routing, judged every overview tick, and their history.

Each alert is about something the router itself acts on, so that what operators see is what
is keeping KV off a link or requests in a queue:

``link_budget_exhausted``  the KV bytes in flight on a link are at or above
                           ``ALERT_INFLIGHT_SHARE`` of its in-flight budget (the router refuses
                           an offload whose bytes do not fit);
``offloads_refused``       over the last ``ALERT_WINDOW_S``, ``link_congested`` decisions are at
                           least ``ALERT_REFUSED_SHARE`` of the arrivals at a link's PD cluster;
``link_congested``         egress at or above the scarce-utilisation guard;
``pd_queue_growing``       a PD cluster's summed queue grew by at least ``ALERT_QUEUE_GROWTH``
                           requests (and doubled) over ``ALERT_WINDOW_S``;
``instance_down``          an instance the inventory says is down;
``instance_silent``        an active instance of a reporting cluster with no sample for longer
                           than the policy's ``stale_after_s``;
``telemetry_stale``        a cluster with active instances and no recent sample at all;
``prefix_index_degraded``  KV-event streams with a sequence gap.

The windowed signals need the past: every tick appends one reading (per PD cluster the
traffic counters of the current and the previous minute and the summed queue; per link the
in-flight bytes and the budget in force) to a capped Redis list. Reads never write it, so a
page's first paint judges exactly as the last tick did. The link charts draw their in-flight
history from the same readings (a reload keeps it).

Key layout:

``alerts:readings``  LIST  JSON readings, newest first, at most ``READINGS_KEPT`` (one per
                           tick: 15 minutes at the 2 s beat).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from clusters.live import prefix_index
from clusters.models import InstanceState
from controlplane import live
from controlplane.redis_connection import redis_sync
from scheduling.core.routing import Reason, RouteGuards
from scheduling.models import AlertEpisode
from scheduling.traffic import traffic_key

READINGS_KEY = "alerts:readings"
READINGS_KEPT = 450
ALERT_WINDOW_S = 20.0
ALERT_INFLIGHT_SHARE = 0.9
ALERT_REFUSED_SHARE = 0.05
ALERT_REFUSED_MIN = 3
ALERT_QUEUE_GROWTH = 20


@dataclass(frozen=True)
class Reading:
    """What one tick saw of the windowed signals."""

    ts: float
    # pd cluster -> minute -> [arrivals, link_congested decisions] (counters so far)
    traffic: Mapping[str, Mapping[str, Sequence[int]]]
    # pd cluster -> requests queued on its instances
    queues: Mapping[str, int]
    # link key -> [in-flight bytes, in-flight budget bytes, capacity Gbps]
    links: Mapping[str, Sequence[float]]

    def to_json(self) -> str:
        return json.dumps(
            {"ts": self.ts, "traffic": self.traffic, "queues": self.queues, "links": self.links}
        )

    @staticmethod
    def from_json(raw: bytes | str) -> Reading:
        d = json.loads(raw)
        return Reading(ts=d["ts"], traffic=d["traffic"], queues=d["queues"], links=d["links"])


def reading_take(
    links: Sequence[dict[str, Any]], clusters: Sequence[dict[str, Any]], now: float
) -> Reading:
    """Read the counters a reading needs (one pipelined round trip)."""
    pd = [c["name"] for c in clusters if c["kind"] == "pd"]
    minutes = [int(now // 60) - 1, int(now // 60)]
    pipe = redis_sync().pipeline(transaction=False)
    for name in pd:
        for m in minutes:
            pipe.hmget(traffic_key(name, m), ["arrivals", f"r:{Reason.LINK_CONGESTED}"])
    raw = iter(pipe.execute())
    traffic = {name: {str(m): [int(v or 0) for v in next(raw)] for m in minutes} for name in pd}
    return Reading(
        ts=now,
        traffic=traffic,
        queues={c["name"]: int(c["queued"]) for c in clusters if c["kind"] == "pd"},
        links={
            link["key"]: [
                float(link["reserved_bytes"]),
                float(link["kv_budget_bytes"]),
                float(link["capacity_gbps"]),
            ]
            for link in links
        },
    )


def readings_store(reading: Reading) -> None:
    pipe = redis_sync().pipeline(transaction=False)
    pipe.lpush(READINGS_KEY, reading.to_json())
    pipe.ltrim(READINGS_KEY, 0, READINGS_KEPT - 1)
    pipe.execute()


def readings_read(limit: int = READINGS_KEPT) -> list[Reading]:
    """Stored readings, newest first."""
    raw: Sequence[bytes] = redis_sync().lrange(READINGS_KEY, 0, limit - 1)  # type: ignore[assignment]
    return [Reading.from_json(r) for r in raw]


def _window_start(readings: Sequence[Reading], now: float) -> Reading | None:
    """The oldest reading still inside the window (None: no past to compare with)."""
    inside = [r for r in readings if now - ALERT_WINDOW_S <= r.ts < now - 1.0]
    return min(inside, key=lambda r: r.ts) if inside else None


def _traffic_delta(now_r: Reading, then: Reading, cluster: str) -> tuple[int, int]:
    """Arrivals and link_congested decisions between two readings (minute keys: a minute
    absent from the earlier reading had not started, one absent from the later had ended)."""
    arrivals = refused = 0
    earlier = then.traffic.get(cluster, {})
    for minute, (a, r) in now_r.traffic.get(cluster, {}).items():
        a0, r0 = earlier.get(minute, (0, 0))
        arrivals += max(0, a - a0)
        refused += max(0, r - r0)
    return arrivals, refused


def _alert(code: str, subject: str, message: str, now: float) -> live.Alert:
    return live.Alert(code=code, subject=subject, message=message, ts=now)  # type: ignore[arg-type]


def alerts_evaluate(
    links: Sequence[dict[str, Any]],
    clusters: Sequence[dict[str, Any]],
    guards: RouteGuards,
    current: Reading,
    past: Sequence[Reading],
    now: float,
) -> list[live.Alert]:
    """Every alert active now, from the current state and the readings before it."""
    alerts: list[live.Alert] = []
    stale_s = guards.stale_after_s
    then = _window_start(past, now)
    for link in links:
        label, budget = link["label"], float(link["kv_budget_bytes"])
        inflight = float(link["reserved_bytes"])
        if budget > 0 and inflight >= ALERT_INFLIGHT_SHARE * budget:
            alerts.append(
                _alert(
                    "link_budget_exhausted",
                    label,
                    f"{label}: in-flight KV budget exhausted ({inflight / 1e9:.2f} of "
                    f"{budget / 1e9:.2f} GB in flight at {link['capacity_gbps']:g} Gbps); "
                    "offloads that do not fit are refused",
                    now,
                )
            )
        if then is not None:
            arrivals, refused = _traffic_delta(current, then, link["target"])
            if (
                refused >= ALERT_REFUSED_MIN
                and arrivals
                and refused / arrivals >= ALERT_REFUSED_SHARE
            ):
                alerts.append(
                    _alert(
                        "offloads_refused",
                        label,
                        f"{label}: offloads refused, {refused} of {arrivals} requests at "
                        f"{link['target']} kept local as link_congested in the last "
                        f"{now - then.ts:.0f} s ({refused / arrivals:.0%})",
                        now,
                    )
                )
        if link["capacity_gbps"] > 0 and link["utilisation"] >= guards.scarce_utilisation:
            alerts.append(
                _alert(
                    "link_congested",
                    label,
                    f"{label} carries {link['gbps']:.1f} of {link['capacity_gbps']:g} Gbps "
                    f"(congested at {guards.scarce_utilisation:.0%})",
                    now,
                )
            )
    for c in clusters:
        last = c["last_sample_ts"]
        if c["active"] and (last is None or now - last > stale_s):
            age = "ever" if last is None else f"{now - last:.0f} s"
            alerts.append(
                _alert(
                    "telemetry_stale",
                    c["name"],
                    f"no telemetry from {c['name']} for {age} (stale after {stale_s:g} s)",
                    now,
                )
            )
        elif last is not None:
            for i in c["instances"]:
                silent = i["ts"] is None or now - i["ts"] > stale_s
                if i["state"] == InstanceState.ACTIVE and silent:
                    age = "ever" if i["ts"] is None else f"{now - i['ts']:.0f} s"
                    alerts.append(
                        _alert(
                            "instance_silent",
                            i["name"],
                            f"{i['name']} ({c['name']}) is active but has sent no telemetry "
                            f"for {age}",
                            now,
                        )
                    )
        for i in c["instances"]:
            if i["state"] == InstanceState.DOWN:
                alerts.append(
                    _alert("instance_down", i["name"], f"{i['name']} ({c['name']}) is down", now)
                )
        if c["kind"] == "pd" and then is not None:
            before, queued = int(then.queues.get(c["name"], 0)), int(c["queued"])
            if queued - before >= ALERT_QUEUE_GROWTH and queued >= 2 * before:
                alerts.append(
                    _alert(
                        "pd_queue_growing",
                        c["name"],
                        f"local queue of {c['name']} grew {before} → {queued} requests in "
                        f"{now - then.ts:.0f} s",
                        now,
                    )
                )
    degraded = [s.instance for s in prefix_index.prefix_index_states() if s.state == "degraded"]
    if degraded:
        alerts.append(
            _alert(
                "prefix_index_degraded",
                ", ".join(degraded[:5]),
                f"prefix index degraded for {len(degraded)} instance(s): "
                + ", ".join(degraded[:5])
                + ("…" if len(degraded) > 5 else ""),
                now,
            )
        )
    return alerts


def alert_episodes_update(alerts: Sequence[live.Alert], now: float) -> None:
    """Open an episode for every alert newly active, close those no longer active."""
    at = datetime.fromtimestamp(now, tz=UTC)
    active = {(a.code, a.subject): a for a in alerts}
    with transaction.atomic():
        open_ = {
            (e.code, e.subject): e
            for e in AlertEpisode.objects.select_for_update().filter(cleared_at__isnull=True)
        }
        gone = [e.pk for key, e in open_.items() if key not in active]
        if gone:
            AlertEpisode.objects.filter(pk__in=gone).update(cleared_at=at)
        AlertEpisode.objects.bulk_create(
            [
                AlertEpisode(code=a.code, subject=a.subject, message=a.message, raised_at=at)
                for key, a in active.items()
                if key not in open_
            ],
            ignore_conflicts=True,
        )


def alert_history(limit: int = 200) -> list[AlertEpisode]:
    """The latest alert episodes, open ones included, newest first."""
    return list(AlertEpisode.objects.all()[:limit])


def inflight_history(readings: Sequence[Reading], link: str) -> list[list[float]]:
    """``[ts, in-flight bytes, budget bytes, capacity Gbps]`` of one link, oldest first."""
    return [[r.ts, *r.links[link]] for r in reversed(readings) if link in r.links]
