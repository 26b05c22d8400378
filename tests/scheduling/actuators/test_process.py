"""The ``process`` actuator: a cluster's rebalance settings name a fleet supervisor, and a plan's
flip steps restart the engine there in its new role; the engine's agent registers it in that
role. End to end on fake engines (``fleet.fake_engine`` honours ``kv_role``) with real agents,
a real supervisor and the real control plane; ``tests/engines/test_vllm_flip.py`` does the same
on vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from clusters.live.heartbeats import heartbeats_read
from clusters.models import Cluster, Instance
from controlplane.audit import CLI_ACTOR
from controlplane.errors import Invalid
from controlplane.models import ChangeRecord
from scheduling import rebalance
from scheduling.actuators import ProcessActuator, RecordActuator, StepNotice, actuator_for
from scheduling.models import PlanStatus
from scheduling.policies import policy_create
from tests.factories import api_token
from tests.fleet.test_supervisor import fake_engine, supervisor_yaml
from tests.support.fleets import pd_prfaas_fleet
from tests.support.plans import plan_flip_proposed, plan_steps_run
from tests.support.servers import control_plane_serve, free_port
from tests.support.supervisor import SupervisorProcess, engines_of
from tests.support.waiting import wait_for

PD = "pd-x"
SECRET = "process-actuator-secret"


@pytest.mark.django_db
def test_the_settings_take_a_process_actuator_only_with_a_supervisor_to_call(
    redis_client: redis.Redis,
) -> None:
    pd, _ = pd_prfaas_fleet(PD, "prfaas-x", h20_prefill_seconds=[[1024, 0.5], [8192, 2.0]])
    row = rebalance.rebalance_settings_update(
        cluster_id=pd.pk,
        changes={"actuator": "process", "webhook_url": "http://h1:9470", "webhook_secret": "s"},
        actor=CLI_ACTOR,
    )
    assert row.actuator == "process"
    assert isinstance(actuator_for("process", url=row.webhook_url, secret="s"), ProcessActuator)
    assert isinstance(actuator_for("record"), RecordActuator)
    with pytest.raises(Invalid, match="webhook URL must be http"):
        rebalance.rebalance_settings_update(
            cluster_id=pd.pk, changes={"webhook_url": "h1:9470"}, actor=CLI_ACTOR
        )


def test_only_flip_steps_leave_the_control_plane() -> None:
    actuator = ProcessActuator("http://127.0.0.1:9", "s", deadline_s=1)
    for action in ("drain", "wait", "activate", "policy"):
        actuator.notify(StepNotice(plan_id=1, step=0, action=action, cluster=PD))
    # A flip does call the supervisor (nobody listens on port 9: the attempt fails).
    with pytest.raises(Exception, match=r"webhook http://127\.0\.0\.1:9/v1/steps failed"):
        actuator.notify(
            StepNotice(
                plan_id=1, step=2, action="flip", cluster=PD, instance="i", to_role="prefill"
            )
        )


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[str]:
    from django.db import connection

    pd_prfaas_fleet(PD, "prfaas-x", h20_prefill_seconds=[[1024, 0.5], [8192, 2.0]], instances=False)
    Cluster.objects.update(kv_connector="shared_storage")
    policy_create(actor=CLI_ACTOR, thresholds={PD: 10**6})
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _):
        yield base


def test_a_plan_flips_an_engine_through_its_supervisor_and_the_agent_reregisters_it(
    plane: str, tmp_path: Path
) -> None:
    storage = tmp_path / "kv"
    storage.mkdir()
    port = free_port()
    engines: list[dict[str, Any]] = [
        fake_engine(f"{PD}-{k}", free_port(), storage) for k in range(2)
    ]
    for engine in engines:
        engine["cluster"] = PD
    path = supervisor_yaml(tmp_path, engines, plane, port)
    _, token = api_token("agent", "register", clusters=(PD,))
    supervisor = SupervisorProcess(path, token, SECRET)
    supervisor.start()
    url = f"http://127.0.0.1:{port}"
    try:
        # A topology of clusters and no instance: the agents fill the inventory.
        def joined() -> list[Instance]:
            rows = list(Instance.objects.filter(cluster__name=PD, state="active"))
            return rows if len(rows) == 2 else []

        rows = wait_for("both engines registered", joined, 60)
        assert {(i.role, i.origin, i.engine) for i in rows} == {("decode", "registered", "fake")}
        pd = rows[0].cluster
        rebalance.rebalance_settings_update(
            cluster_id=pd.pk,
            changes={
                "actuator": "process",
                "webhook_url": url,
                "webhook_secret": SECRET,
                "drain_poll_s": 1,
            },
            actor=CLI_ACTOR,
        )
        plan = plan_flip_proposed(pd, f"{PD}-1", "decode", "prefill", n_p=0, n_d=2)
        rebalance.plan_approve(plan_id=plan.pk, actor=CLI_ACTOR)
        plan_steps_run(plan, timeout_s=120)

        plan.refresh_from_db()
        assert plan.status == PlanStatus.APPLIED, plan.error
        assert Instance.objects.get(name=f"{PD}-1").role == "prefill"
        assert engines_of(url)[f"{PD}-1"]["kv_role"] == "kv_producer"
        # Its agent came back configured as prefill and registered it so (a heartbeat after
        # the flip), whichever of the two wrote the role first.
        agent = yaml.safe_load((tmp_path / "work" / "agents" / f"{PD}-1.yaml").read_text())
        assert agent["engines"][0]["register"]["role"] == "prefill"
        finished = plan.steps.get(phase="apply", action="flip").finished_at
        assert finished is not None
        flipped_at = finished.timestamp()
        wait_for(
            "a registration after the flip",
            lambda: heartbeats_read([f"{PD}-1"]).get(f"{PD}-1", 0) > flipped_at,
            30,
        )
        assert Instance.objects.get(name=f"{PD}-1").role == "prefill"
        changes = ChangeRecord.objects.filter(object_repr=f"{PD}-1").values_list("cause", flat=True)
        assert not any("registered as decode" in c for c in changes)

        # The engine does what a prefill engine does: it writes KV for a decoder.
        endpoint = Instance.objects.get(name=f"{PD}-1").endpoint
        answer = httpx.post(
            f"{endpoint}/v1/completions",
            json={"model": "tiny", "prompt": "blocks to hand over " * 12, "max_tokens": 2},
            timeout=30,
        )
        assert answer.status_code == 200 and list(storage.iterdir())

        rebalance.plan_rollback(plan_id=plan.pk, actor=CLI_ACTOR)
        plan_steps_run(plan, timeout_s=120)
        plan.refresh_from_db()
        assert plan.status == PlanStatus.ROLLED_BACK, plan.error
        assert Instance.objects.get(name=f"{PD}-1").role == "decode"
        assert engines_of(url)[f"{PD}-1"]["kv_role"] == "kv_consumer"
    finally:
        supervisor.stop()
