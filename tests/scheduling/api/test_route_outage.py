"""Routing through an outage of its dependencies, against the real app under uvicorn.

The database outage is real: the app's own database stops taking connections
(``ALLOW_CONNECTIONS false``) and its sessions are terminated, from a superuser connection to
another database of the same server; then access is given back. Redis is a private server
that the test stops and starts. The app runs with short bounds (credential cache 1 s, snapshot
bound 2 s, database retry 0.5 s) so the test outlives each of them in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection

from tests.factories import api_token, bearer
from tests.support.fleets import pd_prfaas_fleet
from tests.support.processes import RedisServer
from tests.support.servers import (
    control_plane_serve,
)

SHORT_BOUNDS = {
    "API_TOKEN_CACHE_S": "1",
    "SNAPSHOT_MAX_AGE_S": "2",
    "DB_RETRY_S": "0.5",
    "DB_CONNECT_TIMEOUT_S": "2",
}
LONG_PROMPT = {"origin": "pd-a", "prompt_tokens": 60_000}


@pytest.fixture
def tokens(transactional_db: None, route_state_clean: None) -> dict[str, str]:
    pd_prfaas_fleet(
        "pd-a",
        "prfaas-x",
        h20_prefill_seconds=[[1024, 0.9], [8192, 2.4], [32768, 7.5], [131072, 36.0]],
    )
    return {
        "router": api_token("router")[1],
        "agent": api_token("agent")[1],
        "unseen": api_token("router")[1],
    }


@contextmanager
def database_refused() -> Iterator[None]:
    """The app's database refuses connections and its sessions end, until the block exits."""
    db = connection.settings_dict
    name = db["NAME"]
    connection.close()  # this test's own session is one of them
    admin = psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", autocommit=True
    )
    try:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        yield
    finally:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        admin.close()


def telemetry_post(http: httpx.Client, agent: str) -> httpx.Response:
    ts = time.time()
    names = ["pd-a-p0", "pd-a-p1", "pd-a-d0", "pd-a-d1", "prfaas-x-p0", "prfaas-x-p1"]
    body = {
        "idempotency_key": f"outage-{ts}",
        "instances": [{"instance": n, "ts": ts} for n in names],
        "links": [
            {
                "source": "prfaas-x",
                "target": "pd-a",
                "ts": ts,
                "bytes_sent": 125_000_000,
                "interval_s": 1.0,
            }
        ],
    }
    return http.post("/api/v1/telemetry", json=body, headers=bearer(agent))


def both_doors(http: httpx.Client, router: str) -> list[httpx.Response]:
    """The fast path (``Bearer``) and Django's ninja operation (any other spelling)."""
    return [
        http.post("/api/v1/route", json=LONG_PROMPT, headers=bearer(router)),
        http.post("/api/v1/route", json=LONG_PROMPT, headers={"Authorization": f"bearer {router}"}),
    ]


def wait_until(check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_route_answers_from_its_snapshot_through_a_database_outage_and_recovers(
    tokens: dict[str, str], settings: Any
) -> None:
    served = control_plane_serve(
        connection.settings_dict, settings.REDIS_URL, extra_env=SHORT_BOUNDS
    )
    with served as (base, _), httpx.Client(base_url=base, timeout=10) as http:
        assert telemetry_post(http, tokens["agent"]).status_code == 200
        for r in both_doors(http, tokens["router"]):
            assert r.status_code == 200, r.text
            assert (r.json()["route"], r.json()["stale"]) == ("prfaas", False)
        assert http.get("/api/v1/health").status_code == 200

        with database_refused():
            started = time.monotonic()
            answers: list[dict[str, Any]] = []
            # Past the credential cache (1 s) and the snapshot bound (2 s), twice over.
            while time.monotonic() - started < 5.0:
                # Agents keep reporting (their tokens are cached too): live state stays fresh,
                # so what makes answers stale below is the snapshot's age alone.
                ingest = telemetry_post(http, tokens["agent"])
                assert ingest.status_code == 200, ingest.text
                for r in both_doors(http, tokens["router"]):
                    assert r.status_code == 200, r.text
                    answers.append(r.json())
                policy = http.get("/api/v1/policy", headers=bearer(tokens["router"]))
                assert policy.status_code == 200, policy.text
                time.sleep(0.2)
            ready = http.get("/api/v1/health")
            live = http.get("/api/v1/health/live")
            unseen = http.post("/api/v1/route", json=LONG_PROMPT, headers=bearer(tokens["unseen"]))

        young = [a for a in answers if a["snapshot_age_s"] <= 2.0]
        old = [a for a in answers if a["snapshot_age_s"] > 2.0]
        assert young and old
        assert not any(a["stale"] for a in young) and all(a["stale"] for a in old)
        assert not any(a["reason"] == "telemetry_stale" for a in answers)
        assert all(a["policy_version"] == answers[0]["policy_version"] for a in answers)
        assert ready.status_code == 503
        assert ready.json()["status"] == "degraded"
        assert ready.json()["dependencies"]["database"]["up"] is False
        assert ready.json()["dependencies"]["redis"]["up"] is True
        assert live.status_code == 200
        # A credential never seen cannot be checked meanwhile: 503 in the one error shape.
        assert unseen.status_code == 503
        assert unseen.json()["code"] == "database_unavailable"

        # Access is back: readiness and fresh answers return by themselves.
        assert wait_until(lambda: http.get("/api/v1/health").status_code == 200, 20)
        fresh = wait_until(
            lambda: (
                telemetry_post(http, tokens["agent"]).status_code == 200
                and all(not r.json()["stale"] for r in both_doors(http, tokens["router"]))
            ),
            20,
        )
        assert fresh
        assert (
            http.post(
                "/api/v1/route", json=LONG_PROMPT, headers=bearer(tokens["unseen"])
            ).status_code
            == 200
        )


def test_route_answers_through_a_redis_outage_and_readiness_says_so(
    tokens: dict[str, str], own_redis: RedisServer
) -> None:
    redis_url = own_redis.url
    served = control_plane_serve(connection.settings_dict, redis_url, extra_env=SHORT_BOUNDS)
    with served as (base, _), httpx.Client(base_url=base, timeout=10) as http:
        assert telemetry_post(http, tokens["agent"]).status_code == 200
        assert both_doors(http, tokens["router"])[0].json()["reason"] == "above_threshold"

        own_redis.stop()
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            for r in both_doors(http, tokens["router"]):
                assert r.status_code == 200, r.text
                assert (r.json()["reason"], r.json()["stale"]) == ("telemetry_stale", True)
            time.sleep(0.2)
        ready = http.get("/api/v1/health")
        assert ready.status_code == 503
        deps = ready.json()["dependencies"]
        assert (deps["redis"]["up"], deps["broker"]["up"], deps["database"]["up"]) == (
            False,
            False,
            True,
        )

        own_redis.start()
        assert wait_until(lambda: http.get("/api/v1/health").status_code == 200, 20)
        assert wait_until(lambda: telemetry_post(http, tokens["agent"]).status_code == 200, 10)
        got = wait_until(
            lambda: both_doors(http, tokens["router"])[0].json()["reason"] == "above_threshold", 10
        )
        assert got
