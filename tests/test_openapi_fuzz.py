"""Schemathesis against the whole OpenAPI schema: every operation, every check, with an admin
token, on a small real fleet (PostgreSQL and Redis). No 5xx, no response outside the schema.

Bounded: ``FUZZ_EXAMPLES`` examples per operation (hypothesis, derandomised so CI is stable),
12 in the default run. Every check schemathesis has runs (its checks are all enabled by
default: the CLI's ``--checks all``). The stateful phase (sequences of calls linked by the
schema's inferred dependencies) is marked ``fuzz`` and runs with the large example count in
``make test-fuzz`` (300 examples), a CI stage of its own.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import redis
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.specs.openapi.checks import ignored_auth

from clusters.models import InstanceRole
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    PrfaasClusterFactory,
    api_token,
    bearer,
)

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
# Scenarios (call sequences) of the stateful phase, each up to STATEFUL_STEPS calls.
FUZZ_STATEFUL_EXAMPLES = int(os.environ.get("FUZZ_STATEFUL_EXAMPLES", "50"))
STATEFUL_STEPS = 8


def _wire_ints(value: Any) -> Any:
    """msgpack carries integers in [-2^63, 2^64): a generated one beyond cannot be sent by any
    client, so it is folded into that range (the server still judges what it means)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
        return value % (1 << 64)
    if isinstance(value, list):
        return [_wire_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _wire_ints(v) for k, v in value.items()}
    return value


@schemathesis.serializer("application/msgpack")
def msgpack_serializer(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    """Bodies of the KV-event msgpack endpoint: bytes as they are, anything else packed."""
    if isinstance(value, bytes):
        return value
    return msgspec.msgpack.encode(_wire_ints(value))


@pytest.fixture
def admin_headers(
    db: None, redis_client: redis.Redis, route_state_clean: None
) -> Iterator[dict[str, str]]:
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
        yield bearer(api_token("admin")[1])
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


# A body over API_MAX_BODY_BYTES is refused with 413 before it is parsed: that is a rejection
# of bad data too (schemathesis builds some over-long arrays bigger than the limit).
CONFIG = schemathesis.Config.from_dict(
    {
        # A NUL character is refused by design (422, docs/api.md: PostgreSQL text cannot hold
        # one), which JSON Schema cannot say; tests/controlplane/test_parser.py covers it.
        "generation": {"allow-x00": False},
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
            },
            # JSON Schema cannot say "at most 256 KB", so a schema-valid body may still be 413.
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "3xx", 401, 403, 404, 409, 413, 429]
            },
        },
        # The topology body's schema states a scenario's top level only (keys, which required);
        # what goes inside each key, and the names its parts use to refer to each other, is the
        # scenario format the reader checks (422 naming the key path), beyond JSON Schema.
        "operations": [
            # An instance's role must fit its cluster's kind (no decode in a prfaas cluster): a
            # rule across two tables, beyond JSON Schema (422, tested in tests/clusters).
            {
                "include-path-regex": "^/api/v1/instances",
                "checks": {
                    "positive_data_acceptance": {
                        "expected-statuses": ["2xx", 401, 403, 404, 409, 413, 422, 429]
                    }
                },
            },
            # A registration names a cluster, its accelerator, role and connector, which must
            # exist and match in the inventory (422 naming which, tested in tests/clusters).
            {
                "include-path-regex": "^/api/v1/registrations/",
                "checks": {
                    "positive_data_acceptance": {
                        "expected-statuses": ["2xx", 401, 403, 404, 409, 413, 422, 429]
                    }
                },
            },
            {
                "include-path": "/api/v1/topology",
                "include-method": "POST",
                "checks": {
                    "positive_data_acceptance": {
                        "expected-statuses": ["2xx", 401, 403, 404, 409, 413, 422, 429]
                    }
                },
            },
        ],
    }
)
# The schema is read once, at collection, from the app itself (no database needed for it).
schema = schemathesis.openapi.from_wsgi(
    "/api/v1/openapi.json", get_wsgi_application(), config=CONFIG
)

TABLE_FIELDS = ("kv_cache_mib", "prefill_seconds")


def _tokens_increase(table: Any) -> bool:
    if not isinstance(table, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], int | float)
        and not isinstance(p[0], bool)
        for p in table
    ):
        return True  # not a table of points at all: the schema already makes it a bad request
    tokens = [p[0] for p in table]
    return all(a < b for a, b in itertools.pairwise(tokens))


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    """Tables whose token counts do not increase are left out: JSON Schema cannot say "sorted"
    (the API refuses them with 422 naming the entry, tested in tests/clusters)."""
    if not isinstance(body, dict):
        return True
    return all(_tokens_increase(body[key]) for key in TABLE_FIELDS if key in body)


@schemathesis.hook
def filter_query(context: Any, query: Any) -> bool:
    """A query value that is an empty object or array is sent as no parameter at all (a query
    string has no way to write one), so a negative case that "breaks" a parameter that way is a
    valid request, and its 200 is not bad data accepted."""
    if not isinstance(query, dict):
        return True
    return not any(isinstance(v, dict | list) and not v for v in query.values())


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
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER):
        # Headers made invalid on purpose (a missing or malformed Authorization among them) go
        # as generated: the admin token put back would make the request valid, and its 200
        # would read as bad data accepted.
        case.call_and_validate()
    else:
        case.call_and_validate(headers=admin_headers)


@pytest.mark.fuzz
@pytest.mark.timeout(1200)
def test_api_workflows_answer_every_step_within_the_schema(admin_headers: dict[str, str]) -> None:
    """The stateful phase: chains of calls (create, then read, update, delete what was made)
    along the links schemathesis infers from the schema, every response checked."""

    # No runtime feedback (constants learnt from responses): it makes a replayed scenario draw
    # differently, which hypothesis refuses as a flaky strategy.
    machine = schema.build_state_machine(feedback=FeedbackSources(), link_calibration=None)

    class Workflow(machine):  # type: ignore[misc,valid-type]
        # Each scenario starts from the same fleet: its writes are rolled back at its end.
        def __init__(self) -> None:
            super().__init__()
            self._scenario = transaction.atomic()
            self._scenario.__enter__()

        def teardown(self) -> None:
            transaction.set_rollback(True)
            self._scenario.__exit__(None, None, None)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": admin_headers}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            # Every check but ``ignored_auth``: the machine passes the token as a transport
            # header, which that check's re-sent request keeps (a false "accepts invalid
            # auth"); the stateless test above runs it on every operation.
            case.validate_response(
                response,
                excluded_checks=[ignored_auth],
                headers=admin_headers,
                transport_kwargs=kwargs or None,
            )

    run_state_machine_as_test(
        Workflow,
        settings=settings(
            max_examples=FUZZ_STATEFUL_EXAMPLES,
            stateful_step_count=STATEFUL_STEPS,
            deadline=None,
            derandomize=True,
            # No shrinking: a replayed scenario meets the rows the earlier ones made (the
            # database is real and shared across scenarios), which hypothesis would call a
            # flaky strategy; a failure is reported as found, with its curl.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
