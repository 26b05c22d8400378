"""The gateway end to end on real engines: two vLLM CPU instances with ExampleConnector (a
shared storage directory) as prefill (``kv_producer``) and decode (``kv_consumer``), the
gateway in front, the real control plane behind.

A completion through the gateway is offloaded (prefill on the PrfaaS cluster's instance,
decode on the PD cluster's), returns the same greedy text as the prompt served by one
instance alone, the KV is written by the prefill instance and read by the decode instance
(the shared directory, the decoder's ``vllm:external_prefix_cache_hits`` and its log), and the
control plane shows the decision, the released reservation and the observed TTFT.

Marked ``engine``: ``make test-engines`` (its own CI stage) runs it; the first run on a machine
installs vLLM into the cache (``tests.engines.vllm_env``, ~4 min).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from clusters.models import Cluster
from controlplane.audit import CLI_ACTOR
from fleet.fake_engine.launch import gateway_serve
from scheduling.policies import policy_create
from tests.engines.vllm import VllmServer, low_free_ports, vllm_server
from tests.engines.vllm_env import VllmEnv, prepare
from tests.factories import api_token
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import control_plane_serve

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

PD, PRFAAS = "pd-v", "prfaas-v"
PROMPT = "The gateway carries a PrfaaS decision out on two engines: " + " ".join(
    f"step{i} moves block{i * 7}" for i in range(30)
)
MAX_TOKENS = 12


def _connector(role: str, storage: Path) -> list[str]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def _metric(server: VllmServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@pytest.fixture(scope="module")
def vllm_env() -> VllmEnv:
    return prepare()  # cached after the first run


@pytest.fixture(scope="module")
def engines(
    vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer, Path]]:
    storage = tmp_path_factory.mktemp("kv-shared")
    prefill_port, decode_port = low_free_ports(2)
    with (
        vllm_server(
            vllm_env, port=prefill_port, extra_args=_connector("kv_producer", storage)
        ) as prefill,
        vllm_server(
            vllm_env, port=decode_port, extra_args=_connector("kv_consumer", storage)
        ) as decode,
    ):
        yield prefill, decode, storage


def test_a_completion_through_the_gateway_is_prefilled_on_one_vllm_and_decoded_on_the_other(
    engines: tuple[VllmServer, VllmServer, Path],
    transactional_db: None,
    redis_client: redis.Redis,
    settings: Any,
    tmp_path: Path,
) -> None:
    from django.db import connection

    prefill, decode, storage = engines
    pd_prfaas_fleet(PD, PRFAAS, h20_prefill_seconds=[[1024, 0.6], [32768, 5.0], [131072, 22.5]])
    Cluster.objects.update(kv_connector="shared_storage")
    # Anything above 64 uncached tokens is offloaded to the PrfaaS cluster.
    policy_create(actor=CLI_ACTOR, thresholds={PD: 64})
    router, agent, read = (api_token(s)[1] for s in ("router", "agent", "read"))
    endpoints = {
        f"{PRFAAS}-p0": prefill.url,
        f"{PRFAAS}-p1": prefill.url,
        f"{PD}-p0": prefill.url,
        f"{PD}-p1": prefill.url,
        f"{PD}-d0": decode.url,
        f"{PD}-d1": decode.url,
    }
    (port,) = low_free_ports(1, base=prefill.port + 10)
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _):
        now = time.time()
        telemetry = {
            "idempotency_key": f"vllm-gw-{now}",
            "instances": [{"instance": name, "ts": now} for name in endpoints],
        }
        auth = {"Authorization": f"Bearer {agent}"}
        posted = httpx.post(f"{base}/api/v1/telemetry", json=telemetry, headers=auth, timeout=10)
        assert posted.status_code == 200, posted.text
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "origin": PD,
            "control_plane": {"url": base, "token_env": "GW_VLLM_TOKEN", "timeout_s": 5},
            "endpoints": endpoints,
            "live_max_age_s": 30.0,
            "outcome_interval_s": 0.1,
            "prefill_timeout_s": 120,
            "decode_timeout_s": 120,
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        stored_before = len(list(storage.rglob("*.safetensors")))
        hits_before = _metric(decode, "vllm:external_prefix_cache_hits_total")
        with gateway_serve(path, port, {"GW_VLLM_TOKEN": router}) as (gateway, _):
            got = httpx.post(
                f"{gateway}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                },
                headers={"X-Request-Id": "vllm-gw-1"},
                timeout=180,
            )
            assert got.status_code == 200, got.text
            assert got.headers["x-prfaas-route"] == "prfaas"
            assert got.headers["x-prfaas-prefill"].startswith(PRFAAS)
            assert got.headers["x-prfaas-decode"].startswith(f"{PD}-d")
            through_gateway = got.json()["choices"][0]["text"]

            # The same prompt, one instance alone (no connector step in between).
            alone = prefill.complete(PROMPT, max_tokens=MAX_TOKENS)["choices"][0]["text"]
            assert through_gateway == alone
            assert len(through_gateway) > 0

            # KV written to the shared storage by the prefill instance, read by the decoder.
            assert len(list(storage.rglob("*.safetensors"))) > stored_before
            assert _metric(decode, "vllm:external_prefix_cache_hits_total") > hits_before
            assert re.search(r"Inject KV cache of \d+ tokens", decode.log_tail(200_000))

            # The control plane: the decision, its released reservation, the observed TTFT.
            headers = {"Authorization": f"Bearer {read}"}
            deadline = time.monotonic() + 20
            outcome = None
            while time.monotonic() < deadline and outcome is None:
                rows = httpx.get(
                    f"{base}/api/v1/outcomes/recent", headers=headers, timeout=10
                ).json()
                outcome = next((r for r in rows if r["request_id"] == "vllm-gw-1"), None)
                time.sleep(0.2)
            assert outcome is not None, "the outcome never reached the control plane"
            assert outcome["route"] == "prfaas" and outcome["status"] == "ok"
            assert outcome["reservation_id"] and outcome["released_bytes"] > 0
            assert outcome["observed_ttft_s"] > 0 and outcome["predicted_ttft_s"] > 0
            recent = httpx.get(
                f"{base}/api/v1/decisions/recent", headers=headers, timeout=10
            ).json()
            mine = [r for r in recent if r["decision"]["request_id"] == "vllm-gw-1"]
            assert mine and mine[0]["decision"]["route"] == "prfaas"
            assert mine[0]["inputs"]["decided_by"] == "gateway"
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            assert f'prfaas_ttft_observed_seconds_count{{cluster="{PRFAAS}"}} 1.0' in metrics
            assert "prfaas_reservations_released_total 1.0" in metrics
