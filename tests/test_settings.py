import os

import pytest
import redis
from django.conf import settings
from django.db import connection


def test_ci_runs_on_postgresql() -> None:
    if os.environ.get("CI") != "true":
        pytest.skip("only CI is required to run on PostgreSQL")
    assert connection.vendor == "postgresql"


def test_redis_answers_on_the_configured_url() -> None:
    assert redis.Redis.from_url(settings.REDIS_URL).ping() is True


@pytest.mark.django_db
def test_health_endpoint_answers(client) -> None:
    response = client.get("/api/v1/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
