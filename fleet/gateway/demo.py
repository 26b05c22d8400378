"""The gateway in the demo: fake vLLM engines for every instance of the inventory, and the
gateway in front of them, as two more child processes of ``manage.py demo``.

The demo's fleet is emulated (``manage.py emulate`` decides and simulates), and its engines
have no endpoints; so the demo gives every instance a fake engine (:mod:`fleet.fake_engine`,
speaking vLLM's OpenAI API and KV protocols) on a free local port, writes a ``gateway.yaml``
mapping each instance to its engine, and runs the gateway on it: OpenAI clients can then send
requests that are decided by the control plane's policy and carried out by the two steps on
those engines, with outcomes reported back.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import yaml

TOKEN_ENV = "PRFAAS_GATEWAY_TOKEN"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_gateway_commands(
    python: str,
    instances: Sequence[tuple[str, str]],
    origin: str,
    control_plane_url: str,
    host: str,
    port: int,
    var_dir: Path,
) -> dict[str, list[str]]:
    """The ``engines`` and ``gateway`` commands for ``instances`` ((name, role) pairs), with
    the gateway for ``origin`` on ``host:port``; writes ``var_dir/gateway.yaml``."""
    ports = {name: _free_port() for name, _ in instances}
    engines = [python, "-m", "fleet.fake_engine", "--connector", "nixl", "--token-s", "0.02"]
    for name, _role in instances:
        engines += ["--instance", f"{name}:{ports[name]}:kv_both"]
    config = {
        "listen": {"host": host, "port": port},
        "origin": origin,
        "control_plane": {"url": control_plane_url, "token_env": TOKEN_ENV},
        "endpoints": {name: f"http://127.0.0.1:{p}" for name, p in ports.items()},
        "model": "tiny",
    }
    path = var_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return {
        "engines": engines,
        "gateway": [python, "-m", "fleet.gateway", "--config", str(path)],
    }
