"""``python -m fleet.supervisor`` as its own process, as deployed, for tests: started with its
agents' token and the step secret in its environment, stopped with SIGTERM (it stops its
engines and agents), killed with its process group if it does not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from scheduling.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature,
)
from tests.support.servers import ROOT


class SupervisorProcess:
    def __init__(self, config_path: Path, token: str, secret: str) -> None:
        self.config_path = config_path
        self.token = token
        self.secret = secret
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = config_path.with_suffix(".log")

    def start(self) -> None:
        env = {
            **os.environ,
            "PRFAAS_AGENT_TOKEN": self.token,
            "PRFAAS_SUPERVISOR_SECRET": self.secret,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.supervisor", "--config", str(self.config_path)],
            cwd=ROOT,
            env=env,
            stdout=open(self.log, "ab"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def engines_of(url: str) -> dict[str, dict[str, Any]]:
    """``GET /v1/engines`` by instance (empty while the supervisor does not answer)."""
    try:
        rows = httpx.get(f"{url}/v1/engines", timeout=10).json()
    except httpx.HTTPError:
        return {}
    return {row["instance"]: row for row in rows}


def step_post(
    url: str,
    secret: str,
    step: dict[str, Any],
    *,
    key: str = "",
    at: float | None = None,
    timeout_s: float = 120,
) -> httpx.Response:
    """A plan step signed as the process actuator signs it."""
    body = json.dumps(step).encode()
    stamp = str(int(time.time() if at is None else at))
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: stamp,
        SIGNATURE_HEADER: signature(secret, stamp, body),
    }
    if key:
        headers[IDEMPOTENCY_HEADER] = key
    return httpx.post(f"{url}/v1/steps", content=body, headers=headers, timeout=timeout_s)
