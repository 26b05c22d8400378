"""End to end through a real Celery worker and the fake Kubernetes API: an auto tick proposes,
the worker drains, scales both Deployments through /scale and waits until ready, then publishes
the policy; the worker is killed in the middle of a flip, and its successor finishes the plan
without a second PATCH of any step."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django.db import connection

from clusters.models import Instance, InstanceState
from scheduling import rebalance
from scheduling.models import Plan, PlanStatus, PlanStep, Policy
from scheduling.tasks import rebalance_tick as rebalance_tick_task
from tests.scheduling.rebalance.test_plans_kubernetes import fleet_on
from tests.scheduling.rebalance.test_worker import Agents, drifted, status_of, until
from tests.scheduling.rebalance_support import PD
from tests.support.fake_kube import FakeKube
from tests.support.servers import celery_worker_start, celery_worker_stop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_worker_killed_mid_flip_leaves_a_plan_its_successor_applies_without_scaling_twice(
    tmp_path: Path, scenarios_dir, redis_client, settings, monkeypatch
):
    # New pods take 2 s to get ready: long enough to kill the worker while it waits.
    with FakeKube(ready_delay_s=2.0, terminate_delay_s=0.2).running() as kube:
        kubeconfig = str(kube.kubeconfig(tmp_path / "kubeconfig"))
        settings.KUBERNETES_KUBECONFIG = kubeconfig
        monkeypatch.setenv("KUBERNETES_KUBECONFIG", kubeconfig)  # the workers' settings
        cluster = fleet_on(kube, scenarios_dir, "Deployment", actuator="kubernetes")
        settings_row = cluster.rebalance_settings
        settings_row.mode = "auto"
        settings_row.save()
        agents = Agents(list(Instance.objects.values_list("name", flat=True)))
        workers = []
        try:
            period, _ = drifted()
            versions = Policy.objects.count()
            workers.append(celery_worker_start())
            rebalance_tick_task.delay(cluster.pk, period.isoformat())
            until(lambda: kube.scale_patches(f"{PD}-prefill") != [], what="the first grow PATCH")
            celery_worker_stop(workers[0], signal.SIGKILL)  # dies waiting for the new pod
            plan = Plan.objects.get()
            assert plan.status == PlanStatus.APPLYING
            flip = plan.steps.filter(action="flip", status=PlanStep.Status.PENDING).first()
            assert flip is not None and flip.actuation["grow"]["from"] == 2

            workers.append(celery_worker_start())
            rebalance.plan_resume(plan_id=plan.pk)  # as the stalled-plan sweep would
            until(lambda: status_of(plan.pk) == PlanStatus.APPLIED, what="the plan applied")

            plan.refresh_from_db()
            n = len(plan.role_changes)
            accepted = {
                name: [
                    p.body["spec"]["replicas"] for p in kube.scale_patches(name) if p.status == 200
                ]
                for name in (f"{PD}-decode", f"{PD}-prefill")
            }
            assert accepted == {
                f"{PD}-decode": [6 - k for k in range(1, n + 1)],
                f"{PD}-prefill": [2 + k for k in range(1, n + 1)],
            }
            assert kube.ready_count(f"{PD}-prefill") == 2 + n
            drained = [Instance.objects.get(name=c["instance"]) for c in plan.role_changes]
            assert {i.state for i in drained} == {InstanceState.DOWN}
            assert not {i.labels["pod"] for i in drained} & set(
                kube.pod_names(f"{PD}-decode", live=False)
            )
            assert Policy.objects.count() == versions + 1
            assert plan.policy_version_after == max(
                Policy.objects.values_list("version", flat=True)
            )
        finally:
            for proc in workers:
                celery_worker_stop(proc)
            agents.stop()
            connection.close()
