"""Topology round trip on fleets it was never shown: any valid shape applies, exports, and
applies back with zero changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusters.models import Cluster, Instance, Link
from clusters.topology import topology_apply, topology_export
from controlplane.audit import CLI_ACTOR
from scheduling.core.scenario import scenario_parse


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    n_prfaas = draw(st.integers(1, 2))
    n_pd = draw(st.integers(1, 3))
    prfaas = [
        {
            "name": f"prfaas-{i}",
            "kind": "prfaas",
            "site": f"dc-{draw(st.integers(0, 2))}",
            "accelerator": "A",
            "prefill_instances": draw(st.integers(0, 5)),
        }
        for i in range(n_prfaas)
    ]
    pd = [
        {
            "name": f"pd-{i}",
            "kind": "pd",
            "site": f"dc-{draw(st.integers(0, 2))}",
            "accelerator": "B",
            "prefill_instances": draw(st.integers(0, 4)),
            "decode_instances": draw(st.integers(0, 4)),
        }
        for i in range(n_pd)
    ]
    pairs = [(s["name"], t["name"]) for s in prfaas for t in pd]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
    gbps = st.floats(0, 400, allow_nan=False).map(lambda x: round(x, 3))
    tokens = sorted(draw(st.lists(st.integers(1, 200_000), min_size=2, max_size=5, unique=True)))
    return {
        "version": 1,
        "name": "generated",
        "model": {
            "name": "m",
            "block_tokens": draw(st.sampled_from([64, 256, 512])),
            "kv_cache_mib": [[t, round(1 + t / 100, 3)] for t in tokens],
        },
        "accelerators": [
            {"name": "A", "gpu_hour_cost": draw(st.sampled_from([1.0, 2.0, 2.5]))},
            {"name": "B", "gpu_hour_cost": 1.0},
        ],
        "profiles": [
            {
                "accelerator": "A",
                "gpus_per_instance": 8,
                "prefill_seconds": [[t, t / 1e4] for t in tokens],
            },
            {
                "accelerator": "B",
                "gpus_per_instance": draw(st.sampled_from([4, 8])),
                "prefill_seconds": [[t, t / 5e3] for t in tokens],
                "decode": {"max_batch": draw(st.integers(1, 64)), "step_seconds": 0.025},
            },
        ],
        "clusters": prfaas + pd,
        "links": [
            {
                "source": s,
                "target": t,
                "gbps": draw(gbps),
                "rtt_ms": draw(st.sampled_from([1.0, 10.0])),
            }
            for s, t in chosen
        ],
    }


@pytest.mark.django_db
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(fleet=fleets())
def test_any_fleet_applies_exports_and_applies_back_unchanged(fleet: dict[str, Any]) -> None:
    scenario = scenario_parse(fleet, base_dir=Path.cwd())
    # prune: examples share one test transaction, so each starts from the previous fleet.
    topology_apply(scenario, actor=CLI_ACTOR, prune=True)
    assert Cluster.objects.count() == len(fleet["clusters"])
    assert Link.objects.count() == len(fleet["links"])
    assert Instance.objects.count() == sum(
        c["prefill_instances"] + c.get("decode_instances", 0) for c in fleet["clusters"]
    )
    exported = scenario_parse(topology_export(), base_dir=Path.cwd())
    again = topology_apply(exported, actor=CLI_ACTOR, prune=True)
    assert (again.created, again.updated, again.deleted) == (0, 0, 0)
    assert again.unchanged > 0
