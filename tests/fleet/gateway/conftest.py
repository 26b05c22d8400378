"""A whole stack for gateway tests: the real control plane (uvicorn on the test database and
real Redis), fake vLLM engines for every instance of a small fleet, and the gateway process
in front of them; all stopped when the test is done."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from clusters.models import Cluster
from controlplane.audit import CLI_ACTOR
from fleet.fake_engine.launch import fake_engines_serve, gateway_serve
from scheduling.policies import policy_create
from tests.factories import api_token
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import control_plane_serve, free_port
from tests.support.tcp_proxy import TcpProxy, tcp_proxy

PD, PRFAAS = "pd-g", "prfaas-g"
THRESHOLD = 4096
INSTANCES = (
    (f"{PD}-p0", "kv_both"),
    (f"{PD}-p1", "kv_both"),
    (f"{PD}-d0", "kv_both"),
    (f"{PD}-d1", "kv_both"),
    (f"{PRFAAS}-p0", "kv_both"),
    (f"{PRFAAS}-p1", "kv_both"),
)


def _port_closed_wait(url: str, timeout_s: float = 20.0) -> None:
    parsed = httpx.URL(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((parsed.host, parsed.port or 80), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} still accepts connections {timeout_s:.0f} s after its exit fault")


@dataclass
class Stack:
    control_plane: str
    gateway: str
    engines: dict[str, str]
    router_token: str
    agent_token: str
    read_token: str
    redis: redis.Redis
    gateway_proc: subprocess.Popen[bytes]
    # Between the gateway and the control plane, when the test asked for it.
    proxy: TcpProxy | None = None

    def headers(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def engine_stats(self) -> dict[str, dict[str, Any]]:
        return {n: httpx.get(f"{u}/fake/stats", timeout=5).json() for n, u in self.engines.items()}

    def fault(self, instance: str, mode: str, count: int) -> None:
        got = httpx.post(
            f"{self.engines[instance]}/fake/fault", json={"mode": mode, "count": count}, timeout=5
        )
        assert got.status_code == 200, got.text
        if mode == "exit":
            # The engine stops at its server's next tick, after in-flight requests: under load
            # that is not at once, and a request sent meanwhile is still served there.
            _port_closed_wait(self.engines[instance])

    def telemetry_fresh(self, link_gbps: float = 1.0) -> None:
        """Agents' samples: every instance idle, the link lightly used (abundant)."""
        now = time.time()
        body = {
            "idempotency_key": f"gw-test-{now}",
            "instances": [{"instance": name, "ts": now} for name, _ in INSTANCES],
            "links": [
                {
                    "source": PRFAAS,
                    "target": PD,
                    "ts": now,
                    "bytes_sent": int(link_gbps * 1e9 / 8),
                    "interval_s": 1.0,
                }
            ],
        }
        got = httpx.post(
            f"{self.control_plane}/api/v1/telemetry",
            json=body,
            headers=self.headers(self.agent_token),
            timeout=10,
        )
        assert got.status_code == 200, got.text

    def outcome_of(self, request_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The control plane's record of a request's outcome, once the gateway reported it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = httpx.get(
                f"{self.control_plane}/api/v1/outcomes/recent?limit=200",
                headers=self.headers(self.read_token),
                timeout=5,
            )
            assert got.status_code == 200, got.text
            for row in got.json():
                if row["request_id"] == request_id:
                    return dict(row)
            time.sleep(0.1)
        raise AssertionError(f"no outcome for {request_id} reached the control plane")

    def gateway_metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.gateway}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def single_answer(stack: Stack, prompt: Any, max_tokens: int, chat: bool = False) -> str:
    """The same prompt served by one instance alone (no disaggregation)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens}
    body["messages" if chat else "prompt"] = prompt
    got = httpx.post(f"{stack.engines[f'{PD}-d1']}{path}", json=body, timeout=30)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


@pytest.fixture
def stack_factory(
    transactional_db: None, redis_client: redis.Redis, settings: Any, tmp_path: Path
) -> Iterator[Callable[..., Any]]:
    """Builds the stack; ``connector``: the clusters' KV protocol, ``decide``: local|remote."""
    from django.db import connection

    pd_prfaas_fleet(PD, PRFAAS, h20_prefill_seconds=[[1024, 0.6], [32768, 5.0], [131072, 22.5]])
    policy_create(actor=CLI_ACTOR, thresholds={PD: THRESHOLD})
    router = api_token("router")[1]
    agent = api_token("agent")[1]
    read = api_token("read")[1]
    stops: list[Any] = []

    def build(
        connector: str = "nixl",
        decide: str = "local",
        token_s: float = 0.0,
        max_model_len: int = 8192,
        prefill_s_per_1k: float = 0.0,
        proxy: bool = False,
        **extra: Any,
    ) -> Stack:
        """``extra``: gateway.yaml keys over the test's defaults; ``proxy``: the gateway
        reaches the control plane through a TCP proxy the test controls (``stack.proxy``)."""
        Cluster.objects.update(kv_connector=connector)
        ports = {name: free_port() for name, _ in INSTANCES}
        engines_cm = fake_engines_serve(
            [(name, ports[name], role) for name, role in INSTANCES],
            connector=connector,
            storage=str(tmp_path / "kv") if connector == "shared_storage" else "",
            token_s=token_s,
            max_model_len=max_model_len,
            prefill_s_per_1k=prefill_s_per_1k,
        )
        (tmp_path / "kv").mkdir(exist_ok=True)
        engines, _ = engines_cm.__enter__()
        stops.append(engines_cm)
        cp_cm = control_plane_serve(connection.settings_dict, settings.REDIS_URL)
        base, _ = cp_cm.__enter__()
        stops.append(cp_cm)
        port = free_port()
        via = None
        if proxy:
            proxy_cm = tcp_proxy(base)
            via = proxy_cm.__enter__()
            stops.append(proxy_cm)
        cp = {"url": via.url if via else base, "token_env": "GW_TEST_TOKEN", "timeout_s": 5}
        cp.update(extra.pop("control_plane", {}))
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "origin": PD,
            "control_plane": cp,
            "decide": decide,
            "live_refresh_s": 0.2,
            "live_max_age_s": 5.0,
            "endpoints": engines,
            "outcome_interval_s": 0.1,
            "prefill_timeout_s": 10,
            "decode_timeout_s": 30,
            **extra,
        }
        path = tmp_path / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        stack = Stack(base, "", engines, router, agent, read, redis_client, None, via)  # type: ignore[arg-type]
        stack.telemetry_fresh()
        gw_cm = gateway_serve(path, port, {"GW_TEST_TOKEN": router})
        stack.gateway, stack.gateway_proc = gw_cm.__enter__()
        stops.append(gw_cm)
        time.sleep(0.5)  # one live-state refresh after the telemetry
        return stack

    yield build
    for cm in reversed(stops):
        cm.__exit__(None, None, None)
