"""Start fake engines and a gateway as child processes (for tests, benches and the demo),
wait until they answer, and stop them by their process id when done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f} s")


def process_stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


@contextmanager
def fake_engines_serve(
    instances: Sequence[tuple[str, int, str]],
    *,
    connector: str = "nixl",
    storage: str = "",
    token_s: float = 0.0,
    prefill_s_per_1k: float = 0.0,
    block_size: int = 32,
    max_model_len: int = 8192,
    server: str = "uvicorn",
    python: str = sys.executable,
    timeout_s: float = 30.0,
) -> Iterator[tuple[dict[str, str], subprocess.Popen[bytes]]]:
    """``instances``: (name, port, kv_role). Yields {name: base URL} and the process."""
    argv = [python, "-m", "fleet.fake_engine", "--connector", connector]
    for name, port, role in instances:
        argv += ["--instance", f"{name}:{port}:{role}"]
    if storage:
        argv += ["--storage", storage]
    argv += [
        "--token-s",
        str(token_s),
        "--prefill-s-per-1k",
        str(prefill_s_per_1k),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--server",
        server,
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    urls = {name: f"http://127.0.0.1:{port}" for name, port, _ in instances}
    try:
        for name, url in urls.items():
            _wait_http(url + "/health", proc, timeout_s, f"fake engine {name}")
        yield urls, proc
    finally:
        process_stop(proc)


@contextmanager
def gateway_serve(
    config_path: str | Path,
    port: int,
    env: Mapping[str, str],
    *,
    python: str = sys.executable,
    timeout_s: float = 60.0,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m fleet.gateway --config config_path`` listening on ``port`` (the file says
    so); yields its base URL once ``/health`` answers 200."""
    proc = subprocess.Popen(
        [python, "-m", "fleet.gateway", "--config", str(config_path)],
        cwd=ROOT,
        env={**os.environ, **env},
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(base + "/health", proc, timeout_s, "gateway")
        yield base, proc
    finally:
        process_stop(proc)
