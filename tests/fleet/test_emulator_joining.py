"""The emulator's engines join, leave and come back through the agent's registration, against
a real control plane whose topology declares the clusters and no instance: starting the
emulator fills the inventory; an engine that stops (its agent silent) is marked unreachable
after the grace period and routing avoids it; started again, it is restored on the same row."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from clusters.models import Instance
from clusters.reachability import instances_reachability_sweep
from clusters.topology import topology_apply
from controlplane.audit import CLI_ACTOR
from fleet.emulator import EmulatorConfig, FleetEmulator, emulator_fault_push
from fleet.emulator.workload import scenario_workload
from scheduling.core.scenario import scenario_load
from tests.factories import api_token
from tests.support.servers import control_plane_serve
from tests.support.waiting import wait_for

GONE = "pd-h20-7"  # a decode instance of the case study


@pytest.fixture
def plane(
    transactional_db: None, redis_client: redis.Redis, settings: Any, scenarios_dir: Path
) -> Iterator[str]:
    from django.db import connection

    topology_apply(
        scenario_load(scenarios_dir / "paper-case-study.yaml"), actor=CLI_ACTOR, instances=False
    )
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _):
        yield base


def test_emulated_engines_join_leave_and_come_back_without_a_duplicate(
    plane: str, scenarios_dir: Path, settings: Any, redis_client: redis.Redis
) -> None:
    assert not Instance.objects.exists()
    _, router = api_token("router")
    _, agent = api_token("agent", "register")
    scenario, workload = scenario_workload(
        scenarios_dir / "paper-case-study.yaml", rate_per_s=2.0, seed=0, span_s=600
    )
    config = EmulatorConfig(
        base_url=plane, router_token=router, agent_token=agent, speed=4.0, telemetry_s=0.5
    )
    emulator = FleetEmulator(scenario, workload, config, faults=redis_client)
    # Its agents registered every engine before it started.
    rows = list(Instance.objects.order_by("name"))
    assert len(rows) == 12
    assert {(i.origin, i.engine, i.state) for i in rows} == {("registered", "emulated", "active")}
    pk = Instance.objects.get(name=GONE).pk
    running = threading.Thread(target=emulator.run)
    running.start()
    try:
        emulator_fault_push(redis_client, {"kind": "instance", "instance": GONE, "state": "down"})
        settings.INSTANCE_UNREACHABLE_AFTER_S = 2.0

        def gone() -> bool:
            instances_reachability_sweep()
            return Instance.objects.get(name=GONE).state == "unreachable"

        wait_for("the silent engine unreachable", gone, 30, interval_s=0.5)
        states = dict(Instance.objects.values_list("name", "state"))
        assert [n for n, s in states.items() if s != "active"] == [GONE]

        def decoders() -> set[str]:
            decisions = httpx.post(
                f"{plane}/api/v1/route/batch",
                json={"requests": [{"origin": "pd-h20", "prompt_tokens": 2000}] * 50},
                headers={"Authorization": f"Bearer {router}"},
                timeout=10,
            )
            assert decisions.status_code == 200, decisions.text
            return {d["decode"]["instance"] for d in decisions.json()["decisions"]}

        # The routers rebuild their snapshot within their live state's age bound (0.5 s).
        picked = wait_for("routing without it", lambda: GONE not in (p := decoders()) and p, 5)
        assert picked <= {"pd-h20-4", "pd-h20-5", "pd-h20-6"}

        emulator_fault_push(redis_client, {"kind": "instance", "instance": GONE, "state": "active"})
        wait_for(
            "the engine back",
            lambda: Instance.objects.get(name=GONE).state == "active",
            30,
            interval_s=0.5,
        )
        assert Instance.objects.filter(name=GONE).values_list("pk", flat=True)[0] == pk
        assert Instance.objects.count() == 12
    finally:
        emulator.stop()
        running.join(timeout=30)
