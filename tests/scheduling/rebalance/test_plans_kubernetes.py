"""Plans applied through the ``kubernetes`` and ``metrics`` actuators, on real PostgreSQL and
Redis and the stateful fake Kubernetes API (tests/support/fake_kube.py): one PATCH per role per
change, the drained pod removed, applied only once ready, denied permissions, rollback, and the
desired-replica gauges."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from clusters import services
from clusters.models import Cluster, Instance, InstanceRole, InstanceState
from controlplane.audit import CLI_ACTOR, Actor
from scheduling import rebalance
from scheduling.models import Plan, PlanStatus, PlanStep
from tests.scheduling.rebalance_support import (
    PD,
    PERIOD,
    inventory_load,
    policy_set,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)
from tests.support.fake_kube import FakeKube

pytestmark = pytest.mark.django_db
OPERATOR = Actor(label="user:ops", source="api")


@pytest.fixture
def kube(tmp_path: Path, settings) -> Iterator[FakeKube]:
    with FakeKube(ready_delay_s=0.3, terminate_delay_s=0.2).running() as fake:
        settings.KUBERNETES_KUBECONFIG = str(fake.kubeconfig(tmp_path / "kubeconfig"))
        yield fake


def fleet_on(kube: FakeKube, scenarios_dir: Path, kind: str, *, actuator: str) -> Cluster:
    """The case-study PD cluster (2 prefill, 6 decode) running as two ``kind`` workloads whose
    pods are its instances (each instance's ``pod`` label)."""
    cluster = inventory_load(scenarios_dir)
    policy_set(8500)
    settings_set(
        cluster,
        actuator=actuator,
        drain_poll_s=1,
        ready_timeout_s=30,
        guards={"max_change_fraction": 0.25, "persist_ticks": 1},
    )
    targets = {}
    for role in ("prefill", "decode"):
        instances = list(Instance.objects.filter(cluster=cluster, role=role).order_by("name"))
        kube.add_workload(kind, f"{PD}-{role}", len(instances))
        for inst, pod in zip(instances, kube.pod_names(f"{PD}-{role}"), strict=True):
            services.instance_update(
                instance_id=inst.pk,
                version=inst.version,
                changes={"labels": {"pod": pod}},
                actor=CLI_ACTOR,
            )
        targets[role] = {"kind": kind, "name": f"{PD}-{role}", "namespace": "inference"}
    cluster = services.cluster_update(
        cluster_id=cluster.pk,
        version=cluster.version,
        changes={"scale_targets": targets},
        actor=CLI_ACTOR,
    )
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    return cluster


def proposed(cluster: Cluster) -> Plan:
    period = rebalance.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    tick = rebalance.rebalance_tick(cluster_id=cluster.pk, period_start=period)
    assert tick.action == "propose", tick.detail
    return Plan.objects.get(tick=tick)


def drive(plan: Plan, timeout: float = 60) -> Plan:
    """Run the plan's steps as the Celery task does, waiting (briefly) where it would wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        telemetry_fresh(ts=time.time() + 1)
        outcome, delay = rebalance.plan_apply_step(plan_id=plan.pk)
        if outcome in ("done", "idle"):
            plan.refresh_from_db()
            return plan
        if outcome == "wait":
            time.sleep(min(delay, 0.1))
    pytest.fail(f"plan {plan.pk} did not finish within {timeout} s")


def accepted(kube: FakeKube, name: str) -> list[int]:
    return [p.body["spec"]["replicas"] for p in kube.scale_patches(name) if p.status == 200]


def test_approving_a_plan_on_two_deployments_patches_each_role_once_per_change_and_removes_the_drained_pods(
    kube, scenarios_dir, redis_client
):
    cluster = fleet_on(kube, scenarios_dir, "Deployment", actuator="kubernetes")
    plan = proposed(cluster)
    moved = [c["instance"] for c in plan.role_changes]
    pods = {i.name: i.labels["pod"] for i in Instance.objects.filter(name__in=moved)}
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)

    assert plan.status == PlanStatus.APPLIED, plan.error
    n = len(moved)
    assert accepted(kube, f"{PD}-decode") == [6 - k for k in range(1, n + 1)]
    assert accepted(kube, f"{PD}-prefill") == [2 + k for k in range(1, n + 1)]
    assert not set(pods.values()) & set(kube.pod_names(f"{PD}-decode", live=False))
    assert kube.ready_count(f"{PD}-prefill") == 2 + n
    for name in moved:
        inst = Instance.objects.get(name=name)
        assert inst.state == InstanceState.DOWN  # its pod is gone; the new pod's agent joins
    flips = plan.steps.filter(phase=PlanStep.Phase.APPLY, action="flip").order_by("index")
    assert all(f"of {2 + k} ready" in f.detail for k, f in enumerate(flips, start=1))
    assert plan.policy_version_after is not None


def test_a_denied_permission_fails_the_plan_at_once_with_the_verb_and_resource(
    kube, scenarios_dir, redis_client
):
    cluster = fleet_on(kube, scenarios_dir, "Deployment", actuator="kubernetes")
    kube.deny("patch", "deployments.apps/scale")
    plan = proposed(cluster)
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)

    assert plan.status == PlanStatus.FAILED
    assert "(flip) failed: Kubernetes denied patch deployments.apps/scale" in plan.error
    failed = plan.steps.get(status=PlanStep.Status.FAILED)
    assert failed.attempts == 1  # refused, not retried in a loop
    assert kube.workloads[("apps", "deployments", "inference", f"{PD}-decode")].replicas == 6


def test_a_statefulset_plan_drains_the_highest_ordinals_and_activates_the_pods_that_joined(
    kube, scenarios_dir, redis_client
):
    cluster = fleet_on(kube, scenarios_dir, "StatefulSet", actuator="kubernetes")
    # The pods the grown role will get, declared ahead (issue 32: their agents register them).
    for k in (2, 3):
        services.instance_create(
            actor=CLI_ACTOR,
            cluster_id=cluster.pk,
            name=f"{PD}-prefill-{k}",
            role=InstanceRole.PREFILL,
            state=InstanceState.DOWN,
        )
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    plan = proposed(cluster)
    decode_pods = [
        Instance.objects.get(name=c["instance"]).labels["pod"] for c in plan.role_changes
    ]
    n = len(decode_pods)
    assert decode_pods == [f"{PD}-decode-{5 - k}" for k in range(n)]  # highest ordinals first
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)

    assert plan.status == PlanStatus.APPLIED, plan.error
    assert kube.pod_names(f"{PD}-decode") == [f"{PD}-decode-{k}" for k in range(6 - n)]
    joined = Instance.objects.filter(name__in=[f"{PD}-prefill-{k}" for k in range(2, 2 + n)])
    assert {(i.role, i.state) for i in joined} == {(InstanceRole.PREFILL, InstanceState.ACTIVE)}


def test_rollback_restores_both_roles_removing_the_pods_the_apply_added(
    kube, scenarios_dir, redis_client
):
    cluster = fleet_on(kube, scenarios_dir, "Deployment", actuator="kubernetes")
    plan = proposed(cluster)
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)
    added = [
        pod
        for step in plan.steps.filter(phase=PlanStep.Phase.APPLY, action="flip")
        for pod in step.actuation["grow"]["added"]
    ]
    rebalance.plan_rollback(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)

    assert plan.status == PlanStatus.ROLLED_BACK, plan.error
    workloads = {w.name: w.replicas for w in kube.workloads.values()}
    assert workloads == {f"{PD}-prefill": 2, f"{PD}-decode": 6}
    time.sleep(kube.terminate_delay_s + 0.3)
    assert not set(added) & set(kube.pod_names(f"{PD}-prefill", live=False))


def test_the_metrics_actuator_publishes_desired_replicas_with_the_plan_id(
    kube, scenarios_dir, redis_client
):
    cluster = fleet_on(kube, scenarios_dir, "Deployment", actuator="metrics")
    before = Client().get("/metrics").content.decode()
    assert f'prfaas_desired_replicas{{cluster="{PD}",plan_id="",role="decode"}} 6.0' in before
    plan = proposed(cluster)
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan = drive(plan)
    n = len(plan.role_changes)

    assert plan.status == PlanStatus.APPLIED, plan.error
    body = Client().get("/metrics").content.decode()
    assert (
        f'prfaas_desired_replicas{{cluster="{PD}",plan_id="{plan.pk}",role="decode"}} {6 - n}.0'
        in body
    )
    assert (
        f'prfaas_desired_replicas{{cluster="{PD}",plan_id="{plan.pk}",role="prefill"}} {2 + n}.0'
        in body
    )
    assert kube.requests == []  # no access to the cluster at all


def test_the_kubernetes_actuator_needs_the_clusters_scale_targets(scenarios_dir, redis_client):
    cluster = inventory_load(scenarios_dir)
    with pytest.raises(Exception, match="names no scale target for prefill and decode"):
        rebalance.rebalance_settings_update(
            cluster_id=cluster.pk, changes={"actuator": "kubernetes"}, actor=OPERATOR
        )
