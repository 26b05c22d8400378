"""Scenarios back to the file format (``scenarios/SCHEMA.md``): what ``plan`` and the
inventory export write, and what round-trips through :func:`scheduling.core.scenario.scenario_parse`.
Pure Python: no Django import here.
"""

from __future__ import annotations

import json
from typing import Any

from scheduling.core.bounds import MIB
from scheduling.core.link import Link, link_key
from scheduling.core.scenario_types import (
    ArrivalSpec,
    Distribution,
    Event,
    FixedDist,
    LinkEvent,
    LognormalDist,
    Scenario,
    StateEvent,
    TableT,
)

# --------------------------------------------------------------------------------------------
# Back to the file format


def _table_out(table: TableT) -> list[list[float]]:
    return [[_num_out(x), _num_out(y)] for x, y in table]


def _num_out(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def distribution_to_dict(dist: Distribution) -> dict[str, Any]:
    if isinstance(dist, LognormalDist):
        return {
            "distribution": "lognormal",
            "mu": dist.mu,
            "sigma": dist.sigma,
            "min": _num_out(dist.min),
            "max": _num_out(dist.max),
        }
    if isinstance(dist, FixedDist):
        return {"distribution": "fixed", "value": _num_out(dist.value)}
    return {"distribution": "empirical", "points": _table_out(dist.points)}


def _arrival_out(a: ArrivalSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"process": a.process}
    if a.rate_per_s is not None:
        out["rate_per_s"] = a.rate_per_s
    return out


def _event_out(e: Event) -> dict[str, Any]:
    if isinstance(e, LinkEvent):
        return {"at_s": e.at_s, "link": link_key(e.source, e.target), "gbps": e.gbps}
    if isinstance(e, StateEvent):
        out: dict[str, Any] = {"at_s": e.at_s, "state": e.state}
        if e.instance is not None:
            out["instance"] = e.instance
        if e.cluster is not None:
            out["cluster"] = e.cluster
        return out
    return {"at_s": e.at_s, "cluster": e.cluster, "rate_scale": e.rate_scale}


def _link_out(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": link.source,
        "target": link.target,
        "gbps": link.gbps,
        "rtt_ms": link.rtt_ms,
    }
    if link.kv_budget_bytes is not None:
        out["kv_budget_mib"] = link.kv_budget_bytes / MIB
    if link.target_utilisation is not None:
        out["target_utilisation"] = link.target_utilisation
    if link.max_refused_share is not None:
        out["max_refused_share"] = link.max_refused_share
    return out


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    """The scenario in the file format (already merged: no ``extends``; absolute trace path)."""
    model: dict[str, Any] = {
        "name": s.model.name,
        "attention": dict(s.model.attention),
        "block_tokens": s.model.block_tokens,
        "kv_cache_mib": _table_out(s.model.kv_cache_mib),
    }
    if s.model.linear_state_mib is not None:
        model["linear_state_mib"] = s.model.linear_state_mib
    profiles = []
    for p in s.profiles:
        prof: dict[str, Any] = {
            "accelerator": p.accelerator,
            "gpus_per_instance": p.gpus_per_instance,
            "prefill_seconds": _table_out(p.prefill_seconds),
        }
        if p.decode is not None:
            prof["decode"] = {
                "max_batch": p.decode.max_batch,
                "step_seconds": p.decode.step_seconds,
            }
        profiles.append(prof)
    clusters = []
    for c in s.clusters:
        cl: dict[str, Any] = {
            "name": c.name,
            "kind": c.kind.value,
            "site": c.site,
            "accelerator": c.accelerator,
            "prefill_instances": c.prefill_instances,
        }
        if c.kind == "pd":
            cl["decode_instances"] = c.decode_instances
        if c.kv_connector != "nixl":
            cl["kv_connector"] = c.kv_connector
        if c.scale_targets:
            cl["scale_targets"] = {t.role: t.to_json() for t in c.scale_targets}
        clusters.append(cl)
    out: dict[str, Any] = {
        "version": s.version,
        "name": s.name,
        "description": s.description,
        "model": model,
        "accelerators": [
            {"name": a.name, "gpu_hour_cost": a.gpu_hour_cost} for a in s.accelerators
        ],
        "profiles": profiles,
        "clusters": clusters,
        "links": [_link_out(link) for link in s.links],
    }
    if s.workload is not None:
        w = s.workload
        wl: dict[str, Any] = {"arrival": _arrival_out(w.arrival)}
        if w.input_tokens is not None:
            wl["input_tokens"] = distribution_to_dict(w.input_tokens)
        if w.output_tokens is not None:
            wl["output_tokens"] = distribution_to_dict(w.output_tokens)
        if w.trace is not None:
            wl["trace"] = {
                "path": str(w.trace.path),
                "format": w.trace.format,
                "dequantize": w.trace.dequantize,
                "rate_scale": w.trace.rate_scale,
            }
        if w.phases:
            phases = []
            for ph in w.phases:
                d: dict[str, Any] = {"duration_s": ph.duration_s}
                if ph.ramp:
                    d["ramp"] = True
                if ph.arrival is not None:
                    d["arrival"] = _arrival_out(ph.arrival)
                if ph.input_tokens is not None:
                    d["input_tokens"] = distribution_to_dict(ph.input_tokens)
                if ph.output_tokens is not None:
                    d["output_tokens"] = distribution_to_dict(ph.output_tokens)
                if ph.prefix_hit_fraction is not None:
                    d["prefix_hit_fraction"] = ph.prefix_hit_fraction
                phases.append(d)
            wl["phases"] = phases
        if w.origins:
            wl["origins"] = dict(w.origins)
        if w.prefix_hit_fraction is not None:
            wl["prefix_hit_fraction"] = w.prefix_hit_fraction
        out["workload"] = wl
    if s.events:
        out["events"] = [_event_out(e) for e in s.events]
    if s.caches:
        out["caches"] = {k: {"gib_per_instance": v.gib_per_instance} for k, v in s.caches.items()}
    if s.slo is not None:
        out["slo"] = {"decode_tokens_per_s": s.slo.decode_tokens_per_s}
    if s.expected is not None:
        out["expected"] = json.loads(json.dumps(s.expected))
    return out
