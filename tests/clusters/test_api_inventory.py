"""The inventory REST API: CRUD for every resource, versions, and every bad input's clear error."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import Client

from clusters.models import Instance, Site
from controlplane.models import ChangeRecord
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    PrfaasClusterFactory,
    SiteFactory,
    api_token,
    bearer,
)

pytestmark = pytest.mark.django_db


@dataclass(frozen=True)
class Resource:
    """How to exercise one inventory resource through the API."""

    path: str
    factory: Callable[[], Any]
    create: Callable[[], dict[str, Any]]
    patch: dict[str, Any]
    wrong_type: dict[str, Any]


def _model_id() -> int:
    return int(ModelProfileFactory().pk)


RESOURCES: dict[str, Resource] = {
    "sites": Resource(
        "/api/v1/sites",
        SiteFactory,
        lambda: {"name": "dc-new", "description": "new datacenter"},
        {"description": "renamed"},
        {"name": ["not", "a", "string"]},
    ),
    "accelerators": Resource(
        "/api/v1/accelerators",
        AcceleratorFactory,
        lambda: {"name": "B200", "gpu_hour_cost": 3.5},
        {"gpu_hour_cost": 2.5},
        {"name": "B200", "gpu_hour_cost": "expensive"},
    ),
    "model-profiles": Resource(
        "/api/v1/model-profiles",
        ModelProfileFactory,
        lambda: {
            "name": "hybrid-2",
            "block_tokens": 256,
            "kv_cache_mib": [[1024, 10.0], [4096, 30.0]],
            "linear_state_mib": 5.0,
        },
        {"block_tokens": 1024},
        {"name": "m", "block_tokens": "many", "kv_cache_mib": [[1, 1]]},
    ),
    "performance-profiles": Resource(
        "/api/v1/performance-profiles",
        PerformanceProfileFactory,
        lambda: {
            "accelerator_id": AcceleratorFactory().pk,
            "model_id": _model_id(),
            "gpus_per_instance": 8,
            "prefill_seconds": [[1024, 0.5], [8192, 1.0]],
        },
        {"gpus_per_instance": 4},
        {"accelerator_id": "first", "model_id": 1, "gpus_per_instance": 8, "prefill_seconds": []},
    ),
    "clusters": Resource(
        "/api/v1/clusters",
        ClusterFactory,
        lambda: {
            "name": "pd-new",
            "kind": "pd",
            "site_id": SiteFactory().pk,
            "accelerator_id": AcceleratorFactory().pk,
            "model_id": _model_id(),
        },
        {"name": "pd-renamed"},
        {"name": "x", "kind": 3, "site_id": 1, "accelerator_id": 1, "model_id": 1},
    ),
    "instances": Resource(
        "/api/v1/instances",
        InstanceFactory,
        lambda: {
            "cluster_id": ClusterFactory().pk,
            "name": "pd-new-0",
            "role": "decode",
            "endpoint": "http://10.1.0.1:8000",
            "labels": {"rack": "r1"},
        },
        {"state": "down"},
        {"cluster_id": 1, "name": "i", "role": "decode", "labels": ["r1"]},
    ),
    "links": Resource(
        "/api/v1/links",
        LinkFactory,
        lambda: {
            "source_id": PrfaasClusterFactory().pk,
            "target_id": ClusterFactory().pk,
            "gbps": 25.0,
            "rtt_ms": 4.0,
        },
        {"gbps": 0.0},
        {"source_id": 1, "target_id": 2, "gbps": "fast", "rtt_ms": 1},
    ),
}
NAMES = sorted(RESOURCES)


@pytest.fixture
def admin_client() -> Client:
    _, secret = api_token("admin")
    return Client(headers=bearer(secret))


def _send(client: Client, method: str, url: str, body: Any = None, **headers: str) -> Any:
    data = json.dumps(body) if body is not None else None
    return getattr(client, method)(
        url, data=data, content_type="application/json", headers=headers or None
    )


def assert_error(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"detail", "code"}
    assert body["detail"] and body["code"]
    for word in words:
        assert word in body["detail"], body["detail"]
    return dict(body)


@pytest.mark.parametrize("name", NAMES)
def test_create_then_get_returns_the_same_object_at_version_one(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    payload = res.create()
    created = _send(admin_client, "post", res.path, payload)
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["version"] == 1
    for key, value in payload.items():
        assert body[key] == value
    fetched = admin_client.get(f"{res.path}/{body['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == body


@pytest.mark.parametrize("name", NAMES)
def test_update_with_the_current_version_bumps_it_and_records_before_and_after(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    response = _send(admin_client, "patch", f"{res.path}/{obj.pk}", {"version": 1, **res.patch})
    assert response.status_code == 200, response.content
    assert response.json()["version"] == 2
    for key, value in res.patch.items():
        assert response.json()[key] == value
    record = ChangeRecord.objects.filter(
        object_type=f"clusters.{obj._meta.model_name}", object_id=str(obj.pk), action="update"
    ).get()
    field = next(iter(res.patch))
    assert (record.after or {})[field] == res.patch[field]
    assert (record.before or {})[field] != res.patch[field]
    assert record.actor.startswith("token:")


@pytest.mark.parametrize("name", NAMES)
def test_update_with_a_stale_version_is_a_409_naming_the_current_version(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    _send(admin_client, "patch", f"{res.path}/{obj.pk}", {"version": 1, **res.patch})
    stale = _send(admin_client, "patch", f"{res.path}/{obj.pk}", {"version": 1, **res.patch})
    body = assert_error(stale, 409, "version 2")
    assert body["code"] == "version_conflict"


@pytest.mark.parametrize("name", NAMES)
def test_update_without_a_version_is_a_422(admin_client: Client, name: str) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    assert_error(_send(admin_client, "patch", f"{res.path}/{obj.pk}", res.patch), 422, "version")


@pytest.mark.parametrize("name", NAMES)
def test_update_with_a_wrong_type_is_a_422_naming_the_field(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    bad = {"version": 1, next(iter(res.patch)): {"nested": "object"}}
    response = _send(admin_client, "patch", f"{res.path}/{obj.pk}", bad)
    assert_error(response, 422, next(iter(res.patch)))


@pytest.mark.parametrize("name", NAMES)
def test_update_and_get_and_delete_of_an_unknown_id_are_404(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    assert_error(admin_client.get(f"{res.path}/987654"), 404, "987654")
    assert_error(
        _send(admin_client, "patch", f"{res.path}/987654", {"version": 1, **res.patch}),
        404,
        "987654",
    )
    assert_error(admin_client.delete(f"{res.path}/987654?version=1"), 404, "987654")


@pytest.mark.parametrize("name", NAMES)
def test_get_with_a_non_integer_id_is_a_422(admin_client: Client, name: str) -> None:
    assert_error(admin_client.get(f"{RESOURCES[name].path}/abc"), 422)


@pytest.mark.parametrize("name", NAMES)
def test_create_with_missing_fields_is_a_422_naming_one(admin_client: Client, name: str) -> None:
    response = _send(admin_client, "post", RESOURCES[name].path, {})
    assert_error(response, 422, "Field required")


@pytest.mark.parametrize("name", NAMES)
def test_create_with_a_wrong_type_is_a_422(admin_client: Client, name: str) -> None:
    res = RESOURCES[name]
    assert_error(_send(admin_client, "post", res.path, res.wrong_type), 422)


@pytest.mark.parametrize("name", NAMES)
def test_create_with_an_unknown_field_is_a_422_naming_it(admin_client: Client, name: str) -> None:
    res = RESOURCES[name]
    response = _send(admin_client, "post", res.path, {**res.create(), "colour": "blue"})
    assert_error(response, 422, "colour")


@pytest.mark.parametrize("name", NAMES)
def test_create_with_a_body_that_is_not_json_is_refused(admin_client: Client, name: str) -> None:
    response = admin_client.post(
        RESOURCES[name].path, data="{not json", content_type="application/json"
    )
    assert_error(response, 400)


@pytest.mark.parametrize("name", NAMES)
def test_list_is_paginated_in_a_stable_order(admin_client: Client, name: str) -> None:
    res = RESOURCES[name]
    for _ in range(3):
        res.factory()
    first = admin_client.get(f"{res.path}?limit=2").json()
    second = admin_client.get(f"{res.path}?limit=2&offset=2").json()
    again = admin_client.get(f"{res.path}?limit=2").json()
    assert first == again
    assert first["count"] == second["count"] >= 3
    assert len(first["items"]) == 2
    ids = [i["id"] for i in first["items"] + second["items"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", NAMES)
def test_list_with_a_bad_limit_is_a_422(admin_client: Client, name: str) -> None:
    assert_error(admin_client.get(f"{RESOURCES[name].path}?limit=lots"), 422, "limit")


@pytest.mark.parametrize("name", NAMES)
def test_list_with_an_offset_or_limit_out_of_bounds_is_a_422_naming_it(
    admin_client: Client, name: str
) -> None:
    path = RESOURCES[name].path
    assert_error(admin_client.get(f"{path}?offset={2**63}"), 422, "offset")
    assert_error(admin_client.get(f"{path}?offset=-1"), 422, "offset")
    assert_error(admin_client.get(f"{path}?limit=1001"), 422, "limit")
    assert_error(admin_client.get(f"{path}?limit=0"), 422, "limit")


def test_list_with_an_unknown_or_repeated_query_parameter_is_a_422_naming_it(
    admin_client: Client,
) -> None:
    assert_error(admin_client.get("/api/v1/sites?nme=dc"), 422, "nme", "not a parameter")
    response = admin_client.get("/api/v1/sites?name=a&name=b")
    assert_error(response, 422, "name", "more than once")


def test_a_boolean_or_a_string_for_a_number_is_a_422(admin_client: Client) -> None:
    payload = RESOURCES["links"].create() | {"gbps": True}
    assert_error(_send(admin_client, "post", "/api/v1/links", payload), 422, "gbps", "number")
    payload = RESOURCES["links"].create() | {"rtt_ms": "5"}
    assert_error(_send(admin_client, "post", "/api/v1/links", payload), 422, "rtt_ms", "number")
    payload = RESOURCES["model-profiles"].create() | {"kv_cache_mib": [[1, 1.0], ["2", 2.0]]}
    response = _send(admin_client, "post", "/api/v1/model-profiles", payload)
    assert_error(response, 422, "kv_cache_mib", "pair of numbers")


def test_a_count_beyond_the_database_integer_is_a_422(admin_client: Client) -> None:
    payload = RESOURCES["model-profiles"].create() | {"block_tokens": 2**31}
    response = _send(admin_client, "post", "/api/v1/model-profiles", payload)
    assert_error(response, 422, "block_tokens")


@pytest.mark.parametrize("name", NAMES)
def test_delete_with_the_current_version_removes_it_and_records_it(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    response = admin_client.delete(f"{res.path}/{obj.pk}?version=1")
    assert response.status_code == 204
    assert not type(obj).objects.filter(pk=obj.pk).exists()
    record = ChangeRecord.objects.get(
        object_type=f"clusters.{obj._meta.model_name}", object_id=str(obj.pk), action="delete"
    )
    assert (record.before or {})["id"] == obj.pk
    assert record.after is None


@pytest.mark.parametrize("name", NAMES)
def test_delete_takes_the_version_only_as_a_query_parameter(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    response = admin_client.delete(f"{res.path}/{obj.pk}", headers={"If-Match": '"1"'})
    assert_error(response, 422, "version")
    assert type(obj).objects.filter(pk=obj.pk).exists()


@pytest.mark.parametrize("name", NAMES)
def test_delete_without_or_with_a_stale_or_malformed_version_is_refused(
    admin_client: Client, name: str
) -> None:
    res = RESOURCES[name]
    obj = res.factory()
    assert_error(admin_client.delete(f"{res.path}/{obj.pk}"), 422, "version")
    assert_error(admin_client.delete(f"{res.path}/{obj.pk}?version=7"), 409, "version 1")
    assert_error(admin_client.delete(f"{res.path}/{obj.pk}?version=x"), 422, "version")
    assert_error(admin_client.delete(f"{res.path}/{obj.pk}?version=0"), 422, "version")
    assert_error(admin_client.delete(f"{res.path}/{obj.pk}?version={2**31}"), 422, "version")
    assert type(obj).objects.filter(pk=obj.pk).exists()


def test_deleting_a_site_still_used_by_a_cluster_is_a_409(admin_client: Client) -> None:
    cluster = ClusterFactory()
    response = admin_client.delete(f"/api/v1/sites/{cluster.site_id}?version=1")
    assert_error(response, 409, "still used")
    assert Site.objects.filter(pk=cluster.site_id).exists()


def test_create_with_a_duplicate_name_is_a_409(admin_client: Client) -> None:
    SiteFactory(name="dc-a")
    assert_error(_send(admin_client, "post", "/api/v1/sites", {"name": "dc-a"}), 409, "name")


def test_create_with_an_unknown_reference_is_a_404_naming_it(admin_client: Client) -> None:
    payload = RESOURCES["clusters"].create() | {"site_id": 987654}
    assert_error(_send(admin_client, "post", "/api/v1/clusters", payload), 404, "site_id", "987654")


def test_patch_to_an_unknown_reference_is_a_404_and_changes_nothing(admin_client: Client) -> None:
    cluster = ClusterFactory()
    payload = {"version": 1, "accelerator_id": 987654}
    response = _send(admin_client, "patch", f"/api/v1/clusters/{cluster.pk}", payload)
    assert_error(response, 404, "accelerator_id", "987654")
    cluster.refresh_from_db()
    assert cluster.version == 1


def test_a_link_from_a_pd_cluster_is_refused(admin_client: Client) -> None:
    payload = {
        "source_id": ClusterFactory().pk,
        "target_id": ClusterFactory().pk,
        "gbps": 1,
        "rtt_ms": 1,
    }
    assert_error(_send(admin_client, "post", "/api/v1/links", payload), 422, "prfaas")


def test_a_decode_instance_in_a_prfaas_cluster_is_refused(admin_client: Client) -> None:
    payload = {"cluster_id": PrfaasClusterFactory().pk, "name": "x-0", "role": "decode"}
    assert_error(_send(admin_client, "post", "/api/v1/instances", payload), 422, "decode")


def test_an_unsorted_table_is_refused_naming_the_entry(admin_client: Client) -> None:
    payload = RESOURCES["model-profiles"].create() | {"kv_cache_mib": [[4096, 1.0], [1024, 2.0]]}
    assert_error(_send(admin_client, "post", "/api/v1/model-profiles", payload), 422, "[1][0]")


def test_a_table_of_one_point_is_refused(admin_client: Client) -> None:
    payload = RESOURCES["model-profiles"].create() | {"kv_cache_mib": [[1024, 1.0]]}
    response = _send(admin_client, "post", "/api/v1/model-profiles", payload)
    assert_error(response, 422, "kv_cache_mib", "at least 2")


def test_a_negative_capacity_is_refused(admin_client: Client) -> None:
    payload = RESOURCES["links"].create() | {"gbps": -1}
    assert_error(_send(admin_client, "post", "/api/v1/links", payload), 422, "gbps")


def test_a_null_for_a_required_field_in_a_patch_is_refused(admin_client: Client) -> None:
    site = SiteFactory()
    response = _send(
        admin_client, "patch", f"/api/v1/sites/{site.pk}", {"version": 1, "name": None}
    )
    assert_error(response, 422, "name")


def test_list_filters_narrow_the_result(admin_client: Client) -> None:
    pd = ClusterFactory()
    prfaas = PrfaasClusterFactory()
    InstanceFactory(cluster=pd, role="decode", state="down")
    InstanceFactory(cluster=pd, role="prefill")
    clusters = admin_client.get("/api/v1/clusters?kind=prfaas").json()
    assert [c["id"] for c in clusters["items"]] == [prfaas.pk]
    down = admin_client.get(f"/api/v1/instances?cluster_id={pd.pk}&state=down").json()
    assert down["count"] == 1 and down["items"][0]["role"] == "decode"


def test_list_with_an_unknown_enum_filter_is_a_422(admin_client: Client) -> None:
    assert_error(admin_client.get("/api/v1/clusters?kind=gpu"), 422, "kind")
    assert_error(admin_client.get("/api/v1/instances?state=asleep"), 422, "state")


def test_drain_then_activate_moves_the_instance_and_records_both(admin_client: Client) -> None:
    instance = InstanceFactory()
    drained = admin_client.post(f"/api/v1/instances/{instance.pk}/drain")
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    activated = admin_client.post(f"/api/v1/instances/{instance.pk}/activate?version=2")
    assert activated.status_code == 200 and activated.json()["state"] == "active"
    actions = list(
        ChangeRecord.objects.filter(
            object_type="clusters.instance", object_id=str(instance.pk)
        ).values_list("action", flat=True)
    )
    assert sorted(actions) == ["activate", "drain"]


@pytest.mark.parametrize("verb", ["drain", "activate"])
def test_drain_and_activate_refuse_unknown_ids_stale_and_malformed_versions(
    admin_client: Client, verb: str
) -> None:
    instance = InstanceFactory()
    assert_error(admin_client.post(f"/api/v1/instances/987654/{verb}"), 404)
    assert_error(admin_client.post(f"/api/v1/instances/{instance.pk}/{verb}?version=5"), 409)
    assert_error(admin_client.post(f"/api/v1/instances/{instance.pk}/{verb}?version=x"), 422)
    assert_error(admin_client.post(f"/api/v1/instances/{instance.pk}/{verb}?version=0"), 422)
    assert_error(admin_client.post(f"/api/v1/instances/abc/{verb}"), 422)
    assert Instance.objects.get(pk=instance.pk).version == 1


def test_changing_a_cluster_kind_is_refused_while_decode_instances_exist(
    admin_client: Client,
) -> None:
    instance = InstanceFactory(role="decode")
    response = _send(
        admin_client,
        "patch",
        f"/api/v1/clusters/{instance.cluster_id}",
        {"version": 1, "kind": "prfaas"},
    )
    assert_error(response, 422, "decode")


def test_the_request_id_of_a_write_is_in_its_change_record(admin_client: Client) -> None:
    response = admin_client.post(
        "/api/v1/sites",
        data=json.dumps({"name": "dc-traced"}),
        content_type="application/json",
        headers={"X-Request-ID": "req-123"},
    )
    assert response.status_code == 201
    record = ChangeRecord.objects.get(
        object_type="clusters.site", object_id=str(response.json()["id"])
    )
    assert record.request_id == "req-123"
    assert record.source == "api"


# Physical bounds (issue 13: ``gbps: 1e308`` was accepted and overflowed the router).
OUT_OF_BOUNDS = [
    ("links", {"gbps": 1e308}, "gbps"),
    ("links", {"gbps": 100_001}, "gbps"),
    ("links", {"rtt_ms": 1e9}, "rtt_ms"),
    ("links", {"kv_budget_bytes": 2**62}, "kv_budget_bytes"),
    ("links", {"target_utilisation": 1.5}, "target_utilisation"),
    ("accelerators", {"gpu_hour_cost": 1e300}, "gpu_hour_cost"),
    ("model-profiles", {"block_tokens": 2**31 - 1}, "block_tokens"),
    ("model-profiles", {"kv_cache_mib": [[1024, 1e300], [2048, 1e301]]}, "kv_cache_mib"),
    ("model-profiles", {"kv_cache_mib": [[1, 1.0], [10**12, 2.0]]}, "kv_cache_mib"),
    ("model-profiles", {"linear_state_mib": 1e300}, "linear_state_mib"),
    ("performance-profiles", {"gpus_per_instance": 10**6}, "gpus_per_instance"),
    ("performance-profiles", {"prefill_seconds": [[1, 1.0], [2, 1e200]]}, "prefill_seconds"),
    (
        "performance-profiles",
        {"decode_max_batch": 10**9, "decode_step_seconds": 0.05},
        "decode_max_batch",
    ),
    (
        "performance-profiles",
        {"decode_max_batch": 64, "decode_step_seconds": 3600.0},
        "decode_step_seconds",
    ),
]


@pytest.mark.parametrize(("name", "fields", "field"), OUT_OF_BOUNDS)
def test_a_physical_quantity_beyond_its_bound_is_a_422_on_create_and_patch(
    admin_client: Client, name: str, fields: dict[str, Any], field: str
) -> None:
    r = RESOURCES[name]
    created = _send(admin_client, "post", r.path, {**r.create(), **fields})
    assert_error(created, 422, field)
    obj = r.factory()
    patched = _send(admin_client, "patch", f"{r.path}/{obj.pk}", {"version": obj.version, **fields})
    assert_error(patched, 422, field)
    obj.refresh_from_db()
    assert obj.version == 1


@pytest.mark.parametrize(
    ("number", "status"), [("Infinity", 400), ("-Infinity", 400), ("NaN", 400), ("1e400", 422)]
)
def test_non_finite_numbers_are_refused_not_a_500(
    admin_client: Client, number: str, status: int
) -> None:
    body = json.dumps({**RESOURCES["links"].create(), "gbps": 0}).replace(
        '"gbps": 0', f'"gbps": {number}'
    )
    response = admin_client.post("/api/v1/links", data=body, content_type="application/json")
    assert_error(response, status)
