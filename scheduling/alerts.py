"""Alerts: the conditions that govern routing, judged every overview tick, and their history.

Each alert is about something the router itself acts on, so that what operators see is what
is keeping KV off a link or requests in a queue:

``link_budget_exhausted``  the KV bytes in flight on a link are at or above
                           ``ALERT_INFLIGHT_SHARE`` of its in-flight budget (the router refuses
                           an offload whose bytes do not fit);
``offloads_refused``       over the last ``ALERT_WINDOW_S``, requests the link had no room for
                           (``link_congested`` although above the effective threshold: the
                           offload was decided, its reservation refused) are at least
                           ``ALERT_REFUSED_SHARE`` of the logged decisions of the link's PD
                           cluster. A threshold still raised by congestion control after the
                           fault (it decays with hysteresis) is not the link refusing: the
                           decision mix shows it as ``t a → b``;
``link_congested``         egress at or above the scarce-utilisation guard;
``pd_queue_growing``       a PD cluster's summed queue grew by at least ``ALERT_QUEUE_GROWTH``
                           requests (and doubled) over ``ALERT_WINDOW_S``;
``instance_down``          an instance the inventory says is down;
``instance_silent``        an active instance of a reporting cluster with no sample for longer
                           than the policy's ``stale_after_s``;
``telemetry_stale``        a cluster with active instances and no recent sample at all;
``prefix_index_degraded``  KV-event streams with a sequence gap.

The queue signal needs the past: every tick appends one reading (per PD cluster the summed
queue; per link the in-flight bytes and the budget in force) to a capped Redis list; refused
offloads are counted in the decision log (:mod:`scheduling.decision_log`). Reads never write it, so a
page's first paint judges exactly as the last tick did. The link charts draw their in-flight
history from the same readings (a reload keeps it).

Key layout:

``alerts:readings``  LIST  JSON readings, newest first, at most ``READINGS_KEPT`` (one per
                           tick: 15 minutes at the 2 s beat).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import transaction

from clusters.live import prefix_index, telemetry
from clusters.models import InstanceState
from controlplane import live
from controlplane.redis_connection import redis_sync
from scheduling.core.routing import Reason, RouteGuards
from scheduling.core.service_levels import ServiceCounters, ServiceLevel, service_level
from scheduling.models import AlertEpisode, DecisionRecord

READINGS_KEY = "alerts:readings"
READINGS_KEPT = 450
ALERT_WINDOW_S = 20.0
ALERT_INFLIGHT_SHARE = 0.9
ALERT_REFUSED_SHARE = 0.05
ALERT_REFUSED_MIN = 3
ALERT_QUEUE_GROWTH = 20
# The window of the fleet tiles (request rate, TTFT quantiles per PD cluster).
SERVICE_WINDOW_S = 60.0


@dataclass(frozen=True)
class Reading:
    """What one tick saw of the windowed signals."""

    ts: float
    # pd cluster -> requests queued on its instances
    queues: Mapping[str, int]
    # link key -> [in-flight bytes, in-flight budget bytes, capacity Gbps]
    links: Mapping[str, Sequence[float]]
    # pd cluster -> its latest reported service counters [ts, arrivals, first tokens, buckets]
    service: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {"ts": self.ts, "queues": self.queues, "links": self.links, "service": self.service}
        )

    @staticmethod
    def from_json(raw: bytes | str) -> Reading:
        d = json.loads(raw)
        return Reading(
            ts=d["ts"], queues=d["queues"], links=d["links"], service=d.get("service", {})
        )


def reading_take(
    links: Sequence[dict[str, Any]], clusters: Sequence[dict[str, Any]], now: float
) -> Reading:
    """What this tick sees of the windowed signals."""
    return Reading(
        ts=now,
        service=telemetry.service_counters_read(),
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


def refused_offloads(origin: str, since: float) -> tuple[int, int]:
    """Logged decisions of ``origin`` since ``since``, and those whose offload the link refused
    (``link_congested`` with the incremental length above the effective threshold)."""
    rows = DecisionRecord.objects.filter(origin=origin, ts__gte=since).values_list(
        "reason", "entry__decision__incremental_tokens", "entry__decision__threshold"
    )
    total = refused = 0
    for reason, incremental, threshold in rows:
        total += 1
        above = isinstance(incremental, int | float) and isinstance(threshold, int | float)
        refused += reason == Reason.LINK_CONGESTED and above and incremental > threshold
    return total, refused


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
        decided, refused = refused_offloads(link["target"], now - ALERT_WINDOW_S)
        if refused >= ALERT_REFUSED_MIN and refused / decided >= ALERT_REFUSED_SHARE:
            alerts.append(
                _alert(
                    "offloads_refused",
                    label,
                    f"{label}: offloads refused, the link had no room for {refused} of "
                    f"{decided} logged requests at {link['target']} in the last "
                    f"{ALERT_WINDOW_S:.0f} s ({refused / decided:.0%}); they ran locally",
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


def service_levels(
    current: Reading, past: Sequence[Reading], window_s: float = SERVICE_WINDOW_S
) -> list[ServiceLevel]:
    """Per PD cluster, what it served over about the last ``window_s``: between its latest
    reported counters and the oldest ones the readings hold within the window (the window's
    ends are the reports' own times, so it is exactly what the reporter counted)."""
    out = []
    for cluster, raw in sorted(current.service.items()):
        now_c = _counters(cluster, raw)
        earlier = [_counters(cluster, r.service[cluster]) for r in past if cluster in r.service]
        inside = [c for c in earlier if now_c.ts - window_s <= c.ts < now_c.ts]
        if not inside:
            continue
        level = service_level(
            min(inside, key=lambda c: c.ts), now_c, float(settings.FLEET_CLOCK_SPEED)
        )
        if level is not None:
            out.append(level)
    return out


def _counters(cluster: str, raw: Sequence[Any]) -> ServiceCounters:
    return ServiceCounters(cluster, float(raw[0]), int(raw[1]), int(raw[2]), tuple(raw[3]))


def inflight_history(readings: Sequence[Reading], link: str) -> list[list[float]]:
    """``[ts, in-flight bytes, budget bytes, capacity Gbps]`` of one link, oldest first."""
    return [[r.ts, *r.links[link]] for r in reversed(readings) if link in r.links]


def service_between(cluster: str, start: float, end: float) -> ServiceLevel | None:
    """What ``cluster`` served between its first report at or after ``start`` and its last
    one at or before ``end``, as the stored readings hold them (they reach back
    ``READINGS_KEPT`` ticks; None without two reports in the span)."""
    reports = [
        _counters(cluster, r.service[cluster]) for r in readings_read() if cluster in r.service
    ]
    held = [c for c in reports if start <= c.ts <= end]
    if len(held) < 2:
        return None
    first = min(held, key=lambda c: c.ts)
    last = max(held, key=lambda c: c.ts)
    return service_level(first, last, float(settings.FLEET_CLOCK_SPEED))
