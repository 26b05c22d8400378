"""Selectors of the operator pages' live data: what a snapshot of each live group contains.

They compose the inventory (PostgreSQL) with the live state in Redis, through those stores'
own selectors; nothing here writes. ``live_snapshot`` is what the websocket consumer sends on
connect and on resync; the pages render their first paint from the same functions.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from django.conf import settings

from clusters.live import telemetry
from clusters.models import Cluster, Instance, Link
from controlplane import live

# The window of the time-series charts.
CHART_WINDOW_S = 15 * 60
# Share of capacity above which a link is shown as congested when the policy says nothing.
LINK_CONGESTED_UTILISATION = 0.9


def link_label(link: Link) -> str:
    return f"{link.source.name} → {link.target.name}"


def link_live_key(link: Link) -> str:
    """The id of a link in the live stores: ``source>target`` (cluster names)."""
    return f"{link.source.name}>{link.target.name}"


def links_overview(
    now: float | None = None, window_s: int = CHART_WINDOW_S
) -> list[dict[str, Any]]:
    """Every link with its capacity, latest egress and 1 s bandwidth history."""
    now = time.time() if now is None else now
    links = list(Link.objects.select_related("source", "target"))
    keys = {link.pk: link_live_key(link) for link in links}
    states = telemetry.link_states_read(list(keys.values())) if links else {}
    out = []
    for link in links:
        state = states.get(keys[link.pk])
        series = telemetry.link_bandwidth_series(keys[link.pk], now - window_s, now)
        gbps = state.gbps if state else 0.0
        budget = link.gbps * LINK_CONGESTED_UTILISATION
        out.append(
            {
                "id": link.pk,
                "label": link_label(link),
                "source": link.source.name,
                "target": link.target.name,
                "capacity_gbps": link.gbps,
                "budget_gbps": budget,
                "rtt_ms": link.rtt_ms,
                "gbps": gbps,
                "utilisation": gbps / link.gbps if link.gbps > 0 else 0.0,
                "ts": state.ts if state else None,
                "reserved_bytes": state.reserved_bytes if state else 0,
                "series": [[ts, value] for ts, value in series],
            }
        )
    return out


def clusters_overview() -> list[dict[str, Any]]:
    """Every cluster with its instances by role and state and its summed live queue."""
    clusters = list(Cluster.objects.select_related("site", "accelerator"))
    instances = list(Instance.objects.all())
    samples = telemetry.instance_states_read([i.name for i in instances]) if instances else {}
    out = []
    for cluster in clusters:
        mine = [i for i in instances if i.cluster_id == cluster.pk]
        loads = [samples[i.name] for i in mine if i.name in samples]
        out.append(
            {
                "id": cluster.pk,
                "name": cluster.name,
                "kind": cluster.kind,
                "site": cluster.site.name,
                "accelerator": cluster.accelerator.name,
                "instances": len(mine),
                "prefill": sum(1 for i in mine if i.role == "prefill"),
                "decode": sum(1 for i in mine if i.role == "decode"),
                "active": sum(1 for i in mine if i.state == "active"),
                "queued": sum(s.queue_depth for s in loads),
                "running": sum(s.running for s in loads),
                "last_sample_ts": max((s.ts for s in loads), default=None),
            }
        )
    return out


def alerts_current(
    links: list[dict[str, Any]], clusters: list[dict[str, Any]], now: float | None = None
) -> list[dict[str, Any]]:
    """Conditions operators should see now: stale telemetry and congested links."""
    now = time.time() if now is None else now
    stale_s = settings.TELEMETRY_STALE_S
    alerts: list[live.Alert] = []
    for c in clusters:
        if c["active"] and (c["last_sample_ts"] is None or now - c["last_sample_ts"] > stale_s):
            alerts.append(
                live.Alert(
                    code="telemetry_stale",
                    subject=c["name"],
                    message=f"no telemetry from {c['name']} for more than {stale_s} s",
                    ts=now,
                )
            )
    for link in links:
        if link["capacity_gbps"] > 0 and link["gbps"] > link["budget_gbps"]:
            alerts.append(
                live.Alert(
                    code="link_congested",
                    subject=link["label"],
                    message=f"{link['label']} carries {link['gbps']:.1f} of {link['capacity_gbps']:.0f} Gbps",
                    ts=now,
                )
            )
    return [asdict(a) for a in alerts]


def overview_snapshot() -> dict[str, Any]:
    now = time.time()
    links = links_overview(now)
    clusters = clusters_overview()
    return {
        "ts": now,
        "window_s": CHART_WINDOW_S,
        "links": links,
        "clusters": clusters,
        "alerts": alerts_current(links, clusters, now),
    }


def live_snapshot(group: str, user: Any = None) -> dict[str, Any]:
    """The full state a client of ``group`` needs (sync: reads the database)."""
    if group == live.OVERVIEW:
        return overview_snapshot()
    return {}
