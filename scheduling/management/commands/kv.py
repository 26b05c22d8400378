"""``manage.py kv FILE --tokens N``: can this model offload over these links?

Phi_kv at one length (paper Eq. 1) for each PrfaaS cluster's hardware, and the egress that K
instances busy with such requests need (Eq. 2), against each of the cluster's links.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.core.performance import (
    MIB,
    Table,
    cluster_egress_gbps,
    kv_bytes,
    phi_kv_gbps,
    prefill_seconds,
)
from scheduling.core.scenario import ScenarioError, scenario_load

MAX_TOKENS = 10_000_000


class Command(BaseCommand):
    help = "KV throughput (Phi_kv) at a length and the egress K prefill instances need, per link."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="scenario YAML file")
        parser.add_argument("--tokens", type=int, required=True, help="input length in tokens")
        parser.add_argument(
            "--instances", type=int, help="busy prefill instances (default: each cluster's own)"
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **opts: Any) -> None:
        tokens, instances = opts["tokens"], opts["instances"]
        if not 1 <= tokens <= MAX_TOKENS:
            raise CommandError(
                f"--tokens: must be within 1..{MAX_TOKENS}, got {tokens}", returncode=2
            )
        if instances is not None and instances < 1:
            raise CommandError(f"--instances: must be at least 1, got {instances}", returncode=2)
        try:
            scenario = scenario_load(opts["file"])
        except ScenarioError as exc:
            raise CommandError(str(exc), returncode=2) from None

        kv = Table.from_points(scenario.model.kv_cache_mib)
        size = float(kv_bytes(kv, tokens))
        clusters: list[dict[str, Any]] = []
        sources = scenario.prfaas_clusters or scenario.clusters
        for c in sources:
            prof = scenario.profile_for(c.accelerator)
            table = Table.from_points(prof.prefill_seconds)
            k = instances if instances is not None else c.prefill_instances
            need = float(cluster_egress_gbps(k, kv, table, tokens))
            links: list[dict[str, Any]] = [
                {
                    "link": link.key,
                    "gbps": link.gbps,
                    "utilisation": need / link.gbps if link.gbps > 0 else None,
                    "fits": need <= link.gbps,
                }
                for link in scenario.links
                if link.source == c.name
            ]
            clusters.append(
                {
                    "cluster": c.name,
                    "kind": c.kind,
                    "accelerator": c.accelerator,
                    "prefill_seconds": float(prefill_seconds(table, tokens)),
                    "phi_kv_gbps": float(phi_kv_gbps(kv, table, tokens)),
                    "instances": k,
                    "egress_gbps": need,
                    "links": links,
                }
            )
        out = {
            "scenario": scenario.name,
            "model": scenario.model.name,
            "tokens": tokens,
            "kv_cache_mib": size / MIB,
            "clusters": clusters,
        }
        if opts["json"]:
            self.stdout.write(json.dumps(out, indent=2))
            return
        lines = [
            f"{scenario.model.name} at {tokens} tokens: KVCache {size / MIB:.1f} MiB per request",
        ]
        for row in clusters:
            lines.append(
                f"{row['cluster']} ({row['accelerator']}): prefill {row['prefill_seconds']:.3f} s, "
                f"Phi_kv {row['phi_kv_gbps']:.2f} Gbps per instance; "
                f"{row['instances']} instances need {row['egress_gbps']:.1f} Gbps"
            )
            for link in row["links"]:
                use = (
                    "link down"
                    if link["utilisation"] is None
                    else f"{link['utilisation']:.0%} of it"
                )
                verdict = "fits" if link["fits"] else "EXCEEDS the link"
                lines.append(f"  {link['link']}: {link['gbps']:g} Gbps, {use}: {verdict}")
            if not row["links"] and row["kind"] == "prfaas":
                lines.append("  no links from this cluster")
        self.stdout.write("\n".join(lines))
