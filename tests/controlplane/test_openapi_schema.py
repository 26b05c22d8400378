"""The OpenAPI document says what the API does: the points the fuzz test once found it did not."""

from typing import Any

import pytest
from django.test import Client


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    response = Client().get("/api/v1/openapi.json")
    assert response.status_code == 200
    return dict(response.json())


def _parameter(op: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in op["parameters"] if p["name"] == name)


def test_every_list_states_the_bounds_of_its_limit_and_offset(schema: dict[str, Any]) -> None:
    lists = [
        op
        for path, methods in schema["paths"].items()
        for method, op in methods.items()
        if method == "get" and any(p["name"] == "offset" for p in op.get("parameters", []))
    ]
    assert len(lists) >= 8  # seven inventory kinds and the audit log
    for op in lists:
        assert _parameter(op, "offset")["schema"]["maximum"] == 10**9
        assert _parameter(op, "limit")["schema"]["maximum"] == 1000


def test_a_delete_requires_the_version_in_its_query(schema: dict[str, Any]) -> None:
    deletes = [methods["delete"] for methods in schema["paths"].values() if "delete" in methods]
    assert deletes
    for op in deletes:
        version = _parameter(op, "version")
        assert version["required"] is True
        assert version["schema"]["minimum"] == 1


def test_a_patch_field_is_nullable_only_where_null_means_something(
    schema: dict[str, Any],
) -> None:
    props = schema["components"]["schemas"]["LinkPatch"]["properties"]
    assert props["gbps"]["type"] == "number"
    assert "anyOf" not in props["gbps"]
    assert {"type": "null"} in props["kv_budget_bytes"]["anyOf"]


def test_a_table_needs_two_distinct_positive_points(schema: dict[str, Any]) -> None:
    table = schema["components"]["schemas"]["ModelProfileIn"]["properties"]["kv_cache_mib"]
    assert table["minItems"] == 2
    assert table["uniqueItems"] is True
    tokens, value = table["items"]["prefixItems"]
    assert tokens["minimum"] == 1
    assert value["exclusiveMinimum"] == 0


def test_the_topology_body_states_the_top_level_of_a_scenario(schema: dict[str, Any]) -> None:
    body = schema["paths"]["/api/v1/topology"]["post"]["requestBody"]
    scenario = body["content"]["application/json"]["schema"]
    assert body["required"] is True
    assert scenario["additionalProperties"] is False
    assert {"required": ["extends"]} in scenario["anyOf"]
    assert "clusters" in scenario["anyOf"][0]["required"]
