"""Start one real vLLM server (CPU) for a test, and clean up after it.

Contract: ``with vllm_server(env, port=..., kv_events_port=...) as server:`` starts
``python -m vllm.entrypoints.openai.api_server`` from the cached venv (:mod:`tests.engines.vllm_env`)
in its own process group, waits until ``/health`` answers (bounded by ``startup_timeout_s``;
on time-out or early exit it raises :class:`VllmStartError` with the log's tail), and on exit
kills the process group (TERM, then KILL) and removes its cache and temp directories. Extra CLI
arguments (``--kv-transfer-config ...``) and environment variables are passed through, so a
prefill/decode pair is two of these. The recipe (``--enforce-eager``, block size 32, 64 MiB of
KV cache) is the one measured in tests/fixtures/vllm-0.32-cpu/SOURCE.md.

Ports: vLLM needs ports below 32768 here (the ephemeral range starts there); callers pass
ports from their assigned range.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.engines.vllm_env import OFFLINE_ENV, VllmEnv

DEFAULT_STARTUP_TIMEOUT_S = 240.0  # 36-58 s measured with --enforce-eager; 4x for a busy box
BLOCK_SIZE = 32  # the CPU backend refuses 16 (must be a multiple of 32)
SERVED_MODEL = "tiny"


def low_free_ports(n: int, base: int | None = None) -> list[int]:
    """``n`` ports free now, at or above ``base`` (``PRFAAS_ENGINE_PORT_BASE``, default 21000)
    and below 32768, where vLLM binds reliably here (the ephemeral range starts at 32768)."""
    start = base if base is not None else int(os.environ.get("PRFAAS_ENGINE_PORT_BASE", "21000"))
    out: list[int] = []
    for port in range(start, 32768):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError(f"no {n} free ports in [{start}, 32768)")


class VllmStartError(RuntimeError):
    """vLLM did not become healthy (the message carries its log's tail)."""


@dataclass
class VllmServer:
    """A running server: its URLs, ports and log, for the test to use."""

    port: int
    kv_events_port: int | None
    replay_port: int | None
    log_path: Path
    process: subprocess.Popen[bytes]
    model: str = SERVED_MODEL
    block_size: int = BLOCK_SIZE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def complete(self, prompt: str | list[int], max_tokens: int = 4, **extra: Any) -> Any:
        """One /v1/completions call (temperature 0); returns the JSON answer."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def tokenize(self, prompt: str) -> list[int]:
        response = httpx.post(
            f"{self.url}/tokenize", json={"model": self.model, "prompt": prompt}, timeout=30
        )
        response.raise_for_status()
        return list(response.json()["tokens"])


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def engine_cpu() -> int | None:
    """The core vLLM runs on: the last one this process may use (None on a single core).
    ``PRFAAS_ENGINE_CPU`` overrides it; ``PRFAAS_ENGINE_CPU=all`` leaves vLLM unpinned."""
    chosen = os.environ.get("PRFAAS_ENGINE_CPU", "")
    allowed = sorted(os.sched_getaffinity(0))
    if chosen == "all" or len(allowed) < 2:
        return None
    if chosen:
        if not chosen.isdigit() or int(chosen) not in allowed:
            raise ValueError(f"PRFAAS_ENGINE_CPU={chosen!r}: not one of the cores {allowed}")
        return int(chosen)
    return allowed[-1]


def vllm_argv(
    env: VllmEnv,
    *,
    port: int,
    kv_events_port: int | None = None,
    replay_port: int | None = None,
    extra_args: Sequence[str] = (),
    kv_cache_bytes: str = "64M",
    block_size: int = BLOCK_SIZE,
) -> list[str]:
    """The command line of one vLLM server with prefix caching (and KV events over ZMQ when a
    port is given), in the measured recipe."""
    argv = [
        str(env.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(env.model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        kv_cache_bytes,
        "--enable-prompt-tokens-details",
    ]
    if kv_events_port is not None:
        config: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # the endpoint must contain '*' for vLLM to bind (else it connects)
            "endpoint": f"tcp://*:{kv_events_port}",
            "topic": "kv-events",
        }
        if replay_port is not None:
            config["replay_endpoint"] = f"tcp://*:{replay_port}"
        argv += ["--kv-events-config", json.dumps(config)]
    return argv + list(extra_args)


def vllm_env_vars(work: Path, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a vLLM server runs in: offline, its caches and temp files under
    ``work``, one compute thread, none of the test process's interpreter settings."""
    tmp = work / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        **OFFLINE_ENV,
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
        # vLLM and torch write torchinductor_*, vllm_dist_* under the temp dir: keep them ours
        "TMPDIR": str(tmp),
        "HOME": str(work),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # One compute thread (see engine_cpu below for where it runs).
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    # The test process's own interpreter settings must not leak into vLLM's.
    for name in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV"):
        child_env.pop(name, None)
    return child_env


@contextlib.contextmanager
def vllm_server(
    env: VllmEnv,
    *,
    port: int,
    kv_events_port: int | None = None,
    replay_port: int | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    kv_cache_bytes: str = "64M",
    block_size: int = BLOCK_SIZE,
) -> Iterator[VllmServer]:
    """One vLLM server with prefix caching (and KV events over ZMQ when a port is given)."""
    work = Path(tempfile.mkdtemp(prefix=f"vllm-{port}-"))
    argv = vllm_argv(
        env,
        port=port,
        kv_events_port=kv_events_port,
        replay_port=replay_port,
        extra_args=extra_args,
        kv_cache_bytes=kv_cache_bytes,
        block_size=block_size,
    )
    child_env = vllm_env_vars(work, extra_env)
    log_path = work / "vllm.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed in the finally below)
    cpu = engine_cpu()
    proc = subprocess.Popen(
        argv,
        # vLLM's engine process spins (sched_yield) on its worker's queue while it serves and
        # its worker computes, so by default the tiny model held both cores of a 2-core
        # machine under load: the control plane, the agent and vLLM's own API server (which
        # updates the /metrics gauges) stalled for seconds. Pinned to one core, the spinner
        # yields to its own processes and the rest of the test keeps the other cores.
        preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env,
        cwd=work,
        start_new_session=True,  # its own process group: the engine core is a child process
    )
    server = VllmServer(port, kv_events_port, replay_port, log_path, proc, block_size=block_size)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise VllmStartError(
                    f"vLLM exited with {proc.returncode} during start-up:\n{server.log_tail()}"
                )
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VllmStartError(
                    f"vLLM not healthy after {startup_timeout_s:.0f} s:\n{server.log_tail()}"
                )
            time.sleep(1.0)
        server.extra["startup_s"] = startup_timeout_s - (deadline - time.monotonic())
        yield server
    finally:
        _kill_group(proc)
        log.close()
        if os.environ.get("PRFAAS_KEEP_VLLM_LOGS"):
            print(f"vLLM log kept at {log_path}")
        else:
            shutil.rmtree(work, ignore_errors=True)
