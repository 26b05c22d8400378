"""Leaving: an instance whose heartbeats stop is marked unreachable after the grace period
(routing stops using it), comes back when it heartbeats again, and is retired after a longer
silence unless it is declared; every change is in the change log with its cause."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from clusters.live.heartbeats import REGISTERED_KEY, heartbeats_read, registration_seen
from clusters.models import Cluster, Instance, InstanceOrigin, InstanceRole, InstanceState
from clusters.reachability import instances_reachability_sweep
from controlplane.models import ChangeRecord
from scheduling.core import routing
from scheduling.core.routing.live import prefill_pool
from scheduling.snapshot import snapshot_build
from tests.factories import InstanceFactory
from tests.support.fleets import pd_prfaas_fleet

pytestmark = pytest.mark.django_db

PD = "pd-s"


@pytest.fixture
def pd(redis_client: redis.Redis) -> Cluster:
    cluster, _ = pd_prfaas_fleet(
        PD, "prfaas-s", h20_prefill_seconds=[[1024, 0.5], [8192, 2.0]], instances=False
    )
    return cluster


def registered(cluster: Cluster, name: str, **fields: Any) -> Instance:
    fields.setdefault("role", InstanceRole.PREFILL)
    return InstanceFactory(cluster=cluster, name=name, origin=InstanceOrigin.REGISTERED, **fields)


def last_record(inst: Instance) -> ChangeRecord:
    return ChangeRecord.objects.filter(
        object_type="clusters.instance", object_id=str(inst.pk)
    ).latest("at", "id")


def test_a_silent_instance_is_marked_unreachable_and_routing_stops_using_it(
    pd: Cluster, settings: Any
) -> None:
    grace = settings.INSTANCE_UNREACHABLE_AFTER_S
    t0 = time.time()
    silent, alive = registered(pd, "pd-s-0"), registered(pd, "pd-s-1")
    registration_seen(silent.name, t0)
    registration_seen(alive.name, t0 + grace)
    before = {e[0].name for e in prefill_pool(snapshot_build().topology, routing.LiveState(), PD)}
    assert before == {"pd-s-0", "pd-s-1"}

    result = instances_reachability_sweep(now=t0 + grace + 1)

    assert result.marked == ["pd-s-0"] and not result.retired
    silent.refresh_from_db()
    assert silent.state == InstanceState.UNREACHABLE
    record = last_record(silent)
    assert (record.action, record.actor, record.source) == ("unreachable", "reachability", "system")
    assert record.cause == f"no heartbeat for {grace + 1:.0f} s (grace {grace:g} s)"
    after = {e[0].name for e in prefill_pool(snapshot_build().topology, routing.LiveState(), PD)}
    assert after == {"pd-s-1"}


def test_an_instance_heartbeating_again_gets_back_the_state_it_had(
    pd: Cluster, settings: Any
) -> None:
    grace = settings.INSTANCE_UNREACHABLE_AFTER_S
    t0 = time.time()
    inst = registered(pd, "pd-s-2", state=InstanceState.DRAINING)
    registration_seen(inst.name, t0)
    assert instances_reachability_sweep(now=t0 + grace + 1).marked == ["pd-s-2"]
    # Its agent posts telemetry again (a heartbeat), without registering.
    redis_client = redis.Redis.from_url(settings.REDIS_URL)
    redis_client.hset("live:insts", inst.name, f"{t0 + grace + 2},0,0,0,0.0,0")
    result = instances_reachability_sweep(now=t0 + grace + 3)
    assert result.returned == ["pd-s-2"]
    inst.refresh_from_db()
    assert inst.state == InstanceState.DRAINING  # mid-plan: still draining, not active
    record = last_record(inst)
    assert record.action == "reachable" and record.cause.endswith(": draining")


def test_a_registered_instance_is_retired_and_a_declared_one_only_marked(
    pd: Cluster, settings: Any
) -> None:
    retire = settings.INSTANCE_RETIRE_AFTER_S
    t0 = time.time()
    gone = registered(pd, "pd-s-3", state=InstanceState.UNREACHABLE)
    declared = InstanceFactory(cluster=pd, name="pd-s-4", state=InstanceState.UNREACHABLE)
    for inst in (gone, declared):
        registration_seen(inst.name, t0)

    result = instances_reachability_sweep(now=t0 + retire + 1)

    assert result.retired == ["pd-s-3"]
    assert not Instance.objects.filter(name="pd-s-3").exists()
    record = ChangeRecord.objects.get(object_repr="pd-s-3", action="retire")
    assert record.before is not None and record.before["name"] == "pd-s-3"
    assert record.cause == f"no heartbeat for {retire + 1:.0f} s (retired after {retire:g} s)"
    assert heartbeats_read(["pd-s-3"]) == {}
    declared.refresh_from_db()
    assert declared.state == InstanceState.UNREACHABLE


def test_instances_never_heard_of_or_down_are_left_alone(pd: Cluster, settings: Any) -> None:
    quiet = InstanceFactory(cluster=pd, name="pd-s-5")
    down = InstanceFactory(cluster=pd, name="pd-s-6", state=InstanceState.DOWN)
    registration_seen(down.name, time.time() - 10 * settings.INSTANCE_UNREACHABLE_AFTER_S)
    result = instances_reachability_sweep()
    assert (result.marked, result.returned, result.retired) == ([], [], [])
    assert Instance.objects.get(pk=quiet.pk).state == InstanceState.ACTIVE
    assert Instance.objects.get(pk=down.pk).state == InstanceState.DOWN
    assert redis.Redis.from_url(settings.REDIS_URL).hexists(REGISTERED_KEY, down.name)
