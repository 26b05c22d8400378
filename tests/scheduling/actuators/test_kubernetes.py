"""The ``kubernetes`` actuator against the stateful fake API server (tests/support/fake_kube.py):
one PATCH per role with the version it read, 409s read again, the drained pod removed, waits
until ready, deadlines, denied permissions, and no double scaling after a crash."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lightkube.core.selector import build_selector

from scheduling.actuators import ActuatorError, KubernetesActuator, StepNotice, StepReport
from scheduling.actuators.kube_api import DELETION_COST, KubeApi, selector_pairs
from scheduling.core.scale_targets import ScaleTarget, scale_targets_read
from tests.support.fake_kube import FakeKube


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[FakeKube]:
    with FakeKube(ready_delay_s=0.3, terminate_delay_s=0.2).running() as fake:
        fake.kubeconfig(tmp_path / "kubeconfig")
        yield fake


def targets(spec: dict[str, Any]) -> dict[str, ScaleTarget]:
    return {t.role: t for t in scale_targets_read(spec, (), cluster_kind="pd")}


def actuator(
    kube: FakeKube, tmp_path: Path, spec: dict[str, Any], **options: Any
) -> KubernetesActuator:
    config = str(tmp_path / "kubeconfig")
    options.setdefault("poll_s", 0.05)
    return KubernetesActuator(
        targets(spec),
        {},
        lambda context: KubeApi.connect(kubeconfig=config, context=context, timeout_s=5),
        **options,
    )


DEPLOYMENTS = {
    "prefill": {"kind": "Deployment", "name": "prefill", "namespace": "inference"},
    "decode": {"kind": "Deployment", "name": "decode", "namespace": "inference"},
}


def notice(action: str, pod: str, **fields: Any) -> StepNotice:
    base = StepNotice(
        plan_id=7,
        step=0,
        action=action,
        cluster="pd-h20",
        instance=pod,
        from_role="decode",
        to_role="prefill",
    )
    return replace(base, **fields)


def drive(act: KubernetesActuator, step: StepNotice, timeout: float = 20) -> StepReport | None:
    """Poll a step as the plan's task does: the memo kept between polls."""
    memo = dict(step.memo)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = act.notify(replace(step, memo=memo))
        if report is None or report.done:
            return report
        memo = dict(report.memo)
        time.sleep(report.wait_s)
    pytest.fail(f"the step did not finish within {timeout} s")


def accepted(kube: FakeKube, name: str) -> list[Any]:
    return [r for r in kube.scale_patches(name) if r.status == 200]


def test_a_flip_patches_each_role_once_with_the_version_it_read_and_removes_the_drained_pod(
    kube, tmp_path
):
    kube.add_workload("Deployment", "decode", 4)
    kube.add_workload("Deployment", "prefill", 2)
    drained = kube.pod_names("decode")[1]
    act = actuator(kube, tmp_path, DEPLOYMENTS)

    drain = drive(act, notice("drain", drained))
    assert drain is not None and DELETION_COST in drain.detail
    assert kube.pods[("inference", drained)].annotations[DELETION_COST] == "-2147483648"
    before = {
        name: kube.workloads[("apps", "deployments", "inference", name)].resource_version
        for name in ("decode", "prefill")
    }
    report = drive(act, notice("flip", drained))

    assert report is not None and report.done
    assert [p.body["spec"]["replicas"] for p in accepted(kube, "decode")] == [3]
    assert [p.body["spec"]["replicas"] for p in accepted(kube, "prefill")] == [2 + 1]
    # Each PATCH carried the resourceVersion the actuator had just read (the server refuses
    # any other with 409), and none was refused here.
    assert all(p.body["metadata"]["resourceVersion"] for p in kube.scale_patches("decode"))
    assert len(kube.scale_patches("decode")) == len(kube.scale_patches("prefill")) == 1
    assert (
        int(kube.scale_patches("decode")[0].body["metadata"]["resourceVersion"]) >= before["decode"]
    )
    assert drained not in kube.pod_names("decode", live=False)
    assert len(kube.pod_names("decode")) == 3
    assert kube.ready_count("prefill") == 3
    added = report.memo["grow"]["added"]
    assert len(added) == 1 and added[0] in kube.pod_names("prefill")
    assert "decode 4 -> 3" in report.detail and "3 of 3 ready" in report.detail


def test_a_409_is_reread_and_retried_without_scaling_twice(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 4)
    kube.add_workload("Deployment", "prefill", 2)
    drained = kube.pod_names("decode")[0]
    kube.conflict_next("decode")
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    drive(act, notice("drain", drained))
    drive(act, notice("flip", drained))

    statuses = [p.status for p in kube.scale_patches("decode")]
    assert statuses[0] == 409 and statuses.count(200) == 1
    assert kube.workloads[("apps", "deployments", "inference", "decode")].replicas == 3
    assert drained not in kube.pod_names("decode", live=False)


def test_a_step_retried_after_a_crash_finishes_the_change_it_recorded_instead_of_another(
    kube, tmp_path
):
    kube.add_workload("Deployment", "decode", 4)
    kube.add_workload("Deployment", "prefill", 2)
    drained = kube.pod_names("decode")[2]
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    drive(act, notice("drain", drained))
    step = notice("flip", drained)
    planned = act.notify(step)  # records decode 4 -> 3
    assert planned is not None and not planned.done
    started = act.notify(replace(step, memo=planned.memo))  # the shrink's clock starts
    assert started is not None
    patched = act.notify(replace(step, memo=started.memo))  # PATCHes decode to 3
    assert patched is not None and len(accepted(kube, "decode")) == 1
    # The worker dies before it stores that last report: the retry has the memo before it.
    report = drive(act, replace(step, memo=started.memo))

    assert report is not None and report.done
    assert len(accepted(kube, "decode")) == 1
    assert len(accepted(kube, "prefill")) == 1
    assert kube.workloads[("apps", "deployments", "inference", "decode")].replicas == 3
    assert kube.workloads[("apps", "deployments", "inference", "prefill")].replicas == 3


def test_a_statefulset_removes_its_highest_ordinal_so_the_plan_must_drain_that_pod(kube, tmp_path):
    kube.add_workload("StatefulSet", "decode", 4)
    kube.add_workload("StatefulSet", "prefill", 2)
    spec = {
        "prefill": {"kind": "StatefulSet", "name": "prefill", "namespace": "inference"},
        "decode": {"kind": "StatefulSet", "name": "decode", "namespace": "inference"},
    }
    act = actuator(kube, tmp_path, spec)
    with pytest.raises(ActuatorError) as refused:
        act.notify(notice("drain", "decode-1"))
    assert not refused.value.retry
    assert "removes its highest ordinal first (decode-3), not decode-1" in str(refused.value)

    drive(act, notice("drain", "decode-3"))
    report = drive(act, notice("flip", "decode-3"))
    assert report is not None and report.memo["grow"]["added"] == ["prefill-2"]
    assert kube.pod_names("decode") == ["decode-0", "decode-1", "decode-2"]
    assert kube.pod_names("prefill") == ["prefill-0", "prefill-1", "prefill-2"]


def test_lws_disaggregated_set_roles_scale_through_their_role_scalers(kube, tmp_path):
    group = "disaggregatedset.x-k8s.io/v1"
    for role, count in (("decode", 3), ("prefill", 1)):
        kube.add_workload(
            "DisaggregatedSetRoleScaler",
            f"ds-{role}",
            count,
            api_version=group,
            plural="disaggregatedsetrolescalers",
            ordinal=True,
        )
    spec = {
        role: {"kind": "DisaggregatedSetRoleScaler", "name": f"ds-{role}", "namespace": "inference"}
        for role in ("prefill", "decode")
    }
    act = actuator(kube, tmp_path, spec)
    drive(act, notice("drain", "ds-decode-2"))
    report = drive(act, notice("flip", "ds-decode-2"))
    assert report is not None and report.done
    assert [len(accepted(kube, n)) for n in ("ds-decode", "ds-prefill")] == [1, 1]
    assert kube.pod_names("ds-prefill") == ["ds-prefill-0", "ds-prefill-1"]


def test_a_dynamo_adapter_without_ready_replicas_is_ready_when_its_pods_are(kube, tmp_path):
    for service, count in (("decode", 2), ("prefill", 1)):
        kube.add_workload(
            "DynamoGraphDeploymentScalingAdapter",
            f"graph-{service}",
            count,
            api_version="nvidia.com/v1alpha1",
            plural="dynamographdeploymentscalingadapters",
            ordinal=False,
            ready_in_status=False,
        )
    spec = {
        role: {
            "kind": "DynamoGraphDeploymentScalingAdapter",
            "name": f"graph-{role}",
            "namespace": "inference",
        }
        for role in ("prefill", "decode")
    }
    kube.ready_delay_s = 1.0
    drained = kube.pod_names("graph-decode")[0]
    act = actuator(kube, tmp_path, spec)
    drive(act, notice("drain", drained))
    report = drive(act, notice("flip", drained))
    assert report is not None and report.done
    # Done only once the new pod was ready, though the adapter's status never said so.
    assert kube.ready_count("graph-prefill") == 2


def test_a_denied_permission_fails_the_step_at_once_naming_verb_and_resource(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 2)
    kube.add_workload("Deployment", "prefill", 1)
    kube.deny("patch", "deployments.apps/scale")
    drained = kube.pod_names("decode")[0]
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    drive(act, notice("drain", drained))
    with pytest.raises(ActuatorError) as denied:
        drive(act, notice("flip", drained))
    assert not denied.value.retry
    assert "denied patch deployments.apps/scale on inference/decode" in str(denied.value)
    assert "cannot patch resource" in str(denied.value)
    assert kube.workloads[("apps", "deployments", "inference", "decode")].replicas == 2


def test_a_denied_pod_patch_fails_the_drain_before_anything_changed(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 2)
    kube.add_workload("Deployment", "prefill", 1)
    kube.deny("patch", "pods")
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    with pytest.raises(ActuatorError, match="denied patch pods on inference/decode-"):
        act.notify(notice("drain", kube.pod_names("decode")[0]))
    assert kube.scale_patches("decode") == []


def test_a_role_that_never_gets_ready_fails_the_step_after_its_deadline(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 2)
    kube.add_workload("Deployment", "prefill", 1)
    kube.ready_delay_s = 3600.0  # the new prefill pod never gets ready
    drained = kube.pod_names("decode")[0]
    act = actuator(kube, tmp_path, DEPLOYMENTS, ready_timeout_s=1.0)
    drive(act, notice("drain", drained))
    with pytest.raises(ActuatorError) as late:
        drive(act, notice("flip", drained))
    assert not late.value.retry
    assert "Deployment inference/prefill (prefill, 1 -> 2): 1 of 2 ready after" in str(late.value)


def test_a_controller_that_removes_another_pod_than_the_drained_one_fails_the_step(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 3)
    kube.add_workload("Deployment", "prefill", 1)
    kube.honour_deletion_cost = False  # it removes the newest pod, whatever the annotation
    with kube.lock:
        newest = max(
            (p for p in kube.pods.values() if p.owner == "decode"), key=lambda p: p.created
        )
    drained = next(n for n in kube.pod_names("decode") if n != newest.name)
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    drive(act, notice("drain", drained))
    with pytest.raises(ActuatorError, match=f"instead of the drained {drained}"):
        drive(act, notice("flip", drained))


def test_another_writer_scaling_the_role_stops_the_step_rather_than_scaling_again(kube, tmp_path):
    kube.add_workload("Deployment", "decode", 4)
    kube.add_workload("Deployment", "prefill", 2)
    drained = kube.pod_names("decode")[0]
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    step = notice("flip", drained)
    planned = act.notify(step)
    assert planned is not None
    with kube.lock:
        kube.workloads[("apps", "deployments", "inference", "decode")].replicas = 6
    with pytest.raises(ActuatorError, match="asks for 6 replicas, not the 4 this step read"):
        drive(act, replace(step, memo=planned.memo))
    assert accepted(kube, "decode") == []


def test_a_missing_target_object_is_a_clear_failure(kube, tmp_path):
    act = actuator(kube, tmp_path, DEPLOYMENTS)
    with pytest.raises(ActuatorError, match=r"deployments\.apps/scale inference/decode not found"):
        act.notify(notice("flip", "decode-x"))


def test_no_credentials_is_a_step_failure_saying_how_to_give_them(tmp_path):
    with pytest.raises(ActuatorError) as missing:
        KubeApi.connect(kubeconfig=str(tmp_path / "absent"), context="", timeout_s=1)
    assert not missing.value.retry
    assert "KUBERNETES_KUBECONFIG" in str(missing.value)


@pytest.mark.parametrize(
    ("selector", "query"),
    [
        ("app=x", "app=x"),
        ("app==x,tier!=db", "app=x,tier!=db"),
        ("role in (prefill, decode)", "role in (decode,prefill)"),
        ("!canary,ready", "!canary,ready"),
    ],
)
def test_scale_selectors_are_read_into_the_same_label_query(selector, query):
    assert build_selector(selector_pairs(selector)) == query


def test_an_unreadable_selector_is_refused():
    with pytest.raises(ActuatorError, match="cannot read the label selector"):
        selector_pairs("app in prefill")
