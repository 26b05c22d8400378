"""The curl examples of docs/api.md, run as written against a live server.

The server is the demo stack without its emulator and workers (the case-study inventory, its
own VAR_DIR, port, database and Redis db); ``$TOKEN`` comes from the command the document
gives, ``$BASE`` is the server's address. Every example must answer 2xx.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from django.conf import settings

from tests.demo_support import services_env
from tests.support.servers import free_port

ROOT = Path(settings.BASE_DIR)
DOC = ROOT / "docs" / "api.md"
TOKEN_COMMAND = "manage.py token create --name docs-examples"
pytestmark = pytest.mark.timeout(180)


def curl_examples() -> list[str]:
    """Every ```bash block of the document: each one curl command."""
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)]


def test_the_document_has_curl_examples_for_each_endpoint_family() -> None:
    examples = curl_examples()
    assert all(e.startswith("curl ") for e in examples), examples
    joined = "\n".join(examples)
    for path in (
        "/api/v1/route ",
        "/api/v1/route/batch",
        "/api/v1/policy",
        "/api/v1/telemetry",
        "/api/v1/kv-events",
        "/api/v1/registrations/",
        "/api/v1/decisions/recent",
        "/api/v1/health",
    ):
        assert path in joined, path
    assert TOKEN_COMMAND in DOC.read_text()


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("docs-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(VAR_DIR=str(tmp / "var"), PYTHONUNBUFFERED="1")
    env.pop("PRODUCTION", None)
    env = services_env(env, "docs", (13, 12))
    log = tmp / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "demo",
                "--port",
                str(port),
                "--no-emulator",
                "--no-workers",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/api/v1/health", timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, env
    finally:
        family = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        for child in family:
            if child.is_running():
                child.kill()


def test_every_curl_example_answers_2xx_against_a_docs_server(
    docs_server: tuple[str, dict[str, str]],
) -> None:
    base, env = docs_server
    created = subprocess.run(
        [
            sys.executable,
            *TOKEN_COMMAND.split(),
            "--scope",
            "router",
            "--scope",
            "agent",
            "--scope",
            "register",
            "--scope",
            "read",
            "--fleet-wide",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    examples = curl_examples()
    assert len(examples) >= 8
    # Each example runs as written; a wrapper adds the status as the last line of output.
    wrapper = "curl() { command curl -w '\\n%{http_code}\\n' \"$@\"; }\n"
    for example in examples:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", wrapper + example],
            env={**env, "BASE": base, "TOKEN": token},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, f"{example}\n{result.stderr}"
        status = result.stdout.strip().splitlines()[-1]
        assert status.startswith("2"), f"{example}\n-> {status}\n{result.stdout[-1500:]}"


def test_a_documented_example_without_its_token_is_refused(
    docs_server: tuple[str, dict[str, str]],
) -> None:
    base, _ = docs_server
    response = httpx.post(
        base + "/api/v1/route", json={"origin": "pd-h20", "prompt_tokens": 24000}, timeout=10
    )
    assert response.status_code == 401
    assert response.json()["code"] == "unauthorized"
