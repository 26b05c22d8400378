"""Every API operation x every kind of caller: 401 without valid credentials, 403 without the
scope, through otherwise.

The table below is the access policy. It is checked against the live API: an operation that
exists but is missing here (or a row for an operation that no longer exists) fails the suite.
Adding an endpoint? Add one row: ``("METHOD", "/api/v1/path/{param}"): "scope"`` (or ``None``
for a public operation).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import Client

from controlplane.api import api
from controlplane.auth import token_cache_clear
from controlplane.models import TokenScope
from tests.factories import api_token, bearer

# (method, path as in the OpenAPI schema) -> scope required, or None for public.
REQUIRED_SCOPE: dict[tuple[str, str], str | None] = {
    ("GET", "/api/v1/health"): None,
    ("GET", "/api/v1/health/live"): None,
    # inventory
    ("GET", "/api/v1/sites"): "read",
    ("POST", "/api/v1/sites"): "admin",
    ("GET", "/api/v1/sites/{site_id}"): "read",
    ("PATCH", "/api/v1/sites/{site_id}"): "admin",
    ("DELETE", "/api/v1/sites/{site_id}"): "admin",
    ("GET", "/api/v1/accelerators"): "read",
    ("POST", "/api/v1/accelerators"): "admin",
    ("GET", "/api/v1/accelerators/{accelerator_id}"): "read",
    ("PATCH", "/api/v1/accelerators/{accelerator_id}"): "admin",
    ("DELETE", "/api/v1/accelerators/{accelerator_id}"): "admin",
    ("GET", "/api/v1/model-profiles"): "read",
    ("POST", "/api/v1/model-profiles"): "admin",
    ("GET", "/api/v1/model-profiles/{model_profile_id}"): "read",
    ("PATCH", "/api/v1/model-profiles/{model_profile_id}"): "admin",
    ("DELETE", "/api/v1/model-profiles/{model_profile_id}"): "admin",
    ("GET", "/api/v1/performance-profiles"): "read",
    ("POST", "/api/v1/performance-profiles"): "admin",
    ("GET", "/api/v1/performance-profiles/{performance_profile_id}"): "read",
    ("PATCH", "/api/v1/performance-profiles/{performance_profile_id}"): "admin",
    ("DELETE", "/api/v1/performance-profiles/{performance_profile_id}"): "admin",
    ("GET", "/api/v1/clusters"): "read",
    ("POST", "/api/v1/clusters"): "admin",
    ("GET", "/api/v1/clusters/{cluster_id}"): "read",
    ("PATCH", "/api/v1/clusters/{cluster_id}"): "admin",
    ("DELETE", "/api/v1/clusters/{cluster_id}"): "admin",
    ("GET", "/api/v1/instances"): "read",
    ("POST", "/api/v1/instances"): "admin",
    ("GET", "/api/v1/instances/{instance_id}"): "read",
    ("PATCH", "/api/v1/instances/{instance_id}"): "admin",
    ("DELETE", "/api/v1/instances/{instance_id}"): "admin",
    ("POST", "/api/v1/instances/{instance_id}/drain"): "operate",
    ("POST", "/api/v1/instances/{instance_id}/activate"): "operate",
    ("GET", "/api/v1/links"): "read",
    ("POST", "/api/v1/links"): "admin",
    ("GET", "/api/v1/links/{link_id}"): "read",
    ("PATCH", "/api/v1/links/{link_id}"): "admin",
    ("DELETE", "/api/v1/links/{link_id}"): "admin",
    # topology as code
    ("GET", "/api/v1/topology"): "read",
    ("POST", "/api/v1/topology"): "admin",
    # audit
    ("GET", "/api/v1/audit"): "read",
    # tokens (a binding decides what an agent may report for the whole fleet)
    ("GET", "/api/v1/tokens"): "admin",
    ("PUT", "/api/v1/tokens/{name}/binding"): "admin",
    # routing (hot path) and the policy snapshot routers cache
    ("POST", "/api/v1/route"): "router",
    ("POST", "/api/v1/route/batch"): "router",
    ("GET", "/api/v1/policy"): "router",
    ("GET", "/api/v1/decisions/recent"): "read",
    # routers that decide in process: live state, reservations, outcomes (closing the loop)
    ("GET", "/api/v1/route/live"): "router",
    ("POST", "/api/v1/reservations"): "router",
    ("POST", "/api/v1/outcomes"): "router",
    ("POST", "/api/v1/ejections"): "router",
    ("GET", "/api/v1/outcomes/recent"): "read",
    # live state: agents post, the index health is readable
    ("POST", "/api/v1/telemetry"): "agent",
    ("POST", "/api/v1/kv-events"): "agent",
    ("POST", "/api/v1/kv-events/msgpack"): "agent",
    ("GET", "/api/v1/kv-events/state"): "agent",
    ("PUT", "/api/v1/registrations/{name}"): "register",
    ("GET", "/api/v1/prefix-index"): "read",
    # plans and the long-term rebalancer
    ("GET", "/api/v1/plans"): "read",
    ("GET", "/api/v1/plans/{plan_id}"): "read",
    ("POST", "/api/v1/plans/{plan_id}/approve"): "operate",
    ("POST", "/api/v1/plans/{plan_id}/reject"): "operate",
    ("POST", "/api/v1/plans/{plan_id}/rollback"): "operate",
    ("POST", "/api/v1/rebalance"): "operate",
    ("GET", "/api/v1/rebalance/ticks"): "read",
    ("GET", "/api/v1/rebalance/settings/{cluster}"): "read",
    ("PATCH", "/api/v1/rebalance/settings/{cluster}"): "admin",
}

CALLERS = [
    *TokenScope.values,
    "no-token",
    "malformed-header",
    "unknown-token",
    "expired",
    "revoked",
]


def live_operations() -> set[tuple[str, str]]:
    schema = api.get_openapi_schema()
    return {
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        for method in operations
        if method.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}
    }


def test_every_live_operation_has_a_row_in_the_access_table() -> None:
    missing = sorted(live_operations() - set(REQUIRED_SCOPE))
    assert not missing, f"add these operations to REQUIRED_SCOPE: {missing}"


def test_every_row_of_the_access_table_is_a_live_operation() -> None:
    stale = sorted(set(REQUIRED_SCOPE) - live_operations())
    assert not stale, f"these rows name operations that no longer exist: {stale}"


def _concrete(path: str) -> str:
    """Fill path parameters with an id that does not exist: access is decided before lookup."""
    out, rest = "", path
    while "{" in rest:
        head, _, tail = rest.partition("{")
        _, _, rest = tail.partition("}")
        out += head + "987654"
    return out + rest


@pytest.fixture
def credentials(db: None) -> Iterator[dict[str, dict[str, str]]]:
    token_cache_clear()
    headers: dict[str, dict[str, str]] = {}
    for scope in TokenScope.values:
        headers[scope] = bearer(api_token(scope)[1])
    headers["no-token"] = {}
    headers["malformed-header"] = {"Authorization": "Token abc"}
    headers["unknown-token"] = bearer("prfaas_not-a-token-anybody-issued")
    headers["expired"] = bearer(api_token("admin", expired=True)[1])
    headers["revoked"] = bearer(api_token("admin", revoked=True)[1])
    yield headers
    token_cache_clear()


def expected_denial(required: str | None, caller: str) -> int | None:
    """401 / 403 for a denied call, None when access must be granted."""
    if required is None:
        return None
    if caller not in TokenScope.values:
        return 401
    if caller == required or caller == TokenScope.ADMIN:
        return None
    return 403


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path"), sorted(REQUIRED_SCOPE))
def test_operation_grants_and_denies_by_scope(
    method: str, path: str, credentials: dict[str, dict[str, str]]
) -> None:
    required = REQUIRED_SCOPE[(method, path)]
    # Access is the subject here: let a granted call fail however its bad input makes it fail.
    client = Client(raise_request_exception=False)
    url = _concrete(path)
    outcomes = {}
    for caller in CALLERS:
        response = client.generic(
            method, url, data="{}", content_type="application/json", headers=credentials[caller]
        )
        denial = expected_denial(required, caller)
        outcomes[caller] = response.status_code
        if denial is None:
            assert response.status_code not in (401, 403), (caller, response.content)
        else:
            assert response.status_code == denial, (caller, response.content)
            body = response.json()
            assert set(body) == {"detail", "code"}
            assert body["code"] == ("unauthorized" if denial == 401 else "forbidden")
    assert set(outcomes) == set(CALLERS)
