"""The supervisor's configuration file (YAML), checked: a bad value is an error naming its key.

```yaml
listen: {host: 127.0.0.1, port: 9470}      # POST /v1/steps (the process actuator), GET /v1/engines
secret_env: PRFAAS_SUPERVISOR_SECRET       # the HMAC secret (the cluster's actuator secret)
control_plane: {url: http://controlplane:8000, token_env: PRFAAS_AGENT_TOKEN}
work_dir: /var/lib/prfaas-supervisor       # logs, the agents' configs, the engines' roles
agent: {interval_s: 1.0, register_every_s: 5}   # more keys of each engine's agent.yaml
engines:
  - instance: pd-a-0
    cluster: pd-a
    role: decode                           # the role at first start (then the last flip's)
    accelerator: H20
    kv_connector: shared_storage           # nixl | shared_storage (the cluster's)
    engine: vllm
    host: 127.0.0.1
    port: 8100                             # {port} in the command
    command: [python, -m, vllm.entrypoints.openai.api_server, --port, "{port}", ...]
    # vLLM's --kv-transfer-config, appended with kv_role set from the role:
    kv_transfer_config: {kv_connector: ExampleConnector, kv_connector_extra_config: {...}}
    kv_roles: {prefill: kv_producer, decode: kv_consumer}   # the default
    kv_events: {endpoint: tcp://127.0.0.1:5557, replay_endpoint: tcp://127.0.0.1:5558}
    env: {OMP_NUM_THREADS: "1", PYTHONPATH: null}           # null removes a variable
    cpus: [3]                              # pinned to these cores (optional)
    cwd: /var/lib/prfaas-supervisor/pd-a-0 # the engine's working directory (optional)
    startup_timeout_s: 300
```

Placeholders in ``command``: ``{port}``, ``{instance}``, ``{role}``, ``{kv_role}``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLES = ("prefill", "decode")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


class ConfigError(ValueError):
    """The message names the key path and what is wrong."""


@dataclass(frozen=True)
class SupervisedEngine:
    instance: str
    cluster: str
    role: str
    accelerator: str
    port: int
    command: tuple[str, ...]
    kv_connector: str = "nixl"
    engine: str = "vllm"
    host: str = "127.0.0.1"
    kv_transfer_config: Mapping[str, Any] | None = None
    kv_roles: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_KV_ROLES))
    kv_events: Mapping[str, Any] | None = None
    env: Mapping[str, str | None] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    startup_timeout_s: float = 300.0
    cwd: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class SupervisorConfig:
    secret: str
    control_plane_url: str
    token: str
    engines: tuple[SupervisedEngine, ...]
    work_dir: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 9470
    agent: Mapping[str, Any] = field(default_factory=dict)

    def engine(self, instance: str) -> SupervisedEngine | None:
        return next((e for e in self.engines if e.instance == instance), None)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    return value


def _str(m: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = m.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}{key}: a non-empty string is required")
    return value


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{where}: a port in [0, 65535]")
    return value


def _env_secret(m: Mapping[str, Any], key: str, env_key: str, default_env: str, where: str,
                env: Mapping[str, str]) -> str:  # fmt: skip
    if isinstance(m.get(key), str) and m[key]:
        return str(m[key])
    name = m.get(env_key, default_env)
    value = env.get(str(name), "")
    if not value:
        raise ConfigError(f"{where}{env_key}: environment variable {name} is not set")
    return value


def _engine(raw: Any, where: str) -> SupervisedEngine:
    e = _mapping(raw, where.rstrip("."))
    role = _str(e, "role", where)
    if role not in ROLES:
        raise ConfigError(f"{where}role: prefill or decode, not {role!r}")
    command = e.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise ConfigError(f"{where}command: a non-empty list of strings")
    kv_roles = dict(DEFAULT_KV_ROLES)
    for r, kv in _mapping(e.get("kv_roles", {}), f"{where}kv_roles").items():
        if r not in ROLES or kv not in KV_ROLES:
            raise ConfigError(f"{where}kv_roles: {r}: {kv} is not a role and a vLLM kv_role")
        kv_roles[r] = kv
    transfer = e.get("kv_transfer_config")
    if transfer is not None:
        _mapping(transfer, f"{where}kv_transfer_config")
    kv_events = e.get("kv_events")
    if kv_events is not None:
        _str(_mapping(kv_events, f"{where}kv_events"), "endpoint", f"{where}kv_events.")
    env = _mapping(e.get("env", {}), f"{where}env")
    if not all(isinstance(v, str) or v is None for v in env.values()):
        raise ConfigError(f"{where}env: values are strings (or null to remove a variable)")
    cpus = e.get("cpus", [])
    if not isinstance(cpus, list) or not all(isinstance(c, int) and c >= 0 for c in cpus):
        raise ConfigError(f"{where}cpus: a list of core numbers")
    timeout = e.get("startup_timeout_s", 300.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
        raise ConfigError(f"{where}startup_timeout_s: seconds in (0, 3600]")
    connector = e.get("kv_connector", "nixl")
    if connector not in ("nixl", "shared_storage"):
        raise ConfigError(f"{where}kv_connector: nixl or shared_storage, not {connector!r}")
    return SupervisedEngine(
        instance=_str(e, "instance", where),
        cluster=_str(e, "cluster", where),
        role=role,
        accelerator=_str(e, "accelerator", where),
        port=_port(e.get("port"), f"{where}port"),
        command=tuple(command),
        kv_connector=connector,
        engine=_str(e, "engine", where, "vllm"),
        host=_str(e, "host", where, "127.0.0.1"),
        kv_transfer_config=dict(transfer) if transfer is not None else None,
        kv_roles=kv_roles,
        kv_events=dict(kv_events) if kv_events is not None else None,
        env=dict(env),
        cpus=tuple(cpus),
        startup_timeout_s=float(timeout),
        cwd=_str(e, "cwd", where) if e.get("cwd") is not None else None,
    )


def config_parse(raw: Any, env: Mapping[str, str] | None = None) -> SupervisorConfig:
    env = os.environ if env is None else env
    root = _mapping(raw, "config")
    cp = _mapping(root.get("control_plane"), "control_plane")
    url = _str(cp, "url", "control_plane.")
    if not url.startswith(("http://", "https://")):
        raise ConfigError("control_plane.url: must start with http:// or https://")
    token = _env_secret(cp, "token", "token_env", "PRFAAS_AGENT_TOKEN", "control_plane.", env)
    secret = _env_secret(root, "secret", "secret_env", "PRFAAS_SUPERVISOR_SECRET", "", env)
    listen = _mapping(root.get("listen", {}), "listen")
    raw_engines = root.get("engines")
    if not isinstance(raw_engines, list) or not raw_engines:
        raise ConfigError("engines: at least one engine")
    engines = tuple(_engine(item, f"engines[{i}].") for i, item in enumerate(raw_engines))
    names = [e.instance for e in engines]
    if len(set(names)) != len(names):
        raise ConfigError("engines: an instance is listed twice")
    return SupervisorConfig(
        secret=secret,
        control_plane_url=url,
        token=token,
        engines=engines,
        work_dir=Path(_str(root, "work_dir", "")),
        listen_host=_str(listen, "host", "listen.", "127.0.0.1"),
        listen_port=_port(listen.get("port", 9470), "listen.port"),
        agent=dict(_mapping(root.get("agent", {}), "agent")),
    )


def config_load(path: Path, env: Mapping[str, str] | None = None) -> SupervisorConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({exc})") from None
    return config_parse(raw, env)
