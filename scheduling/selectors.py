"""Reads behind the scheduling pages: policy history, recent decisions, the KV calculator."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clusters.models import Cluster, Link, ModelProfile, PerformanceProfile
from scheduling.core.performance import (
    Table,
    cluster_egress_gbps,
    kv_bytes,
    phi_kv_gbps,
    prefill_seconds,
    transfer_seconds,
)
from scheduling.models import Policy
from scheduling.outcomes import TtftComparison, ttft_comparisons_read
from scheduling.traffic import recent_decisions_read


def policy_history(limit: int = 50) -> list[dict[str, Any]]:
    """Policy versions, newest first, each with the version it replaced (for a diff)."""
    policies = list(Policy.objects.order_by("-version")[: limit + 1])
    rows = []
    for i, policy in enumerate(policies[:limit]):
        previous = policies[i + 1] if i + 1 < len(policies) else None
        rows.append(
            {
                "policy": policy,
                "before": None
                if previous is None
                else {"thresholds": previous.thresholds, "guards": previous.guards},
                "after": {"thresholds": policy.thresholds, "guards": policy.guards},
            }
        )
    return rows


def decisions_recent(
    limit: int = 100, origin: str | None = None, reason: str | None = None
) -> list[dict[str, Any]]:
    """The latest routing decisions with their inputs, newest first, optionally filtered."""
    rows = recent_decisions_read(limit=500 if (origin or reason) else limit)
    if origin:
        rows = [r for r in rows if r.get("inputs", {}).get("origin") == origin]
    if reason:
        rows = [r for r in rows if r.get("decision", {}).get("reason") == reason]
    return rows[:limit]


@dataclass(frozen=True)
class KvCalculation:
    """One prefill of ``tokens`` on ``accelerator``, and what ``instances`` of them need."""

    model: str
    accelerator: str
    tokens: int
    instances: int
    kv_bytes: float
    prefill_s: float
    phi_kv_gbps: float
    egress_gbps: float
    link_label: str | None
    link_gbps: float | None
    utilisation: float | None
    transfer_s: float | None

    @property
    def fits(self) -> bool | None:
        return None if self.utilisation is None else self.utilisation <= 1.0


def kv_calculation(
    *,
    model: ModelProfile,
    profile: PerformanceProfile,
    tokens: int,
    instances: int,
    link: Link | None = None,
    link_gbps: float | None = None,
) -> KvCalculation:
    """Paper Eqs. 1-2 for one model, accelerator and length, against a link or a capacity."""
    kv = Table.from_points(model.kv_cache_mib)
    table = Table.from_points(profile.prefill_seconds)
    need = float(cluster_egress_gbps(instances, kv, table, tokens))
    gbps = link.gbps if link is not None else link_gbps
    label = str(link) if link is not None else (f"{gbps:g} Gbps" if gbps is not None else None)
    return KvCalculation(
        model=model.name,
        accelerator=profile.accelerator.name,
        tokens=tokens,
        instances=instances,
        kv_bytes=float(kv_bytes(kv, tokens)),
        prefill_s=float(prefill_seconds(table, tokens)),
        phi_kv_gbps=float(phi_kv_gbps(kv, table, tokens)),
        egress_gbps=need,
        link_label=label,
        link_gbps=gbps,
        utilisation=(need / gbps if gbps else math.inf) if gbps is not None else None,
        transfer_s=float(transfer_seconds(kv, tokens, gbps)) if gbps is not None else None,
    )


def ttft_comparisons() -> list[TtftComparison]:
    """Predicted against observed TTFT per prefill cluster, from the gateways' outcomes."""
    return ttft_comparisons_read(list(Cluster.objects.values_list("name", flat=True)))
