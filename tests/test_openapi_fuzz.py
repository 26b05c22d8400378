"""Schemathesis against the whole OpenAPI schema: every operation, every check, with an admin
token, on a small real fleet (PostgreSQL and Redis). No 5xx, no response outside the schema.

Bounded: ``FUZZ_EXAMPLES`` examples per operation (hypothesis, derandomised so CI is stable).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.core.failures import FailureGroup, ServerError

from clusters.models import InstanceRole
from controlplane.auth import token_cache_clear
from scheduling.snapshot import snapshot_reset
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    PrfaasClusterFactory,
    api_token,
)

FUZZ_EXAMPLES = 12

# Findings in operations this suite's author does not own, reported to their owners. Such an
# operation still runs every check; a failure other than a 5xx is expected until it is fixed.
_VERSION_REQUIRED = "DELETE needs ?version= or If-Match, which the schema does not mark required"
_PATCH_NULLS = "PATCH accepts null for non-nullable fields in the schema, then answers 422"
_HUGE_OFFSET = "a huge ?offset= reaches PostgreSQL: 500 'bigint out of range' (pagination bounds)"
# 5xx found here in others' operations, reported to their owners: the only ones let through.
KNOWN_SERVER_ERRORS: dict[str, str] = {
    f"GET /api/v1/{kind}": _HUGE_OFFSET
    for kind in (
        "sites",
        "accelerators",
        "model-profiles",
        "performance-profiles",
        "clusters",
        "instances",
        "links",
    )
}
KNOWN_ISSUES: dict[str, str] = {
    **KNOWN_SERVER_ERRORS,
    "DELETE /api/v1/sites/{site_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/accelerators/{accelerator_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/model-profiles/{model_profile_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/performance-profiles/{performance_profile_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/clusters/{cluster_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/instances/{instance_id}": _VERSION_REQUIRED,
    "DELETE /api/v1/links/{link_id}": _VERSION_REQUIRED,
    "PATCH /api/v1/sites/{site_id}": _PATCH_NULLS,
    "PATCH /api/v1/accelerators/{accelerator_id}": _PATCH_NULLS,
    "PATCH /api/v1/model-profiles/{model_profile_id}": _PATCH_NULLS,
    "PATCH /api/v1/performance-profiles/{performance_profile_id}": _PATCH_NULLS,
    "PATCH /api/v1/clusters/{cluster_id}": _PATCH_NULLS,
    "PATCH /api/v1/instances/{instance_id}": _PATCH_NULLS,
    "PATCH /api/v1/links/{link_id}": _PATCH_NULLS,
    "POST /api/v1/model-profiles": "kv_cache_mib schema allows an empty list, model refuses it",
    "POST /api/v1/performance-profiles": "unknown accelerator/model id answers 422, not 404",
    "POST /api/v1/clusters": "unknown site/accelerator/model id answers 422, not 404",
    "POST /api/v1/topology": "the body schema does not say which keys a scenario requires",
    "GET /api/v1/audit": "query filters of the wrong type are accepted",
    "GET /api/v1/plans": "status filter: an enum in the code, a free string in the schema",
    "POST /api/v1/rebalance": "query parameters of the wrong type are accepted",
}


@pytest.fixture
def admin_headers(db: None, redis_client: redis.Redis) -> Iterator[dict[str, str]]:
    snapshot_reset()
    token_cache_clear()
    model = ModelProfileFactory(block_tokens=16)
    h20, h200 = AcceleratorFactory(), AcceleratorFactory()
    PerformanceProfileFactory(accelerator=h20, model=model)
    PerformanceProfileFactory(accelerator=h200, model=model)
    pd = ClusterFactory(name="pd-a", accelerator=h20, model=model)
    pf = PrfaasClusterFactory(name="prfaas-x", accelerator=h200, model=model)
    InstanceFactory(cluster=pd, name="pd-a-p0", role=InstanceRole.PREFILL)
    InstanceFactory(cluster=pd, name="pd-a-d0", role=InstanceRole.DECODE)
    InstanceFactory(cluster=pf, name="prfaas-x-p0", role=InstanceRole.PREFILL)
    LinkFactory(source=pf, target=pd)
    redis_client.hset("live:insts", "pd-a-p0", f"{time.time()!r},0,0,0,0.1,0")
    # As Django's test client does: the WSGI app must not close the test's connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield {"Authorization": f"Bearer {api_token('admin')[1]}"}
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    snapshot_reset()
    token_cache_clear()


# A body over API_MAX_BODY_BYTES is refused with 413 before it is parsed: that is a rejection
# of bad data too (schemathesis builds some over-long arrays bigger than the limit).
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
            },
            # JSON Schema cannot say "at most 256 KB", so a schema-valid body may still be 413.
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "3xx", 401, 403, 404, 409, 413, 429]
            },
        }
    }
)
# The schema is read once, at collection, from the app itself (no database needed for it).
schema = schemathesis.openapi.from_wsgi(
    "/api/v1/openapi.json", get_wsgi_application(), config=CONFIG
)


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_api_answers_every_generated_request_within_its_schema(
    case: Any, admin_headers: dict[str, str]
) -> None:
    known = KNOWN_ISSUES.get(case.operation.label)
    if known is None:
        case.call_and_validate(headers=admin_headers)
        return
    try:
        case.call_and_validate(headers=admin_headers)
    except FailureGroup as exc:
        label = case.operation.label
        if label not in KNOWN_SERVER_ERRORS and any(
            isinstance(f, ServerError) for f in exc.exceptions
        ):
            raise  # a 5xx is known only where listed as one
        pytest.xfail(f"known, reported to its owner: {known}")
