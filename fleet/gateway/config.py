"""The gateway's configuration file (``gateway.yaml``), read strictly.

Every key is named below with its default; an unknown key, a wrong type or an out-of-range
value is a :class:`ConfigError` naming the key (:mod:`fleet.config_read`; the CLI prints it
and exits 2). The control
plane's token comes from the environment variable named by ``control_plane.token_env``
(default ``PRFAAS_GATEWAY_TOKEN``) so that the file holds no secret.

::

    listen: {host: 127.0.0.1, port: 8080}
    origin: pd-h20                  # the PD cluster whose requests arrive here (required)
    control_plane:
      url: http://127.0.0.1:8000    # required
      token_env: PRFAAS_GATEWAY_TOKEN   # a token with the ``router`` scope
      timeout_s: 0.5                # per control-plane call
      cooldown_s: 2.0               # after a failed call, none is tried for this long
    decide: local                   # local: the core function in process; remote: POST /route
    live_refresh_s: 0.5             # poll GET /route/live this often (decide: local)
    live_max_age_s: 2.0             # older live state is not used: the policy's static rule
    policy_refresh_s: 5.0           # GET /policy with its ETag
    endpoints: {}                   # instance name -> base URL, overriding the inventory
    endpoint_template: ""           # for instances with no endpoint, e.g. http://{instance}:8000
    model: ""                       # served model name for /v1/models (default: the engines')
    prefill_timeout_s: 60           # one prefill step (cache transfers included)
    decode_timeout_s: 600           # one decode step, to its last token
    connect_timeout_s: 2.0
    first_byte_timeout_s: 10        # an engine's answer starts within this (a prefill: plus
                                    # first_byte_factor x its predicted time)
    first_byte_factor: 3.0
    stream_idle_timeout_s: 60       # a streamed answer's chunks at most this far apart
    eject_failures: 1               # consecutive failures that eject an engine
    eject_base_s: 10                # first ejection; doubled for each one that follows it
    eject_max_s: 300
    header_timeout_s: 10            # a request's headers, from its connection or last answer
    body_timeout_s: 30              # a request's whole body, from its headers
    max_body_bytes: 16777216        # per request; beyond: 413 before reading it
    body_buffer_bytes: 268435456    # request bodies held at once (per worker); beyond: 503
    max_prompt_tokens: 2000000      # longer prompts are refused before their hashes
    workers: 1                      # gateway processes on the port (one event loop each)
    server: uvicorn                 # the ASGI server: uvicorn (measured cheaper) or granian
    max_inflight: 256               # requests being served at once, per worker
    max_waiting: 256                # requests queued for a slot; beyond: 503 at once
    outcome_batch: 200              # outcomes per POST /outcomes
    outcome_interval_s: 0.5
    outcome_buffer: 20000           # kept while the control plane is away; oldest dropped
    prefix_index_blocks: 200000     # blocks remembered by the served-prefix index (local)
    tokenizer: engine               # engine: POST /tokenize on an origin engine (exact, one
                                    # more call); estimate: bytes / chars_per_token, no block
                                    # hashes (no prefix-aware routing for text prompts)
    chars_per_token: 4.0
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from fleet.config_read import (
    ConfigError,
    HttpUrl,
    Name,
    config_convert,
    config_file_read,
    env_secret,
)

__all__ = ["ConfigError", "ControlPlaneConfig", "GatewayConfig", "GatewayFile", "ListenConfig"]


class ListenConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: Name = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8080


class ControlPlaneConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: HttpUrl
    token_env: Name = "PRFAAS_GATEWAY_TOKEN"
    timeout_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    cooldown_s: Annotated[float, Meta(ge=0, le=600)] = 2.0


class GatewayFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``gateway.yaml`` (the module docstring); :class:`GatewayConfig` adds the token."""

    origin: Name
    control_plane: ControlPlaneConfig
    listen: ListenConfig = ListenConfig()
    decide: Literal["local", "remote"] = "local"
    live_refresh_s: Annotated[float, Meta(ge=0.01, le=60.0)] = 0.5
    live_max_age_s: Annotated[float, Meta(ge=0.05, le=600.0)] = 2.0
    policy_refresh_s: Annotated[float, Meta(ge=0.1, le=3600.0)] = 5.0
    endpoints: dict[str, HttpUrl] = {}
    endpoint_template: str = ""
    model: str = ""
    prefill_timeout_s: Annotated[float, Meta(ge=0.01, le=3600.0)] = 60.0
    decode_timeout_s: Annotated[float, Meta(ge=0.01, le=86400.0)] = 600.0
    connect_timeout_s: Annotated[float, Meta(ge=0.01, le=60.0)] = 2.0
    first_byte_timeout_s: Annotated[float, Meta(ge=0.01, le=3600.0)] = 10.0
    first_byte_factor: Annotated[float, Meta(ge=1.0, le=100.0)] = 3.0
    stream_idle_timeout_s: Annotated[float, Meta(ge=0.01, le=3600.0)] = 60.0
    eject_failures: Annotated[int, Meta(ge=1, le=1000)] = 1
    eject_base_s: Annotated[float, Meta(ge=0.1, le=3600.0)] = 10.0
    eject_max_s: Annotated[float, Meta(ge=0.1, le=86400.0)] = 300.0
    header_timeout_s: Annotated[float, Meta(ge=0.1, le=600.0)] = 10.0
    body_timeout_s: Annotated[float, Meta(ge=0.1, le=3600.0)] = 30.0
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 << 20
    body_buffer_bytes: Annotated[int, Meta(ge=1024, le=1 << 36)] = 256 << 20
    max_prompt_tokens: Annotated[int, Meta(ge=1, le=10_000_000)] = 2_000_000
    workers: Annotated[int, Meta(ge=1, le=256)] = 1
    server: Literal["uvicorn", "granian"] = "uvicorn"
    max_inflight: Annotated[int, Meta(ge=1, le=1_000_000)] = 256
    max_waiting: Annotated[int, Meta(ge=0, le=10_000_000)] = 256
    outcome_batch: Annotated[int, Meta(ge=1, le=1000)] = 200
    outcome_interval_s: Annotated[float, Meta(ge=0.01, le=60.0)] = 0.5
    outcome_buffer: Annotated[int, Meta(ge=1, le=10_000_000)] = 20000
    prefix_index_blocks: Annotated[int, Meta(ge=0, le=100_000_000)] = 200000
    tokenizer: Literal["engine", "estimate"] = "engine"
    chars_per_token: Annotated[float, Meta(ge=0.5, le=64.0)] = 4.0

    def __post_init__(self) -> None:
        if self.endpoint_template and "{instance}" not in self.endpoint_template:
            raise ValueError(".endpoint_template: must contain {instance}")
        for low, high in (
            ("live_refresh_s", "live_max_age_s"),
            ("max_body_bytes", "body_buffer_bytes"),
            ("eject_base_s", "eject_max_s"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f".{high}: must not be below {low}")

    def endpoint_of(self, instance: str, inventory_endpoint: str) -> str:
        """Where ``instance`` is reached: the override, the inventory's, or the template."""
        url = self.endpoints.get(instance) or inventory_endpoint
        if not url and self.endpoint_template:
            url = self.endpoint_template.format(instance=instance)
        return url.rstrip("/")


class GatewayConfig(GatewayFile, frozen=True, kw_only=True):
    """The file and the control plane's token, read from ``control_plane.token_env``."""

    token: str


def config_from_dict(data: object, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read the YAML document's mapping (see the module docstring)."""
    file = config_convert(data, GatewayFile)
    variable = file.control_plane.token_env
    token = env_secret(
        "", variable, "control_plane.token_env", os.environ if environ is None else environ
    )
    return GatewayConfig(**msgspec.structs.asdict(file), token=token)


def config_load(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read ``path``; raises ConfigError (a missing file or bad YAML included)."""
    return config_from_dict(config_file_read(path), environ)
