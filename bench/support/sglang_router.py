"""sglang-router (the Rust PD router, PyPI ``sglang-router``) in a cached venv of its own, started
in PD mode in front of given prefill and decode workers.

The venv lives at ``${PRFAAS_CACHE_DIR:-$HOME/.cache/prfaas}/bench-sglang-router/`` and is built
once under an exclusive ``flock`` into a temporary sibling, renamed into place and marked usable
by a ``.ready`` file written last (a directory without it is rebuilt). pip, bounded in time.

sglang's PD protocol differs from vLLM's (see docs/gateway.md): the router sends the request to
the prefill and the decode worker *at the same time*, with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` added to the body, and returns the decode answer.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

VERSION = "0.3.2"
INSTALL_TIMEOUT_S = 10 * 60


def cache_root() -> Path:
    return Path(os.environ.get("PRFAAS_CACHE_DIR") or Path.home() / ".cache" / "prfaas")


def router_venv() -> Path:
    """The venv's python, installing ``sglang-router==VERSION`` first if needed."""
    final = cache_root() / "bench-sglang-router"
    python = final / "bin" / "python"
    if (final / ".ready").exists():
        return python
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".bench-sglang-router.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".ready").exists():
            return python
        tmp = final.with_name(final.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        print(f"[bench] installing sglang-router {VERSION} into {final}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=120)
        subprocess.run(
            [str(tmp / "bin" / "pip"), "install", "--quiet", f"sglang-router=={VERSION}"],
            check=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        # venvs hard-code their path: rebuild the scripts' shebangs by re-creating it in place.
        tmp.rename(final)
        subprocess.run([sys.executable, "-m", "venv", "--upgrade", str(final)], check=True)
        (final / ".ready").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    return python


@contextmanager
def router_serve(
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    port: int,
    timeout_s: float = 120.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """sglang-router in PD mode on ``port``: ``prefill`` as (url, bootstrap port), ``decode``
    as urls; waits until it answers ``/health``; stopped (TERM, then KILL) afterwards."""
    python = router_venv()
    argv = [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap in prefill:
        argv += ["--prefill", url] + ([str(bootstrap)] if bootstrap is not None else [])
    for url in decode:
        argv += ["--decode", url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    argv += ["--log-level", "warn"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"sglang-router exited {proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("sglang-router did not become healthy")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
