"""Set-up steps the benches share: a free local port, a ``manage.py`` command that must work."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def manage(env: dict[str, str], *args: str) -> str:
    """``manage.py ARGS`` in ``env``; its output, or the bench stops with its error."""
    done = subprocess.run(
        [PY, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"manage.py {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout.strip()


def bench_token(env: dict[str, str], *scopes: str) -> str:
    """A fleet-wide API token with ``scopes`` (agent tokens must be bound to instances or be
    fleet-wide); its secret."""
    args = ["token", "create", "--name", "bench"]
    for scope in scopes:
        args += ["--scope", scope]
    return manage(env, *args, "--fleet-wide")
