"""The gateway's configuration file (``gateway.yaml``), read strictly.

Every key is named below with its default; an unknown key, a wrong type or an out-of-range
value is a :class:`ConfigError` naming the key (the CLI prints it and exits 2). The control
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

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be used; the message starts with the key."""


@dataclass(frozen=True)
class GatewayConfig:
    origin: str
    control_plane_url: str
    token: str
    host: str = "127.0.0.1"
    port: int = 8080
    control_plane_timeout_s: float = 0.5
    decide: str = "local"
    live_refresh_s: float = 0.5
    live_max_age_s: float = 2.0
    policy_refresh_s: float = 5.0
    endpoints: Mapping[str, str] = field(default_factory=dict)
    endpoint_template: str = ""
    model: str = ""
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 10.0
    first_byte_factor: float = 3.0
    stream_idle_timeout_s: float = 60.0
    eject_failures: int = 1
    eject_base_s: float = 10.0
    eject_max_s: float = 300.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 16 << 20
    body_buffer_bytes: int = 256 << 20
    max_prompt_tokens: int = 2_000_000
    control_plane_cooldown_s: float = 2.0
    workers: int = 1
    server: str = "uvicorn"
    max_inflight: int = 256
    max_waiting: int = 256
    outcome_batch: int = 200
    outcome_interval_s: float = 0.5
    outcome_buffer: int = 20000
    prefix_index_blocks: int = 200000
    tokenizer: str = "engine"
    chars_per_token: float = 4.0

    def endpoint_of(self, instance: str, inventory_endpoint: str) -> str:
        """Where ``instance`` is reached: the override, the inventory's, or the template."""
        url = self.endpoints.get(instance) or inventory_endpoint
        if not url and self.endpoint_template:
            url = self.endpoint_template.format(instance=instance)
        return url.rstrip("/")


_NUMBERS = {  # key: (kind, low, high)
    "port": (int, 1, 65535),
    "live_refresh_s": (float, 0.01, 60.0),
    "live_max_age_s": (float, 0.05, 600.0),
    "policy_refresh_s": (float, 0.1, 3600.0),
    "prefill_timeout_s": (float, 0.01, 3600.0),
    "decode_timeout_s": (float, 0.01, 86400.0),
    "connect_timeout_s": (float, 0.01, 60.0),
    "first_byte_timeout_s": (float, 0.01, 3600.0),
    "first_byte_factor": (float, 1.0, 100.0),
    "stream_idle_timeout_s": (float, 0.01, 3600.0),
    "eject_failures": (int, 1, 1000),
    "eject_base_s": (float, 0.1, 3600.0),
    "eject_max_s": (float, 0.1, 86400.0),
    "header_timeout_s": (float, 0.1, 600.0),
    "body_timeout_s": (float, 0.1, 3600.0),
    "max_body_bytes": (int, 1024, 1 << 30),
    "body_buffer_bytes": (int, 1024, 1 << 36),
    "max_prompt_tokens": (int, 1, 10_000_000),
    "workers": (int, 1, 256),
    "max_inflight": (int, 1, 1_000_000),
    "max_waiting": (int, 0, 10_000_000),
    "outcome_batch": (int, 1, 1000),
    "outcome_interval_s": (float, 0.01, 60.0),
    "outcome_buffer": (int, 1, 10_000_000),
    "prefix_index_blocks": (int, 0, 100_000_000),
    "chars_per_token": (float, 0.5, 64.0),
}


def _number(key: str, value: Any) -> int | float:
    kind, low, high = _NUMBERS[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if kind is int and value != int(value):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not math.isfinite(value) or not low <= value <= high:
        raise ConfigError(f"{key}: must be between {low} and {high}, got {value!r}")
    return kind(value)


def _string(key: str, value: Any, *, required: bool = False) -> str:
    if not isinstance(value, str) or (required and not value):
        raise ConfigError(f"{key}: expected a {'non-empty ' if required else ''}string")
    return value


def config_from_dict(data: Any, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read the YAML document's mapping (see the module docstring)."""
    env = os.environ if environ is None else environ
    if not isinstance(data, Mapping):
        raise ConfigError("<config>: expected a mapping at the top level")
    allowed = {f.name for f in fields(GatewayConfig)} - {
        "control_plane_url",
        "token",
        "host",
        "port",
        "control_plane_timeout_s",
        "control_plane_cooldown_s",
    } | {"listen", "control_plane"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})")
    kwargs: dict[str, Any] = {}
    listen = data.get("listen", {})
    if not isinstance(listen, Mapping) or set(listen) - {"host", "port"}:
        raise ConfigError("listen: expected {host, port}")
    kwargs["host"] = _string("listen.host", listen.get("host", "127.0.0.1"), required=True)
    kwargs["port"] = _number("port", listen.get("port", 8080))
    cp = data.get("control_plane")
    if not isinstance(cp, Mapping):
        raise ConfigError("control_plane: required, a mapping with url (and token_env)")
    extra = sorted(set(cp) - {"url", "token_env", "timeout_s", "cooldown_s"})
    if extra:
        raise ConfigError(f"control_plane.{extra[0]}: unknown key")
    url = _string("control_plane.url", cp.get("url"), required=True)
    if not url.startswith(("http://", "https://")):
        raise ConfigError("control_plane.url: must start with http:// or https://")
    kwargs["control_plane_url"] = url.rstrip("/")
    token_env = _string(
        "control_plane.token_env", cp.get("token_env", "PRFAAS_GATEWAY_TOKEN"), required=True
    )
    token = env.get(token_env, "")
    if not token:
        raise ConfigError(f"control_plane.token_env: the variable {token_env} is not set")
    kwargs["token"] = token
    timeout = cp.get("timeout_s", 0.5)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60:
        raise ConfigError("control_plane.timeout_s: must be a number in (0, 60]")
    kwargs["control_plane_timeout_s"] = float(timeout)
    cooldown = cp.get("cooldown_s", 2.0)
    if (
        isinstance(cooldown, bool)
        or not isinstance(cooldown, int | float)
        or not 0 <= cooldown <= 600
    ):
        raise ConfigError("control_plane.cooldown_s: must be a number in [0, 600]")
    kwargs["control_plane_cooldown_s"] = float(cooldown)
    kwargs["origin"] = _string("origin", data.get("origin"), required=True)
    decide = data.get("decide", "local")
    if decide not in ("local", "remote"):
        raise ConfigError(f"decide: must be local or remote, got {decide!r}")
    kwargs["decide"] = decide
    endpoints = data.get("endpoints", {})
    if not isinstance(endpoints, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v.startswith(("http://", "https://"))
        for k, v in endpoints.items()
    ):
        raise ConfigError("endpoints: expected a mapping of instance name to http(s) URL")
    kwargs["endpoints"] = dict(endpoints)
    template = _string("endpoint_template", data.get("endpoint_template", ""))
    if template and "{instance}" not in template:
        raise ConfigError("endpoint_template: must contain {instance}")
    kwargs["endpoint_template"] = template
    kwargs["model"] = _string("model", data.get("model", ""))
    tokenizer = data.get("tokenizer", "engine")
    if tokenizer not in ("engine", "estimate"):
        raise ConfigError(f"tokenizer: must be engine or estimate, got {tokenizer!r}")
    kwargs["tokenizer"] = tokenizer
    server = data.get("server", "uvicorn")
    if server not in ("uvicorn", "granian"):
        raise ConfigError(f"server: must be uvicorn or granian, got {server!r}")
    kwargs["server"] = server
    for key in _NUMBERS:
        if key != "port" and key in data:
            kwargs[key] = _number(key, data[key])
    cfg = GatewayConfig(**kwargs)
    if cfg.live_max_age_s < cfg.live_refresh_s:
        raise ConfigError("live_max_age_s: must not be below live_refresh_s")
    if cfg.body_buffer_bytes < cfg.max_body_bytes:
        raise ConfigError("body_buffer_bytes: must not be below max_body_bytes")
    if cfg.eject_max_s < cfg.eject_base_s:
        raise ConfigError("eject_max_s: must not be below eject_base_s")
    return cfg


def config_load(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read ``path``; raises ConfigError (a missing file or bad YAML included)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"<config>: cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"<config>: not YAML: {exc}") from None
    return config_from_dict(data, environ)
