"""No server of ours outlives what started it: manage.py's embedded Redis lives exactly as long
as the command (also when it fails or is terminated), and importing the settings starts none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
SLEEPER = "import time; print('up', flush=True); time.sleep(120)"


def _servers_of(var_dir: Path) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "redis-server" in " ".join(proc.info["cmdline"] or []) and str(var_dir) in " ".join(
                proc.info["cmdline"] or []
            ):
                out.append(proc)
        except psutil.NoSuchProcess:
            continue
    return out


def _env(var_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "DATABASE_URL"}}
    env["VAR_DIR"] = str(var_dir)
    return env


def manage(var_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=_env(var_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_command_gets_an_embedded_redis_for_its_lifetime_and_stops_it(tmp_path: Path) -> None:
    probe = (
        "from controlplane.redis_connection import redis_sync; from django.conf import settings;"
        "print(redis_sync().ping(), settings.REDIS_URL)"
    )
    result = manage(tmp_path, "shell", "--no-imports", "-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", f"unix://{tmp_path}/redis.sock"]
    assert _servers_of(tmp_path) == []
    assert not (tmp_path / "redis.sock").exists()


def test_a_failing_command_stops_its_redis_too(tmp_path: Path) -> None:
    result = manage(tmp_path, "topology", "apply", str(tmp_path / "missing.yaml"))
    assert result.returncode != 0
    assert _servers_of(tmp_path) == []


def test_a_terminated_command_stops_its_redis(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "shell",
            "--no-imports",
            "-c",
            SLEEPER,
        ],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert len(_servers_of(tmp_path)) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while _servers_of(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _servers_of(tmp_path) == []
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_killed_command_takes_its_redis_down_with_it(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup in manage.py: the server itself follows its parent out."""
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", SLEEPER],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    assert len(_servers_of(tmp_path)) == 1
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _servers_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _servers_of(tmp_path) == []


@pytest.mark.parametrize("command", [["check"], ["plan", "--help"]])
def test_commands_that_need_no_redis_start_none(tmp_path: Path, command: list[str]) -> None:
    result = subprocess.Popen(
        [sys.executable, "manage.py", *command],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen = []
    while result.poll() is None:
        seen += _servers_of(tmp_path)
        time.sleep(0.05)
    assert result.returncode == 0
    assert seen == []
