"""One supervised engine and its agent as child processes: the engine's command line for a
role, started in its own process group (the engine's own children go with it), checked healthy,
stopped (TERM, then KILL); the agent's ``agent.yaml`` written for that role, so that the agent
registers the engine in it (:mod:`fleet.agent.register`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import yaml

from fleet.supervisor.config import SupervisedEngine, SupervisorConfig

STOP_GRACE_S = 20.0


def engine_argv(engine: SupervisedEngine, role: str) -> list[str]:
    """The engine's command line as ``role``: placeholders filled, and vLLM's
    ``--kv-transfer-config`` with the role's ``kv_role`` when the engine has one."""
    kv_role = engine.kv_role(role)
    values = {"port": engine.port, "instance": engine.instance, "role": role, "kv_role": kv_role}

    def filled(arg: str) -> str:
        # Only these placeholders: an argument may hold JSON, whose braces are not ours.
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", str(value))
        return arg

    argv = [filled(arg) for arg in engine.command]
    if engine.kv_transfer_config is not None:
        argv += [
            "--kv-transfer-config",
            json.dumps({**engine.kv_transfer_config, "kv_role": kv_role}),
        ]
    return argv


def _env(overrides: Mapping[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float = STOP_GRACE_S) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class EngineProcess:
    """The engine of one instance, in the role it was last started with."""

    def __init__(self, engine: SupervisedEngine, logs: Path) -> None:
        self.engine = engine
        self.log_path = logs / f"{engine.instance}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.role: str = engine.role
        self._log: IO[bytes] | None = None

    def start(self, role: str) -> None:
        self.role = role
        cpus = set(self.engine.cpus)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            engine_argv(self.engine, role),
            env=_env(self.engine.env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.engine.cwd,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.engine.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self) -> float:
        """Seconds until ``/health`` answered; RuntimeError when the engine exits or takes
        longer than its ``startup_timeout_s``."""
        started = time.monotonic()
        deadline = started + self.engine.startup_timeout_s
        while not self.healthy():
            if not self.running():
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"{self.engine.instance} exited with {code}: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.engine.instance} not healthy after {self.engine.startup_timeout_s:g} s"
                )
            time.sleep(0.5)
        return time.monotonic() - started

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        _stop_group(self.proc)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class AgentProcess:
    """``python -m fleet.agent`` beside one engine, configured for the engine's role."""

    def __init__(self, config: SupervisorConfig, engine: SupervisedEngine, work: Path) -> None:
        self.config = config
        self.engine = engine
        self.config_path = work / "agents" / f"{engine.instance}.yaml"
        self.log_path = work / "logs" / f"{engine.instance}-agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def agent_config(self, role: str) -> dict[str, Any]:
        engine = self.engine
        entry: dict[str, Any] = {
            "instance": engine.instance,
            "metrics_url": f"{engine.url}/metrics",
            "register": {
                "cluster": engine.cluster,
                "role": role,
                "accelerator": engine.accelerator,
                "kv_connector": engine.kv_connector,
                "engine": engine.engine,
                "endpoint": engine.url,
            },
        }
        if engine.kv_events is not None:
            entry["kv_events"] = msgspec.to_builtins(engine.kv_events)
        return {
            "listen": {"port": 0},
            **self.config.agent,
            "control_plane": {
                "url": self.config.control_plane.url,
                "token_env": "PRFAAS_AGENT_TOKEN",
            },
            "engines": [entry],
        }

    def start(self, role: str) -> None:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            yaml.safe_dump(msgspec.to_builtins(self.agent_config(role)), sort_keys=False)
        )
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.agent", "--config", str(self.config_path)],
            env={**os.environ, "PRFAAS_AGENT_TOKEN": self.config.control_plane.token},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        _stop_group(self.proc)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
