"""Selectors and publishers of the overview's live data.

Reads compose the inventory (PostgreSQL) with the live stores in Redis through those stores'
own functions; nothing here writes to them. ``live_snapshot`` is what the websocket consumer
sends on connect and on resync; the pages render their first paint from the same functions.
The publishers turn what just happened into frames: ``telemetry_frames_publish`` right after a
telemetry batch is stored, ``overview_tick_publish`` periodically (decision mix, alerts, policy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from django.conf import settings

from clusters.live import telemetry
from clusters.models import Cluster, ClusterKind, Instance, InstanceState, Link
from controlplane import live
from controlplane.redis_connection import redis_sync
from scheduling import alerts as alerting
from scheduling.core.link import link_budget_bytes
from scheduling.core.routing import RouteGuards
from scheduling.policies import guards_from_json, policy_current
from scheduling.rebalance.selectors import (
    plan_predicted_refusal,
    plans_in_force,
    plans_snapshot,
)
from scheduling.traffic import TrafficWindow, traffic_window_read
from scheduling.whatif import whatif_snapshot

# The window of the time-series charts.
CHART_WINDOW_S = 15 * 60
# The window of the decision mix and offload rate.
MIX_WINDOW_S = 5 * 60


def link_label(link: Link) -> str:
    return f"{link.source.name} → {link.target.name}"


def guards_current() -> tuple[int | None, dict[str, Any], RouteGuards]:
    """The current policy's version, thresholds and guards (defaults before any policy)."""
    policy = policy_current()
    if policy is None:
        return None, {}, RouteGuards()
    return policy.version, dict(policy.thresholds), guards_from_json(policy.guards)


def links_overview(
    guards: RouteGuards, now: float | None = None, window_s: int = CHART_WINDOW_S
) -> list[dict[str, Any]]:
    """Every link with its capacity, congestion budget, in-flight KV against its in-flight
    budget, latest egress and 1 s history."""
    now = time.time() if now is None else now
    links = list(Link.objects.select_related("source", "target"))
    keys = {link.pk: link.key for link in links}
    states = telemetry.link_states_read(list(keys.values())) if links else {}
    out = []
    for link in links:
        key = keys[link.pk]
        state = states.get(key)
        series = telemetry.link_bandwidth_series(key, now - window_s, now)
        gbps = state.gbps if state else 0.0
        out.append(
            {
                "id": link.pk,
                "key": key,
                "label": link_label(link),
                "source": link.source.name,
                "target": link.target.name,
                "capacity_gbps": link.gbps,
                "budget_gbps": link.gbps * guards.scarce_utilisation,
                "rtt_ms": link.rtt_ms,
                "gbps": gbps,
                "utilisation": gbps / link.gbps if link.gbps > 0 else 0.0,
                "ts": state.ts if state and state.ts else None,
                "reserved_bytes": state.reserved_bytes if state else 0,
                "kv_budget_bytes": link_budget_bytes(link.gbps, link.kv_budget_bytes),
                "series": [[ts, value] for ts, value in series],
            }
        )
    return out


def service_now(current: alerting.Reading, past: list[alerting.Reading]) -> live.ServiceLevels:
    """The fleet tiles: per PD cluster request rate and TTFT quantiles against the SLO."""
    slo = float(settings.TTFT_SLO_S)
    return live.ServiceLevels(
        ts=current.ts,
        clusters=tuple(
            live.ClusterService(**asdict(level), slo_s=slo)
            for level in alerting.service_levels(current, past)
        ),
    )


def alerts_now(
    links: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    guards: RouteGuards,
    now: float,
    past: list[alerting.Reading] | None = None,
) -> tuple[list[live.Alert], alerting.Reading]:
    """The alerts active now (see :mod:`scheduling.alerts`) and the reading they were judged
    on; ``past``: the stored readings, read here when not given."""
    current = alerting.reading_take(links, clusters, now)
    past = alerting.readings_read() if past is None else past
    return alerting.alerts_evaluate(links, clusters, guards, current, past, now), current


def clusters_overview() -> list[dict[str, Any]]:
    """Every cluster with its instances (role, state, live load) and summed queue."""
    clusters = list(Cluster.objects.select_related("site", "accelerator").order_by("name"))
    instances = list(Instance.objects.order_by("name"))
    samples = telemetry.instance_states_read([i.name for i in instances]) if instances else {}
    out = []
    for cluster in clusters:
        mine = [i for i in instances if i.cluster_id == cluster.pk]
        rows = []
        for inst in mine:
            s = samples.get(inst.name)
            rows.append(
                {
                    "id": inst.pk,
                    "name": inst.name,
                    "role": inst.role,
                    "state": inst.state,
                    "origin": inst.origin,
                    "engine": f"{inst.engine} {inst.engine_version}".strip(),
                    "queued": s.queue_depth if s else None,
                    "running": s.running if s else None,
                    "kv_usage": s.kv_usage if s else None,
                    "ts": s.ts if s else None,
                }
            )
        loads = [samples[i.name] for i in mine if i.name in samples]
        out.append(
            {
                "id": cluster.pk,
                "name": cluster.name,
                "kind": cluster.kind,
                "site": cluster.site.name,
                "accelerator": cluster.accelerator.name,
                "prefill": sum(1 for i in mine if i.role == "prefill"),
                "decode": sum(1 for i in mine if i.role == "decode"),
                "active": sum(1 for i in mine if i.state == InstanceState.ACTIVE),
                "queued": sum(s.queue_depth for s in loads),
                "running": sum(s.running for s in loads),
                "last_sample_ts": max((s.ts for s in loads), default=None),
                "instances": rows,
            }
        )
    return out


def pd_windows(now: float, window_s: int = MIX_WINDOW_S) -> dict[str, TrafficWindow]:
    """Every PD cluster's traffic over the last ``window_s`` (from the start of the minute
    holding ``now - window_s``: the store counts whole minutes)."""
    pd = Cluster.objects.filter(kind=ClusterKind.PD).order_by("name")
    return {c.name: traffic_window_read(c.name, now - window_s, now) for c in pd}


# The windows of a link page's guard table: (label, seconds back from now).
LINK_GUARD_WINDOWS = (("last 5 minutes", 300), ("last hour", 3600), ("last 24 hours", 86400))


def _guard_counts(window: TrafficWindow, key: str, now: float) -> dict[str, Any]:
    refused = window.link_refusals.get(key, {})
    offloads = window.link_offloads.get(key, 0)
    budget, saturation = refused.get("budget", 0), refused.get("saturation", 0)
    offered = offloads + budget + saturation
    return {
        "window_s": max(0.0, now - window.start),
        "offloads": offloads,
        "refused_budget": budget,
        "refused_saturation": saturation,
        "refused_share": (budget + saturation) / offered if offered else None,
    }


def link_guards(
    links: Sequence[dict[str, Any]], windows: dict[str, TrafficWindow], now: float
) -> dict[str, dict[str, Any]]:
    """Per link (live key): over its PD cluster's window, the offloads it carried and those
    its guard kept local by cause, their share of the offloads offered to it, and what the
    plan in force predicted for that share (see ``plan_predicted_refusal``)."""
    plans = plans_in_force()
    out = {}
    for link in links:
        window = windows.get(link["target"])
        if window is None:
            continue
        out[link["key"]] = {
            **_guard_counts(window, link["key"], now),
            "predicted_refused_share": plan_predicted_refusal(plans.get(link["target"])),
        }
    return out


def decision_mix(
    thresholds: dict[str, Any],
    now: float | None = None,
    window_s: int = MIX_WINDOW_S,
    windows: dict[str, TrafficWindow] | None = None,
) -> list[live.DecisionMix]:
    """Per pd cluster: arrivals, offloads and reason counts over the last ``window_s`` (the
    message states the window the counts really cover: whole minutes)."""
    now = time.time() if now is None else now
    windows = pd_windows(now, window_s) if windows is None else windows
    pipe = redis_sync().pipeline(transaction=False)
    telemetry.control_states_queue(pipe)
    controls = telemetry.control_states_parse(pipe.execute()[0])
    out = []
    for name, window in windows.items():
        t = thresholds.get(name)
        factor = float(controls.get(name, {}).get("threshold_factor", 1.0) or 1.0)
        out.append(
            live.DecisionMix(
                cluster=name,
                ts=now,
                # What the counts cover: from the start of the store's first whole minute.
                window_s=round(max(0.0, now - window.start)),
                arrivals=window.arrivals,
                offloads=window.offloads,
                reasons=dict(window.reasons),
                threshold=float(t) if t is not None else None,
                effective_threshold=float(t) * factor if t is not None else None,
            )
        )
    return out


def overview_snapshot() -> dict[str, Any]:
    """Everything the overview shows: topology, links, queues, mix, policy, alerts."""
    now = time.time()
    version, thresholds, guards = guards_current()
    links = links_overview(guards, now)
    clusters = clusters_overview()
    readings = alerting.readings_read()
    active, current = alerts_now(links, clusters, guards, now, readings)
    windows = pd_windows(now)
    guard = link_guards(links, windows, now)
    for link in links:
        link["inflight"] = alerting.inflight_history(readings, link["key"])
        link["guard"] = guard.get(link["key"])
    return {
        "ts": now,
        "window_s": CHART_WINDOW_S,
        "mix_window_s": MIX_WINDOW_S,
        "policy": {"version": version, "thresholds": thresholds, "guards": asdict(guards)},
        "links": links,
        "clusters": clusters,
        "decision_mix": [
            live.message_data(m) for m in decision_mix(thresholds, now, windows=windows)
        ],
        "alerts": [asdict(a) for a in active],
        "service": asdict(service_now(current, readings)),
    }


def alerts_snapshot() -> dict[str, Any]:
    """What the banner of every page needs: the alerts active now."""
    now = time.time()
    _, _, guards = guards_current()
    active, _ = alerts_now(
        links_overview(guards, now, window_s=0), clusters_overview(), guards, now
    )
    return {"ts": now, "alerts": [asdict(a) for a in active]}


def live_snapshot(group: str, user: Any = None) -> dict[str, Any]:
    """The full state a client of ``group`` needs (sync: reads the database)."""
    if group == live.OVERVIEW:
        return overview_snapshot()
    if group == live.ALERTS:
        return alerts_snapshot()
    if group == live.PLANS:
        return plans_snapshot()
    if group.startswith(live.WHATIF_PREFIX):
        return whatif_snapshot(int(group.removeprefix(live.WHATIF_PREFIX)))
    return {}


# ---------------------------------------------------------------------------------------------
# Publishers


def telemetry_frames(
    instances: Sequence[telemetry.InstanceSample], links: Sequence[telemetry.LinkSample]
) -> list[live.LiveMessage]:
    """The overview frames a stored telemetry batch makes: one for its links, one for queues."""
    frames: list[live.LiveMessage] = []
    if links:
        frames.append(
            live.LinkSamples(
                samples=tuple(live.LinkEgress(link=s.link, ts=s.ts, gbps=s.gbps) for s in links)
            )
        )
    if instances:
        frames.append(
            live.QueueDepths(
                ts=max(s.ts for s in instances),
                instances=tuple(
                    live.InstanceQueue(instance=s.instance, queued=s.queue_depth, running=s.running)
                    for s in instances
                ),
            )
        )
    return frames


def telemetry_frames_publish(
    instances: Sequence[telemetry.InstanceSample], links: Sequence[telemetry.LinkSample]
) -> None:
    """Call after a telemetry batch is stored (sync callers; after commit)."""
    for message in telemetry_frames(instances, links):
        live.live_publish(live.OVERVIEW, message)


async def telemetry_frames_apublish(
    instances: Sequence[telemetry.InstanceSample], links: Sequence[telemetry.LinkSample]
) -> None:
    """Async twin of :func:`telemetry_frames_publish` (no database, no transaction)."""
    for message in telemetry_frames(instances, links):
        try:
            await live.live_apublish(live.OVERVIEW, message)
        except Exception:  # a screen missing a point must never fail the ingest
            live.logger.warning("live publish of telemetry failed", exc_info=True)


def _guard_fields(guard: dict[str, Any] | None) -> dict[str, Any]:
    if guard is None:
        return {}
    return {
        "guard_window_s": guard["window_s"],
        "offloads": guard["offloads"],
        "refused_budget": guard["refused_budget"],
        "refused_saturation": guard["refused_saturation"],
        "predicted_refused_share": guard["predicted_refused_share"],
    }


def overview_tick_publish() -> int:
    """Publish the slow-moving overview state: decision mix, alerts, link budgets and policy;
    store the tick's alert reading and update the alert history. Returns the overview's
    frames (the alert set goes to the banner's group too)."""
    now = time.time()
    version, thresholds, guards = guards_current()
    windows = pd_windows(now)
    messages: list[live.LiveMessage] = list(decision_mix(thresholds, now, windows=windows))
    links = links_overview(guards, now, window_s=0)
    guard = link_guards(links, windows, now)
    past = alerting.readings_read()
    active, reading = alerts_now(links, clusters_overview(), guards, now, past)
    alerting.readings_store(reading)
    messages.append(service_now(reading, past))
    alerting.alert_episodes_update(active, now)
    alert_set = live.AlertSet(ts=now, alerts=tuple(active))
    messages.append(alert_set)
    messages.append(
        live.LinkBudgets(
            ts=now,
            links=tuple(
                live.LinkBudget(
                    link=link["key"],
                    inflight_bytes=float(link["reserved_bytes"]),
                    budget_bytes=float(link["kv_budget_bytes"]),
                    capacity_gbps=float(link["capacity_gbps"]),
                    egress_budget_gbps=float(link["budget_gbps"]),
                    **_guard_fields(guard.get(link["key"])),
                )
                for link in links
            ),
        )
    )
    if version is not None:
        messages.append(live.PolicyEvent(version=version, ts=now, thresholds=thresholds))
    for message in messages:
        live.live_publish(live.OVERVIEW, message)
    live.live_publish(live.ALERTS, alert_set)
    return len(messages)


# ---------------------------------------------------------------------------------------------
# One link's page


def congestion_events(
    series: Sequence[tuple[int, float]], budget_gbps: float
) -> list[dict[str, float]]:
    """Spans of consecutive seconds at or above the budget: start, end (inclusive), peak Gbps."""
    events: list[dict[str, float]] = []
    for second, gbps in series:
        if budget_gbps <= 0 or gbps < budget_gbps:
            continue
        if events and second - events[-1]["end"] <= 1:
            events[-1]["end"] = second
            events[-1]["peak_gbps"] = max(events[-1]["peak_gbps"], gbps)
        else:
            events.append({"start": second, "end": second, "peak_gbps": gbps})
    for e in events:
        e["duration_s"] = e["end"] - e["start"] + 1
    return events


def link_history(
    link: Link, window_s: int = telemetry.BANDWIDTH_RETENTION_S - 60
) -> dict[str, Any]:
    """A link's bandwidth history (as long as the store keeps it), budget and congestion, and
    the offloads its guard kept local over a few windows, next to the plan in force's
    prediction of that share."""
    now = time.time()
    _, _, guards = guards_current()
    key = link.key
    series = telemetry.link_bandwidth_series(key, now - window_s, now)
    budget = link.gbps * guards.scarce_utilisation
    state = telemetry.link_states_read([key]).get(key)
    plan = plans_in_force().get(link.target.name)
    return {
        "guard": [
            {
                "label": label,
                **_guard_counts(traffic_window_read(link.target.name, now - w, now), key, now),
            }
            for label, w in LINK_GUARD_WINDOWS
        ],
        "target": link.target.name,
        "plan_id": plan.pk if plan is not None else None,
        "predicted_refused_share": plan_predicted_refusal(plan),
        "id": link.pk,
        "key": key,
        "label": link_label(link),
        "capacity_gbps": link.gbps,
        "budget_gbps": budget,
        "rtt_ms": link.rtt_ms,
        "kv_budget_bytes": link.kv_budget_bytes,
        "gbps": state.gbps if state else 0.0,
        "reserved_bytes": state.reserved_bytes if state else 0,
        "window_s": window_s,
        "series": [[s, v] for s, v in series],
        "congestion": congestion_events(series, budget),
    }
