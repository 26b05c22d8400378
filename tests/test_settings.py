import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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
    assert response.json()["status"] == "ok"
    assert client.get("/api/v1/health/live").json() == {"status": "ok"}


def test_cached_credentials_outlive_a_five_minute_database_outage_by_default() -> None:
    assert settings.API_TOKEN_OUTAGE_S >= 300


SETTINGS_FILE = Path(settings.BASE_DIR) / "controlplane" / "settings.py"


def _settings_variables() -> set[str]:
    source = SETTINGS_FILE.read_text()
    return set(re.findall(r'(?:env_\w+|os\.environ\.get)\(\s*"([A-Z][A-Z0-9_]+)"', source))


def _settings_in_a_process(**env: str) -> subprocess.CompletedProcess[str]:
    """Import the settings in a fresh interpreter with ``env`` (and nothing of ours set)."""
    clean = {k: v for k, v in os.environ.items() if k not in _settings_variables()}
    clean.update(env, VAR_DIR=env.get("VAR_DIR", tempfile.mkdtemp(prefix="settings-")))
    return subprocess.run(
        [sys.executable, "-c", "import controlplane.settings as s; print(s.REDIS_URL)"],
        cwd=settings.BASE_DIR,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DEBUG", "maybe", "DEBUG='maybe': expected one of 1/true/yes/on or 0/false/no/off"),
        ("PRODUCTION", "ture", "PRODUCTION='ture'"),
        ("REBALANCE_INTERVAL_S", "ten", "REBALANCE_INTERVAL_S='ten': expected an integer"),
        ("REBALANCE_INTERVAL_S", "0", "REBALANCE_INTERVAL_S='0': must be between 10 and"),
        ("API_TOKEN_CACHE_S", "nan", "API_TOKEN_CACHE_S='nan': must be between 0 and 3600"),
        ("API_MAX_BODY_BYTES", "-1", "API_MAX_BODY_BYTES='-1': must be between"),
        ("LOG_LEVEL", "LOUD", "LOG_LEVEL='LOUD'"),
    ],
)
def test_a_bad_setting_stops_the_process_naming_the_variable(
    name: str, value: str, message: str
) -> None:
    result = _settings_in_a_process(**{name: value})
    assert result.returncode != 0
    assert message in result.stderr


def test_importing_the_settings_starts_no_server() -> None:
    var = tempfile.mkdtemp(prefix="settings-")
    result = _settings_in_a_process(VAR_DIR=var)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"unix://{var}/redis.sock"
    assert not (Path(var) / "redis.sock").exists()
