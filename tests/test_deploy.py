"""Deployment files: the compose file validates, .env.example lists every setting, and the
production settings pass ``manage.py check --deploy``."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
ONE_SHOT = {"migrate", "demo-setup"}


def compose_command() -> list[str]:
    """``docker compose`` when the v2 plugin exists, else ``docker-compose`` (v1)."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is not None:
        return [legacy]
    pytest.fail(
        "neither `docker compose` nor `docker-compose` is installed (make system-deps)",
        pytrace=False,
    )


def settings_variables() -> set[str]:
    """Every environment variable controlplane/settings.py reads (itself or through the
    embedded-Redis module it takes VAR_DIR from)."""
    source = (ROOT / "controlplane" / "settings.py").read_text()
    source += (ROOT / "controlplane" / "embedded_redis.py").read_text()
    names = set(re.findall(r"os\.environ(?:\.get)?[\(\[]\s*\"([A-Z][A-Z0-9_]*)\"", source))
    names |= set(re.findall(r"env_(?:bool|int|number|list|str)\(\s*\"([A-Z][A-Z0-9_]*)\"", source))
    if "dj_database_url.config(" in source:
        names.add("DATABASE_URL")  # dj_database_url reads it
    return names


def env_example() -> dict[str, str]:
    """Variables of .env.example, each with the comment block above it."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.startswith("#"):
            block.append(line.lstrip("# ").strip())
        elif "=" in line:
            name = line.split("=", 1)[0].strip()
            comments[name] = " ".join(b for b in block if b and not b.startswith("---"))
            block = []
        else:
            block = []
    return comments


def compose_file() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_the_settings_reader_finds_the_variables_it_should() -> None:
    found = settings_variables()
    assert {"SECRET_KEY", "PRODUCTION", "REDIS_URL", "DATABASE_URL", "VAR_DIR"} <= found


def test_env_example_lists_every_setting_with_a_comment() -> None:
    listed = env_example()
    missing = settings_variables() - set(listed)
    assert not missing, f".env.example does not list {sorted(missing)}"
    uncommented = [name for name, comment in listed.items() if not comment]
    assert not uncommented, f"variables without a comment: {uncommented}"


def test_env_example_leaves_the_secret_key_empty_and_production_on() -> None:
    values = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    )
    assert values["SECRET_KEY"] == ""
    assert values["PRODUCTION"] == "true"
    assert values["DEBUG"] == "false"


def _deploy_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {"DEBUG", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "DJANGO_SETTINGS_MODULE"}
    }
    env.update(
        PRODUCTION="true",
        SECRET_KEY=secrets.token_urlsafe(50),
        ALLOWED_HOSTS="cp.example.com",
        VAR_DIR=str(tmp_path),
        REDIS_URL=settings.REDIS_URL,
    )
    env.update(extra)
    return env


def test_production_settings_pass_check_deploy(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=_deploy_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_without_a_secret_key_refuses_to_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=_deploy_env(tmp_path, SECRET_KEY=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_development_settings_fail_check_deploy(tmp_path: Path) -> None:
    env = _deploy_env(tmp_path, PRODUCTION="false")
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "SESSION_COOKIE_SECURE" in result.stdout + result.stderr


@pytest.mark.parametrize(
    "profile",
    [[], ["--profile", "demo"], ["--profile", "agent"], ["--profile", "gateway"]],
    ids=["default", "demo", "agent", "gateway"],
)
def test_compose_file_validates(profile: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECRET_KEY", "COMPOSE_"))}
    result = subprocess.run(
        [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), *profile, "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_compose_mounts_nothing_from_outside_the_repository() -> None:
    """A clone alone runs the stack: every bind mount of every profile is inside the
    repository (the image carries scenarios/ and traces/; named volumes hold state)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECRET_KEY", "COMPOSE_"))}
    profiles = ["--profile", "demo", "--profile", "agent", "--profile", "gateway"]
    result = subprocess.run(
        [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), *profiles, "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    binds = [
        (name, mount.split(":", 1)[0])
        for name, service in services.items()
        for mount in service.get("volumes", [])
        if isinstance(mount, str) and mount.startswith(("/", "."))
    ]
    assert binds, "expected the agent's and the gateway's config files to be mounted"
    outside = [(name, source) for name, source in binds if not Path(source).is_relative_to(ROOT)]
    assert not outside, outside
    assert all(
        service["build"]["context"] == str(ROOT)
        for service in services.values()
        if "build" in service
    )


def test_the_image_carries_the_scenarios_and_traces() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"scenarios", "traces", "scenarios/", "traces/"} & set(ignored)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY . ." in dockerfile


def test_compose_runs_every_role_and_the_emulator_only_in_the_demo_profile() -> None:
    services = compose_file()["services"]
    assert {"postgres", "redis", "migrate", "web", "worker", "beat", "emulator"} <= set(services)
    assert services["emulator"]["profiles"] == ["demo"]
    assert services["demo-setup"]["profiles"] == ["demo"]
    assert services["agent"]["profiles"] == ["agent"]
    assert services["agent"]["command"][:3] == ["python", "-m", "fleet.agent"]
    for name in ("web", "worker", "beat", "migrate", "postgres", "redis"):
        assert "profiles" not in services[name], name
    assert services["gateway"]["profiles"] == ["gateway"]


def test_every_long_running_compose_service_has_a_health_check() -> None:
    services = compose_file()["services"]
    for name, service in services.items():
        check = service.get("healthcheck", {})
        if name in ONE_SHOT:
            assert service.get("restart") == "no", name
            continue
        assert check.get("test"), f"{name} has no health check"
        assert not check.get("disable"), name


def test_compose_passes_every_setting_to_the_app_containers() -> None:
    services = compose_file()["services"]
    environment = services["web"]["environment"]
    # VAR_DIR is a fixed path inside the image; the rest come from .env.
    missing = settings_variables() - set(environment)
    assert not missing, f"docker-compose.yml does not pass {sorted(missing)}"
    assert environment["SECRET_KEY"] == "${SECRET_KEY:-}"
