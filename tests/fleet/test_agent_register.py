"""The agent's registrar against the real control plane: it registers its engines, again each
period only while the engine answers, counts what the control plane refused with its reason;
and the ``register`` block of ``agent.yaml`` is checked key by key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from clusters.live.heartbeats import heartbeats_read
from clusters.models import Instance
from fleet.agent.config import ConfigError, config_parse
from fleet.agent.register import Registrar, RegistrationConfig
from scheduling.core.kinds import InstanceRole
from tests.factories import api_token
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import control_plane_serve, free_port

PD = "pd-g"


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[str]:
    from django.db import connection

    pd_prfaas_fleet(PD, "prfaas-g", h20_prefill_seconds=[[1024, 0.5], [8192, 2.0]], instances=False)
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _):
        yield base


def sample(registry: CollectorRegistry, instance: str, outcome: str) -> float:
    value = registry.get_sample_value(
        "prfaas_agent_registrations_total", {"instance": instance, "outcome": outcome}
    )
    return value or 0.0


def test_the_registrar_registers_healthy_engines_and_reports_refusals(plane: str) -> None:
    _, token = api_token("register", "agent", clusters=(PD,))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: an engine that does not answer
    registry = CollectorRegistry()
    now = [0.0]
    registrar = Registrar(
        plane,
        token,
        [
            (f"{PD}-0", RegistrationConfig(cluster=PD, role=InstanceRole.DECODE, accelerator="H20", health_url="")),
            (f"{PD}-1", RegistrationConfig(cluster=PD, role=InstanceRole.DECODE, accelerator="H200", health_url="")),
            (f"{PD}-2", RegistrationConfig(cluster=PD, role=InstanceRole.PREFILL, accelerator="H20", endpoint=dead)),
        ],
        every_s=10.0,
        registry=registry,
        clock=lambda: now[0],
    )  # fmt: skip
    try:
        registrar.tick()
        assert list(Instance.objects.values_list("name", "role", "engine")) == [
            (f"{PD}-0", "decode", "vllm")
        ]
        # pd-g-1 is on another accelerator: refused with the control plane's reason.
        assert registrar.engines[f"{PD}-1"].last_error.startswith("accelerator: cluster pd-g runs")
        assert sample(registry, f"{PD}-1", "refused") == 1
        # pd-g-2's engine does not answer its health check: not registered at all.
        assert sample(registry, f"{PD}-2", "ok") == sample(registry, f"{PD}-2", "refused") == 0
        first = heartbeats_read([f"{PD}-0"])[f"{PD}-0"]
        registrar.tick()  # within the period: nothing sent
        assert sample(registry, f"{PD}-0", "ok") == 1
        now[0] += 10.0
        registrar.tick()  # a period later: registered again, a heartbeat, no change
        assert sample(registry, f"{PD}-0", "ok") == 2
        assert heartbeats_read([f"{PD}-0"])[f"{PD}-0"] > first
        assert Instance.objects.get(name=f"{PD}-0").version == 1
    finally:
        registrar.close()


def agent_yaml(register: Any) -> dict[str, Any]:
    return {
        "control_plane": {"url": "http://cp:8000", "token": "t"},
        "engines": [
            {"instance": "pd-a-0", "metrics_url": "http://e:8000/metrics", "register": register}
        ],
    }


def test_a_register_block_is_read_with_its_defaults() -> None:
    config = config_parse(agent_yaml({"cluster": "pd-a", "role": "prefill", "accelerator": "H20"}))
    (engine,) = config.engines
    assert engine.register == RegistrationConfig(
        cluster="pd-a", role=InstanceRole.PREFILL, accelerator="H20"
    )
    assert config.register_every_s == 10.0


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"cluster": "pd-a", "accelerator": "H20"}, "engines[0].register.role: required"),
        ({"role": "decode", "accelerator": "H20"}, "engines[0].register.cluster: required"),
        (
            {"cluster": "pd-a", "role": "decode", "accelerator": "H20", "kv_connector": "rdma"},
            "engines[0].register.kv_connector: must be nixl or shared_storage",
        ),
        (
            {"cluster": "pd-a", "role": "decode", "accelerator": "H20", "endpoint": "e:8000"},
            "engines[0].register.endpoint: must start with http://",
        ),
        (
            {"cluster": "pd-a", "role": "decode", "accelerator": "H20", "colour": "red"},
            "engines[0].register.colour: unknown key",
        ),
        ("pd-a", "engines[0].register: expected mapping"),
    ],
)
def test_a_bad_register_block_is_refused_naming_its_key(block: Any, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_parse(agent_yaml(block))
    assert str(refused.value).startswith(message)
