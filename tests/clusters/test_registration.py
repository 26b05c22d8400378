"""Registration through the agent: ``PUT /api/v1/registrations/{name}`` creates an instance or
re-binds its name, idempotently, bound to the token's clusters, validated, throttled; a bad
registration gets a 4xx and writes nothing."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from django.test import Client

from clusters.models import Cluster, Instance, InstanceOrigin, InstanceRole, InstanceState
from clusters.reachability import instances_reachability_sweep
from controlplane.models import ChangeRecord
from scheduling.rebalance.simulation import inventory_scenario
from tests.factories import AcceleratorFactory, ClusterFactory, InstanceFactory, api_token, bearer
from tests.support.fleets import pd_prfaas_fleet

pytestmark = pytest.mark.django_db

PD, PRFAAS = "pd-r", "prfaas-r"


@pytest.fixture
def fleet(redis_client: redis.Redis) -> tuple[Cluster, Cluster]:
    """Two clusters, a link, their profiles, and no instance: the agents bring them."""
    return pd_prfaas_fleet(
        PD, PRFAAS, h20_prefill_seconds=[[1024, 0.5], [8192, 2.0]], instances=False
    )


def body(**changes: Any) -> dict[str, Any]:
    out = {
        "cluster": PD,
        "role": "decode",
        "endpoint": "http://10.0.0.5:8000",
        "accelerator": "H20",
        "kv_connector": "nixl",
        "engine": "vllm",
        "engine_version": "0.32.0",
    }
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def put(client: Client, secret: str, name: str, payload: dict[str, Any]) -> Any:
    return client.put(
        f"/api/v1/registrations/{name}",
        data=payload,
        content_type="application/json",
        headers=bearer(secret),
    )


def records(name: str) -> list[ChangeRecord]:
    return list(ChangeRecord.objects.filter(object_type="clusters.instance", object_repr=name))


def test_an_agent_registers_its_instance_and_the_rebalancer_counts_it(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    _, secret = api_token("register", "agent", clusters=(PD,))
    answer = put(client, secret, "pd-r-7", body())
    assert answer.status_code == 201, answer.content
    got = answer.json()
    assert got["created"] is True
    assert got["instance"]["origin"] == "registered"
    assert (got["instance"]["engine"], got["instance"]["engine_version"]) == ("vllm", "0.32.0")
    inst = Instance.objects.get(name="pd-r-7")
    assert (inst.cluster.name, inst.role, inst.state) == (PD, "decode", "active")
    assert inst.endpoint == "http://10.0.0.5:8000"
    (record,) = records("pd-r-7")
    assert record.action == "register" and record.actor.startswith("token:")
    assert "registered by its agent as decode (vllm 0.32.0)" in record.cause
    # The rebalancer reads the inventory at its tick: the instance is in the fleet it plans.
    pd = next(c for c in inventory_scenario().clusters if c.name == PD)
    assert (pd.prefill_instances, pd.decode_instances) == (0, 1)


def test_registering_again_changes_nothing_and_writes_no_record(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    _, secret = api_token("register", clusters=(PD,))
    assert put(client, secret, "pd-r-1", body()).status_code == 201
    version = Instance.objects.get(name="pd-r-1").version
    again = put(client, secret, "pd-r-1", body())
    assert again.status_code == 200
    assert again.json()["created"] is False and again.json()["changed"] == []
    assert Instance.objects.filter(name="pd-r-1").count() == 1
    assert Instance.objects.get(name="pd-r-1").version == version
    assert len(records("pd-r-1")) == 1


def test_an_engine_restarted_in_another_role_is_rebound_with_its_cause(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    _, secret = api_token("register", clusters=(PD,))
    put(client, secret, "pd-r-2", body(role="decode"))
    answer = put(client, secret, "pd-r-2", body(role="prefill", engine_version="0.33.0"))
    assert answer.status_code == 200
    assert answer.json()["changed"] == ["engine_version", "role"]
    inst = Instance.objects.get(name="pd-r-2")
    assert (inst.role, inst.engine_version, inst.version) == ("prefill", "0.33.0", 2)
    latest = records("pd-r-2")[0]
    assert "registered as prefill (was decode)" in latest.cause
    assert latest.before is not None and latest.after is not None
    assert latest.before["role"] == "decode" and latest.after["role"] == "prefill"


def test_a_declared_instance_is_rebound_and_stays_declared(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    pd, _ = fleet
    InstanceFactory(cluster=pd, name="pd-r-0", role=InstanceRole.PREFILL, endpoint="")
    _, secret = api_token("register", clusters=(PD,))
    answer = put(client, secret, "pd-r-0", body(role="prefill"))
    assert answer.status_code == 200
    inst = Instance.objects.get(name="pd-r-0")
    assert inst.origin == InstanceOrigin.DECLARED
    assert (inst.endpoint, inst.engine) == ("http://10.0.0.5:8000", "vllm")


def test_a_restarted_agent_restores_an_unreachable_instance_without_a_duplicate(
    client: Client,
    fleet: tuple[Cluster, Cluster],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    _, secret = api_token("register", clusters=(PD,))
    with django_capture_on_commit_callbacks(execute=True):  # the heartbeat, after commit
        put(client, secret, "pd-r-3", body())
    pk = Instance.objects.get(name="pd-r-3").pk
    swept = instances_reachability_sweep(
        now=time.time() + settings.INSTANCE_UNREACHABLE_AFTER_S + 5
    )
    assert swept.marked == ["pd-r-3"]
    assert Instance.objects.get(pk=pk).state == InstanceState.UNREACHABLE
    answer = put(client, secret, "pd-r-3", body())
    assert answer.status_code == 200 and answer.json()["changed"] == ["state"]
    assert list(Instance.objects.filter(name="pd-r-3").values_list("pk", "state")) == [
        (pk, "active")
    ]
    assert "heartbeat again: active" in records("pd-r-3")[0].cause


BAD = [
    # (what, payload changes, token scopes, token clusters, status, code)
    ("unknown cluster", {"cluster": "pd-nowhere"}, ("register",), (), 422, "unknown_cluster"),
    ("outside the binding", {}, ("register",), (PRFAAS,), 403, "outside_binding"),
    ("no register scope", {}, ("agent",), (PD,), 403, "forbidden"),
    ("another accelerator", {"accelerator": "H200"}, ("register",), (), 422, "profile_mismatch"),
    ("decode in prfaas", {"cluster": PRFAAS, "accelerator": "H200"}, ("register",), (), 422,
     "role_not_allowed"),
    ("another connector", {"kv_connector": "shared_storage"}, ("register",), (), 422,
     "kv_connector_mismatch"),
    ("not a URL", {"endpoint": "not a url"}, ("register",), (), 422, "invalid"),
    ("a bad role", {"role": "both"}, ("register",), (), 422, "invalid"),
    ("no engine", {"engine": None}, ("register",), (), 422, "invalid"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "changes", "scopes", "clusters", "status", "code"), BAD, ids=[b[0] for b in BAD]
)
def test_a_bad_registration_is_refused_and_writes_nothing(
    client: Client,
    fleet: tuple[Cluster, Cluster],
    what: str,
    changes: dict[str, Any],
    scopes: tuple[str, ...],
    clusters: tuple[str, ...],
    status: int,
    code: str,
) -> None:
    _, secret = api_token(*scopes, clusters=clusters)
    before = ChangeRecord.objects.count()
    answer = put(client, secret, "pd-r-9", body(**changes))
    assert answer.status_code == status, answer.content
    assert answer.json()["code"] == code
    assert not Instance.objects.filter(name="pd-r-9").exists()
    assert ChangeRecord.objects.count() == before


def test_a_cluster_whose_accelerator_has_no_profile_refuses_registrations(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    pd, _ = fleet
    ClusterFactory(name="pd-bare", accelerator=AcceleratorFactory(name="L40"), model=pd.model)
    _, secret = api_token("register")
    answer = put(client, secret, "pd-bare-0", body(cluster="pd-bare", accelerator="L40"))
    assert answer.status_code == 422
    assert answer.json()["code"] == "profile_missing"
    assert not Instance.objects.filter(name="pd-bare-0").exists()


def test_a_wrong_token_is_refused(client: Client, fleet: tuple[Cluster, Cluster]) -> None:
    answer = put(client, "prfaas_not-a-token", "pd-r-9", body())
    assert answer.status_code == 401
    assert not Instance.objects.exists()


def test_a_name_held_in_another_cluster_is_not_taken_over(
    client: Client, fleet: tuple[Cluster, Cluster]
) -> None:
    _, prfaas = fleet
    InstanceFactory(cluster=prfaas, name="shared-name", role=InstanceRole.PREFILL)
    _, secret = api_token("register")
    answer = put(client, secret, "shared-name", body())
    assert answer.status_code == 409 and answer.json()["code"] == "name_taken"
    assert Instance.objects.get(name="shared-name").cluster == prfaas


def test_ten_thousand_registrations_a_minute_from_one_token_are_throttled(
    client: Client, fleet: tuple[Cluster, Cluster], settings: Any
) -> None:
    assert settings.REGISTRATIONS_PER_MINUTE < 10_000  # the default: well below
    settings.REGISTRATIONS_PER_MINUTE = limit = 40  # (a small limit keeps the test short)
    _, secret = api_token("register", clusters=(PD,))
    _, other = api_token("register", clusters=(PD,))
    statuses: list[int] = []
    for _ in range(10_000):
        # A runaway agent re-registering one engine as fast as it can.
        statuses.append(put(client, secret, "pd-r-burst", body()).status_code)
        if statuses[-1] == 429:
            break
    assert statuses[-1] == 429, f"{len(statuses)} registrations in a row were all accepted"
    # At most the limit got through (twice that, should the run straddle a minute boundary).
    assert limit <= len(statuses) - 1 <= 2 * limit
    throttled = put(client, secret, "pd-r-throttled", body())
    assert throttled.status_code == 429 and throttled.json()["code"] == "throttled"
    assert not Instance.objects.filter(name="pd-r-throttled").exists()
    assert len(records("pd-r-burst")) == 1
    # Another token is counted on its own.
    assert put(client, other, "pd-r-other", body()).status_code == 201
