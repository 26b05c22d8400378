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

Placeholders in ``command``: ``{port}``, ``{instance}``, ``{role}``, ``{kv_role}``. Read by
:mod:`fleet.config_read` (strict types, errors naming the key).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import msgspec
from msgspec import Meta

from fleet.agent.config import ControlPlaneConfig, KvEventsConfig
from fleet.config_read import ConfigError, Name, Port, config_convert, config_file_read, env_secret
from scheduling.core.kinds import InstanceRole, KvConnector

__all__ = ["ConfigError", "ListenConfig", "SupervisedEngine", "SupervisorConfig"]

ROLES = tuple(r.value for r in InstanceRole)
KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]
DEFAULT_KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


class ListenConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: Name = "127.0.0.1"
    port: Port = 9470


class SupervisedEngine(msgspec.Struct, frozen=True, kw_only=True):
    instance: Name
    cluster: Name
    role: InstanceRole
    accelerator: Name
    port: Port
    command: Annotated[tuple[str, ...], Meta(min_length=1)]
    kv_connector: KvConnector = KvConnector.NIXL
    engine: Name = "vllm"
    host: Name = "127.0.0.1"
    kv_transfer_config: dict[str, Any] | None = None
    kv_roles: dict[InstanceRole, KvRole] = {}  # over DEFAULT_KV_ROLES
    kv_events: KvEventsConfig | None = None  # the agent's (fleet.agent.config)
    env: dict[str, str | None] = {}
    cpus: tuple[Annotated[int, Meta(ge=0)], ...] = ()
    startup_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    cwd: Name | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kv_role(self, role: str) -> str:
        """vLLM's ``kv_role`` for the engine in ``role``."""
        given = cast(Mapping[str, str], self.kv_roles)  # read only: Literal keys are str
        return given.get(role) or DEFAULT_KV_ROLES[role]


class SupervisorConfig(msgspec.Struct, frozen=True, kw_only=True):
    control_plane: ControlPlaneConfig  # the agents' (fleet.agent.config)
    engines: Annotated[tuple[SupervisedEngine, ...], Meta(min_length=1)]
    work_dir: Name
    secret: str = ""  # empty: read from the environment variable ``secret_env``
    secret_env: Name = "PRFAAS_SUPERVISOR_SECRET"
    listen: ListenConfig = ListenConfig()
    agent: dict[str, Any] = {}

    def __post_init__(self) -> None:
        names = [e.instance for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(".engines: an instance is listed twice")

    def engine(self, instance: str) -> SupervisedEngine | None:
        return next((e for e in self.engines if e.instance == instance), None)


def config_parse(raw: object, env: Mapping[str, str] | None = None) -> SupervisorConfig:
    """The file's document, checked, with the token and the secret read from the environment
    when the file does not hold them."""
    env = os.environ if env is None else env
    config = config_convert(raw, SupervisorConfig)
    return msgspec.structs.replace(
        config,
        control_plane=config.control_plane.token_read(env),
        secret=env_secret(config.secret, config.secret_env, "secret_env", env),
    )


def config_load(path: Path, env: Mapping[str, str] | None = None) -> SupervisorConfig:
    return config_parse(config_file_read(path), env)
