"""The agent's configuration file (YAML), checked: a bad value is an error naming its key.

```yaml
control_plane:
  url: http://controlplane:8000
  token_env: PRFAAS_AGENT_TOKEN     # or token: ... (an ``agent``-scope API token)
listen: {host: 0.0.0.0, port: 9464} # the agent's own /metrics (port 0: not served)
interval_s: 1.0                     # engine scrape and link sample period
flush_s: 0.05                       # KV-event post period
buffer: {max_kv_batches: 50000, max_telemetry: 600}
engines:
  - instance: pd-a-p0               # the instance's name in the inventory
    metrics_url: http://127.0.0.1:8000/metrics
    kv_events:
      endpoint: tcp://127.0.0.1:5557
      replay_endpoint: tcp://127.0.0.1:5558
      topic: kv-events
      replay_timeout_s: 5           # a replay request's answer, to its end marker
      max_seq_jump: 100000          # a longer jump waits for the next frame to confirm it
    register: {cluster: pd-a, role: prefill, accelerator: H20}   # fleet.agent.register
register_every_s: 10                # re-registration (a heartbeat) while the engine answers
links:
  - {source: prfaas-x, target: pd-a, measure: interface, interface: eth1}
  - {source: prfaas-y, target: pd-a, measure: connector, engines: [pd-a-d0]}
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleet.agent.register import RegistrationConfig, RegistrationConfigError, registration_parse


class ConfigError(ValueError):
    """The message names the key path and what is wrong."""


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    replay_timeout_s: float = 5.0
    max_seq_jump: int = 100_000


@dataclass(frozen=True)
class EngineConfig:
    instance: str
    metrics_url: str | None = None
    kv_events: KvEventsConfig | None = None
    register: RegistrationConfig | None = None  # fleet.agent.register


@dataclass(frozen=True)
class LinkConfig:
    source: str
    target: str
    measure: str  # interface | connector
    interface: str | None = None
    engines: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentConfig:
    url: str
    token: str
    engines: tuple[EngineConfig, ...]
    links: tuple[LinkConfig, ...] = ()
    listen_host: str = "127.0.0.1"
    listen_port: int = 9464
    interval_s: float = 1.0
    flush_s: float = 0.05
    max_kv_batches: int = 50_000
    max_telemetry: int = 600
    register_every_s: float = 10.0
    extra: dict[str, Any] = field(default_factory=dict)


def _get(
    m: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if key not in m or m[key] is None:
        if default is ...:
            raise ConfigError(f"{path}{key}: required")
        return default
    value = m[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{path}{key}: expected {_name(kind)}, not a boolean")
    if not isinstance(value, kind):
        raise ConfigError(f"{path}{key}: expected {_name(kind)}, not {type(value).__name__}")
    return value


def _name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _positive(value: float, where: str, upper: float) -> float:
    if not 0 < value <= upper:
        raise ConfigError(f"{where}: must be in (0, {upper:g}], not {value}")
    return float(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    return value


def config_parse(raw: Any, env: Mapping[str, str] | None = None) -> AgentConfig:
    env = os.environ if env is None else env
    root = _mapping(raw, "config")
    cp = _mapping(_get(root, "control_plane", "", dict), "control_plane")
    url = _get(cp, "url", "control_plane.", str)
    if not url.startswith(("http://", "https://")):
        raise ConfigError("control_plane.url: must start with http:// or https://")
    token = _get(cp, "token", "control_plane.", str, None)
    if token is None:
        name = _get(cp, "token_env", "control_plane.", str, "PRFAAS_AGENT_TOKEN")
        token = env.get(name)
        if not token:
            raise ConfigError(f"control_plane.token_env: environment variable {name} is not set")
    listen = _mapping(_get(root, "listen", "", dict, {}), "listen")
    port = _get(listen, "port", "listen.", int, 9464)
    if not 0 <= port <= 65535:
        raise ConfigError(f"listen.port: must be in [0, 65535], not {port}")
    buffer = _mapping(_get(root, "buffer", "", dict, {}), "buffer")
    engines = []
    names: set[str] = set()
    raw_engines = _get(root, "engines", "", list)
    if not raw_engines:
        raise ConfigError("engines: at least one engine")
    for i, item in enumerate(raw_engines):
        where = f"engines[{i}]."
        e = _mapping(item, where.rstrip("."))
        instance = _get(e, "instance", where, str)
        if instance in names:
            raise ConfigError(f"{where}instance: {instance!r} listed twice")
        names.add(instance)
        kv = None
        if e.get("kv_events") is not None:
            k = _mapping(e["kv_events"], f"{where}kv_events")
            endpoint = _get(k, "endpoint", f"{where}kv_events.", str)
            if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{where}kv_events.endpoint: a ZMQ endpoint (tcp://host:port)")
            kv = KvEventsConfig(
                endpoint=endpoint,
                replay_endpoint=_get(k, "replay_endpoint", f"{where}kv_events.", str, None),
                topic=_get(k, "topic", f"{where}kv_events.", str, ""),
                replay_timeout_s=_positive(
                    _get(k, "replay_timeout_s", f"{where}kv_events.", (int, float), 5.0),
                    f"{where}kv_events.replay_timeout_s",
                    120,
                ),
                max_seq_jump=int(
                    _positive(
                        _get(k, "max_seq_jump", f"{where}kv_events.", int, 100_000),
                        f"{where}kv_events.max_seq_jump",
                        10**12,
                    )
                ),
            )
        metrics_url = _get(e, "metrics_url", where, str, None)
        if metrics_url is None and kv is None:
            raise ConfigError(f"{where.rstrip('.')}: give metrics_url, kv_events or both")
        register = None
        if e.get("register") is not None:
            try:
                register = registration_parse(e["register"], f"{where}register")
            except RegistrationConfigError as exc:
                raise ConfigError(str(exc)) from None
        engines.append(EngineConfig(instance, metrics_url, kv, register))
    links = []
    for i, item in enumerate(_get(root, "links", "", list, [])):
        where = f"links[{i}]."
        lk = _mapping(item, where.rstrip("."))
        measure = _get(lk, "measure", where, str)
        if measure not in ("interface", "connector"):
            raise ConfigError(f"{where}measure: interface or connector, not {measure!r}")
        interface = _get(lk, "interface", where, str, None)
        link_engines = tuple(_get(lk, "engines", where, list, []))
        if measure == "interface" and not interface:
            raise ConfigError(f"{where}interface: required when measure is interface")
        if measure == "connector":
            if not link_engines:
                raise ConfigError(f"{where}engines: required when measure is connector")
            unknown = [n for n in link_engines if n not in names]
            if unknown:
                raise ConfigError(f"{where}engines: not among the engines: {', '.join(unknown)}")
        links.append(
            LinkConfig(
                _get(lk, "source", where, str),
                _get(lk, "target", where, str),
                measure,
                interface,
                link_engines,
            )
        )
    return AgentConfig(
        url=url,
        token=token,
        engines=tuple(engines),
        links=tuple(links),
        listen_host=_get(listen, "host", "listen.", str, "127.0.0.1"),
        listen_port=port,
        interval_s=_positive(_get(root, "interval_s", "", (int, float), 1.0), "interval_s", 3600),
        register_every_s=_positive(
            _get(root, "register_every_s", "", (int, float), 10.0), "register_every_s", 3600
        ),
        flush_s=_positive(_get(root, "flush_s", "", (int, float), 0.05), "flush_s", 60),
        max_kv_batches=int(
            _positive(
                _get(buffer, "max_kv_batches", "buffer.", int, 50_000),
                "buffer.max_kv_batches",
                10**7,
            )
        ),
        max_telemetry=int(
            _positive(
                _get(buffer, "max_telemetry", "buffer.", int, 600), "buffer.max_telemetry", 10**6
            )
        ),
    )


def config_load(path: Path, env: Mapping[str, str] | None = None) -> AgentConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({exc})") from None
    return config_parse(raw, env)
