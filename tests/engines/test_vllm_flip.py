"""A plan changes what a real engine does: two tiny vLLM engines run by the fleet supervisor
(``python -m fleet.supervisor``, as deployed), each with its agent, which registers it; the
gateway in front; the real control plane behind, whose topology declares the clusters and no
instance.

1. The agents fill the inventory: both engines join as decode instances of ``pd-v``.
2. A plan flipping ``pd-v-1`` decode -> prefill is approved and applied through the ``process``
   actuator: the supervisor restarts the drained engine with ``kv_role: kv_producer``, waits
   until it is healthy, and its agent registers it as prefill. The gateway then sends prefill
   work to it (the decode on ``pd-v-0`` reads its KV from the shared storage), and the index
   holds its new blocks.
3. A rollback flips it back (``kv_consumer``, decode).
4. Leaving and coming back: with the supervisor stopped, the reachability sweep marks both
   instances unreachable after the grace period and routing avoids them; started again, the
   agents restore them, same rows, no duplicate.

Both engines fit this machine at once (as in ``test_vllm_gateway``), each pinned to the core the
other engine tests use. Marked ``engine``: ``make test-engines`` runs it; timings are printed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from clusters.live import prefix_index
from clusters.live.heartbeats import heartbeats_read
from clusters.models import Cluster, Instance
from clusters.reachability import instances_reachability_sweep
from controlplane.audit import CLI_ACTOR
from controlplane.models import ChangeRecord
from fleet.blockhash import block_keys
from fleet.fake_engine.launch import gateway_serve
from scheduling import rebalance
from scheduling.models import PlanStatus
from scheduling.policies import policy_create
from tests.engines.vllm import BLOCK_SIZE, engine_cpu, low_free_ports, vllm_argv, vllm_env_vars
from tests.engines.vllm_env import VllmEnv, prepare
from tests.factories import api_token
from tests.support import waiting
from tests.support.fleets import pd_prfaas_fleet
from tests.support.plans import plan_flip_proposed, plan_steps_run
from tests.support.servers import control_plane_serve
from tests.support.supervisor import SupervisorProcess, engines_of

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

PD, PRFAAS = "pd-v", "prfaas-v"
DECODER, FLIPPED = "pd-v-0", "pd-v-1"
SECRET = "supervisor-test-secret"
PROMPT = "A plan flipped this engine to prefill; the other one decodes: " + " ".join(
    f"part{i} carries block{i * 3}" for i in range(24)
)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return waiting.wait_for(what, check, timeout_s, interval_s=0.25)


@pytest.fixture(scope="module")
def vllm_env() -> VllmEnv:
    return prepare()  # cached after the first run


def supervisor_config(
    vllm_env: VllmEnv, base: str, work: Path, storage: Path, port: int
) -> dict[str, Any]:
    cpu = engine_cpu()
    engines = []
    for name, (http, zpub, zreplay) in zip(
        (DECODER, FLIPPED), (low_free_ports(3), low_free_ports(3, base=23000)), strict=True
    ):
        # Short: vLLM binds IPC sockets under TMPDIR (at most 107 characters a path).
        engine_work = Path(tempfile.mkdtemp(prefix=f"vllm-{name}-"))
        env: dict[str, str | None] = dict(vllm_env_vars(engine_work))
        env.update({"PYTHONPATH": None, "DJANGO_SETTINGS_MODULE": None, "VIRTUAL_ENV": None})
        engines.append(
            {
                "instance": name,
                "cluster": PD,
                "role": "decode",
                "accelerator": "H20",
                "kv_connector": "shared_storage",
                "engine": "vllm",
                "port": http,
                "command": vllm_argv(vllm_env, port=http, kv_events_port=zpub, replay_port=zreplay),
                "kv_transfer_config": {
                    "kv_connector": "ExampleConnector",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
                "kv_events": {
                    "endpoint": f"tcp://127.0.0.1:{zpub}",
                    "replay_endpoint": f"tcp://127.0.0.1:{zreplay}",
                    "topic": "kv-events",
                },
                "env": env,
                "cwd": str(engine_work),
                "cpus": [cpu] if cpu is not None else [],
                "startup_timeout_s": 300,
            }
        )
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "control_plane": {"url": base},
        "work_dir": str(work),
        "agent": {"interval_s": 0.5, "flush_s": 0.05, "register_every_s": 2},
        "engines": engines,
    }


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[str]:
    from django.db import connection

    pd, _ = pd_prfaas_fleet(
        PD,
        PRFAAS,
        h20_prefill_seconds=[[32, 0.01], [2048, 0.5]],
        block_tokens=BLOCK_SIZE,
        instances=False,
    )
    Cluster.objects.update(kv_connector="shared_storage")
    policy_create(actor=CLI_ACTOR, thresholds={PD: 10**6})  # everything stays local
    rebalance.rebalance_settings_update(
        cluster_id=pd.pk,
        changes={"drain_poll_s": 1, "drain_timeout_s": 60},
        actor=CLI_ACTOR,
    )
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _):
        yield base


def test_a_plan_flips_a_real_vllm_to_prefill_through_the_supervisor_and_back(
    vllm_env: VllmEnv, plane: str, tmp_path: Path, settings: Any
) -> None:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    storage = tmp_path / "kv-shared"
    storage.mkdir()
    sup_port, gw_port = low_free_ports(2, base=25000)
    supervisor_url = f"http://127.0.0.1:{sup_port}"
    config = supervisor_config(vllm_env, plane, tmp_path / "supervisor", storage, sup_port)
    config_path = tmp_path / "supervisor.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # The agents' token may register into pd-v and report for its instances: nothing else.
    _, agent_token = api_token("agent", "register", clusters=(PD,))
    _, router = api_token("router")
    supervisor = SupervisorProcess(config_path, agent_token, SECRET)
    supervisor.start()
    try:
        # -- 1. the agents fill the inventory ---------------------------------------------
        def joined() -> list[Instance]:
            rows = list(Instance.objects.filter(cluster__name=PD).order_by("name"))
            return rows if len(rows) == 2 and all(i.state == "active" for i in rows) else []

        rows = wait_for("both engines registered", joined, 600)
        assert [(i.name, i.role, i.origin, i.engine) for i in rows] == [
            (DECODER, "decode", "registered", "vllm"),
            (FLIPPED, "decode", "registered", "vllm"),
        ]
        assert all(i.engine_version == "0.32.0" for i in rows)  # asked from vLLM's /version
        ports = {e["instance"]: e["port"] for e in config["engines"]}
        assert rows[1].endpoint == f"http://127.0.0.1:{ports[FLIPPED]}"
        pks = {i.name: i.pk for i in rows}
        timings["engines_joined_s"] = time.monotonic() - t0

        # -- 2. a plan flips pd-v-1 to prefill through the process actuator ---------------
        rebalance.rebalance_settings_update(
            cluster_id=rows[0].cluster_id,
            changes={
                "actuator": "process",
                "webhook_url": supervisor_url,
                "webhook_secret": SECRET,
            },
            actor=CLI_ACTOR,
        )
        plan = plan_flip_proposed(rows[0].cluster, FLIPPED, "decode", "prefill", n_p=0, n_d=2)
        rebalance.plan_approve(plan_id=plan.pk, actor=CLI_ACTOR)
        flip_started = time.monotonic()
        plan_steps_run(plan)
        timings["flip_applied_s"] = time.monotonic() - flip_started
        plan.refresh_from_db()
        assert plan.status == PlanStatus.APPLIED, plan.error
        flipped = Instance.objects.get(name=FLIPPED)
        assert (flipped.role, flipped.state, flipped.pk) == ("prefill", "active", pks[FLIPPED])
        # Its agent came back as prefill and registered it so (a heartbeat after the flip).
        finished = plan.steps.get(phase="apply", action="flip").finished_at
        assert finished is not None
        flipped_at = finished.timestamp()
        wait_for(
            "a registration after the flip",
            lambda: heartbeats_read([FLIPPED]).get(FLIPPED, 0) > flipped_at,
            30,
        )
        causes = ChangeRecord.objects.filter(object_repr=FLIPPED).values_list("cause", flat=True)
        assert not any("registered as decode" in c for c in causes)
        engines = engines_of(supervisor_url)
        assert (engines[FLIPPED]["role"], engines[FLIPPED]["kv_role"]) == ("prefill", "kv_producer")
        assert engines[DECODER]["kv_role"] == "kv_consumer"

        # The gateway sends prefill work to the flipped engine, the decode to the other.
        gateway_config = tmp_path / "gateway.yaml"
        gateway_config.write_text(
            yaml.safe_dump(
                {
                    "listen": {"host": "127.0.0.1", "port": gw_port},
                    "origin": PD,
                    "control_plane": {"url": plane, "token_env": "GW_FLIP_TOKEN", "timeout_s": 5},
                    "live_max_age_s": 30.0,
                    "policy_refresh_s": 1.0,
                    "prefill_timeout_s": 120,
                    "decode_timeout_s": 120,
                }
            )
        )
        with gateway_serve(gateway_config, gw_port, {"GW_FLIP_TOKEN": router}) as (gateway, _):
            answer = httpx.post(
                f"{gateway}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                headers={"X-Request-Id": "flip-1"},
                timeout=180,
            )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-prfaas-prefill"] == FLIPPED
        assert answer.headers["x-prfaas-decode"] == DECODER
        assert answer.json()["choices"][0]["text"]
        assert list(storage.rglob("*.safetensors")), "the prefill wrote no KV for the decode"

        # The index holds the flipped engine's new blocks (its KV events, through its agent).
        tokens = httpx.post(
            f"http://127.0.0.1:{ports[FLIPPED]}/tokenize",
            json={"model": "tiny", "prompt": PROMPT},
            timeout=30,
        ).json()["tokens"]
        chain = [prefix_index.block_hash_key(k) for k in block_keys(tokens, BLOCK_SIZE)[:-1]]

        def indexed() -> int:
            return prefix_index.prefix_match(chain, BLOCK_SIZE).tokens_by_instance.get(FLIPPED, 0)

        wait_for("the flipped engine's blocks in the index", lambda: indexed() >= BLOCK_SIZE)
        state = prefix_index.prefix_index_states([FLIPPED])[0]
        assert state.state == "exact" and state.blocks > 0
        timings["prefill_served_s"] = time.monotonic() - t0

        # -- 3. the rollback flips it back -------------------------------------------------
        rebalance.plan_rollback(plan_id=plan.pk, actor=CLI_ACTOR)
        rollback_started = time.monotonic()
        plan_steps_run(plan)
        timings["rollback_applied_s"] = time.monotonic() - rollback_started
        plan.refresh_from_db()
        assert plan.status == PlanStatus.ROLLED_BACK, plan.error
        assert Instance.objects.get(name=FLIPPED).role == "decode"
        engines = engines_of(supervisor_url)
        assert (engines[FLIPPED]["role"], engines[FLIPPED]["kv_role"]) == ("decode", "kv_consumer")

        # -- 4. leaving and coming back ----------------------------------------------------
        supervisor.stop()
        stopped = time.monotonic()
        settings.INSTANCE_UNREACHABLE_AFTER_S = 3.0

        def both_unreachable() -> bool:
            instances_reachability_sweep()
            states = set(Instance.objects.filter(cluster__name=PD).values_list("state", flat=True))
            return states == {"unreachable"}

        wait_for("both instances unreachable", both_unreachable, 60)
        timings["marked_unreachable_after_stop_s"] = time.monotonic() - stopped
        routed = httpx.post(
            f"{plane}/api/v1/route",
            json={"origin": PD, "prompt_tokens": 100},
            headers={"Authorization": f"Bearer {router}"},
            timeout=10,
        )
        # Routing has no active instance of pd-v left to name.
        assert routed.status_code == 503, routed.text
        assert routed.json()["code"] in ("no_decode_capacity", "origin_unavailable")
        supervisor.start()
        restarted = time.monotonic()
        rows = wait_for("both engines back", joined, 600)
        assert {i.name: i.pk for i in rows} == pks  # the same rows: no duplicate
        assert [i.role for i in rows] == ["decode", "decode"]  # the roles the supervisor kept
        timings["restored_after_restart_s"] = time.monotonic() - restarted
    finally:
        supervisor.stop()
        for engine in config["engines"]:
            shutil.rmtree(engine["cwd"], ignore_errors=True)
        print("timings:", {k: round(v, 1) for k, v in timings.items()})
        if supervisor.proc is not None and supervisor.proc.returncode not in (0, None):
            print(supervisor.tail())
