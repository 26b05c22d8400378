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
  - {source: prfaas-y, target: pd-a, measure: connector, engines: [pd-a-p0]}
```

Read by :mod:`fleet.config_read` (strict types, errors naming the key); the rules between keys
are the Structs' ``__post_init__``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from fleet.agent.register import RegistrationConfig
from fleet.config_read import (
    ConfigError,
    HttpUrl,
    Name,
    Port,
    ZmqEndpoint,
    config_convert,
    config_file_read,
    env_secret,
)

__all__ = [
    "AgentConfig",
    "BufferConfig",
    "ConfigError",
    "ControlPlaneConfig",
    "EngineConfig",
    "KvEventsConfig",
    "LinkConfig",
    "ListenConfig",
]


class ControlPlaneConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the agent posts, and its ``agent``-scope token: ``token`` or the variable."""

    url: HttpUrl
    token: str = ""  # empty: read from the environment variable ``token_env``
    token_env: Name = "PRFAAS_AGENT_TOKEN"

    def token_read(self, env: Mapping[str, str]) -> ControlPlaneConfig:
        """This, with the token from the environment when the file does not hold it."""
        token = env_secret(self.token, self.token_env, "control_plane.token_env", env)
        return msgspec.structs.replace(self, token=token)


class ListenConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 9464  # 0: /metrics not served


class BufferConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_kv_batches: Annotated[int, Meta(gt=0, le=10**7)] = 50_000
    max_telemetry: Annotated[int, Meta(gt=0, le=10**6)] = 600


class KvEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    endpoint: ZmqEndpoint
    replay_endpoint: ZmqEndpoint | None = None
    topic: str = ""
    replay_timeout_s: Annotated[float, Meta(gt=0, le=120)] = 5.0
    max_seq_jump: Annotated[int, Meta(gt=0, le=10**12)] = 100_000


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    instance: Name
    metrics_url: HttpUrl | None = None
    kv_events: KvEventsConfig | None = None
    register: RegistrationConfig | None = None  # fleet.agent.register

    def __post_init__(self) -> None:
        if self.metrics_url is None and self.kv_events is None:
            raise ValueError("give metrics_url, kv_events or both")


class LinkConfig(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    target: str
    measure: Literal["interface", "connector"]
    interface: str | None = None
    engines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.measure == "interface" and not self.interface:
            raise ValueError(".interface: required when measure is interface")
        if self.measure == "connector" and not self.engines:
            raise ValueError(".engines: required when measure is connector")


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    control_plane: ControlPlaneConfig
    engines: Annotated[tuple[EngineConfig, ...], Meta(min_length=1)]
    links: tuple[LinkConfig, ...] = ()
    listen: ListenConfig = ListenConfig()
    buffer: BufferConfig = BufferConfig()
    interval_s: Annotated[float, Meta(gt=0, le=3600)] = 1.0
    flush_s: Annotated[float, Meta(gt=0, le=60)] = 0.05
    register_every_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0

    def __post_init__(self) -> None:
        names: set[str] = set()
        for i, engine in enumerate(self.engines):
            if engine.instance in names:
                raise ValueError(f".engines[{i}].instance: {engine.instance!r} listed twice")
            names.add(engine.instance)
        for i, link in enumerate(self.links):
            unknown = [n for n in link.engines if n not in names]
            if link.measure == "connector" and unknown:
                raise ValueError(
                    f".links[{i}].engines: not among the engines: {', '.join(unknown)}"
                )


def config_parse(raw: object, env: Mapping[str, str] | None = None) -> AgentConfig:
    """The file's document, checked (a key given as null counts as left out), with the token
    read from the environment when the file does not hold it."""
    config = config_convert(raw, AgentConfig, null_is_default=True)
    cp = config.control_plane.token_read(os.environ if env is None else env)
    return msgspec.structs.replace(config, control_plane=cp)


def config_load(path: Path, env: Mapping[str, str] | None = None) -> AgentConfig:
    return config_parse(config_file_read(path), env)
