"""Registration: the agent tells the control plane which instance each engine is.

Contract: :class:`Registrar` registers every engine that has a ``register`` block with
``PUT /api/v1/registrations/{instance}`` (a token with the ``register`` scope, bound to the
engine's cluster) when the agent starts, and then again every ``register_every_s`` seconds while
the engine answers its health check: the control plane creates the instance or re-binds the
name (idempotent: an unchanged registration writes nothing), and each registration counts as a
heartbeat. An engine that stops answering is no longer registered; with its telemetry gone too,
the control plane marks it unreachable after its grace period. A registration the control plane
refuses (401, 403, 409, 422: a wrong token, a cluster or profile that does not exist, a role
the cluster does not allow) is logged with the control plane's reason and retried only at the
next period; 429 and unreachable control planes back off.

The engine's version, when the block does not give it, is asked from the engine
(``GET {endpoint}/version``, as vLLM answers it). The emulator registers its engines through
the same class, once each (``every_s=None``): its telemetry is their heartbeat.

```yaml
engines:
  - instance: pd-a-0
    metrics_url: http://127.0.0.1:8000/metrics
    register:
      cluster: pd-a
      role: decode                   # prefill | decode
      endpoint: http://10.0.0.5:8000 # where a gateway sends the work
      accelerator: H20               # the hardware profile (the cluster's accelerator)
      kv_connector: nixl             # nixl | shared_storage
      engine: vllm                   # engine_version: asked from the engine when left out
      health_url: http://127.0.0.1:8000/health   # default: {endpoint}/health
register_every_s: 10
```
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter

from fleet.config_read import HttpUrlOrEmpty
from scheduling.core.kinds import InstanceRole, KvConnector

log = logging.getLogger(__name__)

REGISTER_PATH = "/api/v1/registrations/{name}"
BACKOFF_MAX_S = 60.0


class RegistrationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the agent registers for one engine (a ``register`` block, read with the agent's
    file: :mod:`fleet.agent.config`)."""

    cluster: str
    role: InstanceRole
    accelerator: str
    endpoint: HttpUrlOrEmpty | None = None  # None: keep the inventory's
    kv_connector: KvConnector = KvConnector.NIXL
    engine: str = "vllm"
    engine_version: str = ""
    health_url: HttpUrlOrEmpty | None = None  # empty: no health check

    def body(self, engine_version: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": self.cluster,
            "role": self.role,
            "accelerator": self.accelerator,
            "kv_connector": self.kv_connector,
            "engine": self.engine,
            "engine_version": engine_version,
        }
        if self.endpoint is not None:
            out["endpoint"] = self.endpoint
        return out

    @property
    def health(self) -> str | None:
        if self.health_url is not None:
            return self.health_url or None
        return f"{self.endpoint.rstrip('/')}/health" if self.endpoint else None


@dataclass
class _Engine:
    name: str
    config: RegistrationConfig
    next_at: float = 0.0
    version: str = ""
    last_error: str = ""
    registered: bool = False


class Registrar:
    """Registers the engines of one agent (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        engines: Sequence[tuple[str, RegistrationConfig]],
        *,
        every_s: float | None = 10.0,
        client: httpx.Client | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 5.0,
    ) -> None:
        self.every_s = every_s
        self.http = client or httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )
        self._probe = httpx.Client(timeout=2.0)
        self._clock = clock
        self.engines = {name: _Engine(name, config) for name, config in engines}
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.registrations = Counter(
            "prfaas_agent_registrations",
            "Registrations sent, by instance and outcome (ok, refused, failed)",
            ["instance", "outcome"],
            registry=registry or CollectorRegistry(),
        )

    def config_set(self, name: str, config: RegistrationConfig) -> None:
        """Register ``name`` as ``config`` from now on (a restart in another role)."""
        engine = self.engines.get(name)
        if engine is None:
            self.engines[name] = _Engine(name, config)
        else:
            engine.config, engine.next_at, engine.registered = config, 0.0, False

    def _healthy(self, engine: _Engine) -> bool:
        url = engine.config.health
        if url is None:
            return True
        try:
            return self._probe.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    def _version(self, engine: _Engine) -> str:
        if engine.config.engine_version:
            return engine.config.engine_version
        if not engine.version and engine.config.endpoint:
            try:
                answer = self._probe.get(f"{engine.config.endpoint.rstrip('/')}/version")
                if answer.status_code == 200:
                    engine.version = str(answer.json().get("version", ""))[:40]
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return engine.version

    def register(self, name: str) -> bool:
        """Register one engine now; True when the control plane took it."""
        engine = self.engines[name]
        body = engine.config.body(self._version(engine))
        try:
            answer = self.http.put(REGISTER_PATH.format(name=name), json=body)
        except httpx.HTTPError as exc:
            self._failed(engine, f"control plane unreachable: {exc}")
            return False
        if answer.status_code in (200, 201):
            self._backoff_s = 0.0
            self.registrations.labels(name, "ok").inc()
            if not engine.registered:
                log.info("%s: registered in %s as %s", name, body["cluster"], body["role"])
            engine.registered, engine.last_error = True, ""
            return True
        if answer.status_code == 429 or answer.status_code >= 500:
            self._failed(engine, f"HTTP {answer.status_code}")
            return False
        try:
            reason = str(answer.json().get("detail", answer.text))
        except ValueError:
            reason = answer.text
        self.registrations.labels(name, "refused").inc()
        if reason != engine.last_error:
            log.error("%s: registration refused (%s): %s", name, answer.status_code, reason)
        engine.last_error, engine.registered = reason, False
        return False

    def _failed(self, engine: _Engine, why: str) -> None:
        self.registrations.labels(engine.name, "failed").inc()
        self._backoff_s = min(BACKOFF_MAX_S, max(1.0, self._backoff_s * 2))
        self._retry_at = self._clock() + self._backoff_s
        if why != engine.last_error:
            log.warning("%s: registration failed: %s", engine.name, why)
        engine.last_error = why

    def tick(self) -> None:
        """Register the engines that are due and healthy (call it every loop of the agent)."""
        now = self._clock()
        if now < self._retry_at:
            return
        for engine in self.engines.values():
            if engine.next_at > now or (engine.registered and self.every_s is None):
                continue
            engine.next_at = now + (self.every_s or BACKOFF_MAX_S)
            if self._healthy(engine):
                self.register(engine.name)
            if self._clock() < self._retry_at:
                return

    def close(self) -> None:
        self.http.close()
        self._probe.close()
