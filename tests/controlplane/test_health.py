"""Readiness tells the truth per dependency; liveness needs none of them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.django_db


def test_readiness_reports_every_dependency_up(client: Any, redis_client: Any) -> None:
    response = client.get("/api/v1/health")
    assert response.status_code == 200
    deps = response.json()["dependencies"]
    assert {name: dep["up"] for name, dep in deps.items()} == {
        "database": True,
        "redis": True,
        "broker": True,
    }


def test_readiness_names_redis_down_and_liveness_still_answers(client: Any, settings: Any) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings.REDIS_URL = settings.CELERY_BROKER_URL = dead
    response = client.get("/api/v1/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "degraded"
    assert body["dependencies"]["redis"] == {
        "up": False,
        "latency_ms": body["dependencies"]["redis"]["latency_ms"],
        "detail": "ConnectionError",
    }
    assert body["dependencies"]["database"]["up"] is True
    assert client.get("/api/v1/health/live").status_code == 200
