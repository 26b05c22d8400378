"""Plans through the services, on real PostgreSQL and Redis: ticks exactly once per period,
holds with reasons, the lifecycle, drain-then-flip, idempotent steps, rollback, illegal moves."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from django.conf import settings
from django.utils import timezone

from clusters.models import Cluster, Instance, InstanceState
from controlplane.audit import Actor
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.models import ChangeRecord
from scheduling import rebalance, tasks
from scheduling.core import rebalancer
from scheduling.models import Plan, PlanStatus, PlanStep, Policy, RebalanceTick
from scheduling.policies import policy_current
from tests.scheduling.rebalance_support import (
    PD,
    PERIOD,
    inventory_load,
    planner_answer,
    policy_set,
    role_counts,
    roles,
    sampled_lengths,
    settings_set,
    telemetry_fresh,
    traffic_record,
)

pytestmark = pytest.mark.django_db

OPERATOR = Actor(label="user:ops", source="api")


@pytest.fixture
def fleet(scenarios_dir: Path, redis_client) -> Cluster:
    cluster = inventory_load(scenarios_dir)  # tuned for mu 9.3: 2 prefill, 6 decode
    policy_set(8500)
    # Two role changes allowed per plan, so the plan can reach the planner's answer at once.
    settings_set(cluster, guards={"max_change_fraction": 0.25, "persist_ticks": 1})
    Instance.objects.filter(cluster=cluster).update(updated_at=timezone.now() - timedelta(hours=1))
    return cluster


def current_policy() -> Policy:
    policy = policy_current()
    assert policy is not None
    return policy


def drifted(seed: int = 1) -> tuple[datetime, np.ndarray]:
    """Traffic of the drifted hours (mu 10.2) recorded in the window ending at a period start."""
    period = rebalance.period_start_for(time.time())
    lengths = sampled_lengths(seed, 10.2, int(2.6 * PERIOD))
    traffic_record(period.timestamp(), lengths)
    telemetry_fresh()
    return period, lengths


def tick(cluster: Cluster, period) -> RebalanceTick:
    return rebalance.rebalance_tick(cluster_id=cluster.pk, period_start=period)


def apply_all(plan: Plan, *, limit: int = 200, busy: dict[str, int] | None = None) -> list[str]:
    """Run steps until the plan finishes; the engines report (idle unless ``busy``) meanwhile."""
    outcomes: list[str] = []
    for _ in range(limit):
        telemetry_fresh(busy=busy)
        outcome, _ = rebalance.plan_apply_step(plan_id=plan.pk)
        outcomes.append(outcome)
        if outcome in ("done", "idle"):
            break
    return outcomes


def test_a_tick_on_drifted_traffic_proposes_the_planners_threshold_and_split(fleet, scenarios_dir):
    period, lengths = drifted()
    t = tick(fleet, period)
    assert (t.action, t.reason) == ("propose", "gain"), t.detail
    plan = Plan.objects.get(tick=t)
    expected = planner_answer(scenarios_dir, lengths)
    assert (plan.threshold_after, plan.n_p_after, plan.n_d_after) == (
        round(expected.threshold),
        expected.n_p,
        expected.n_d,
    )
    assert (plan.threshold_before, plan.n_p_before, plan.n_d_before) == (8500, 2, 6)
    assert plan.status == PlanStatus.PROPOSED  # manual mode waits for an operator
    assert plan.inputs["policy_version"] == current_policy().version
    assert plan.inputs["window"]["arrivals"] == len(lengths)
    assert (
        plan.predictions["proposed"]["capacity_rps"] > plan.predictions["current"]["capacity_rps"]
    )
    assert {c["from_role"] for c in plan.role_changes} == {"decode"}
    assert ChangeRecord.objects.filter(object_type="scheduling.plan", action="propose").count() == 1


def test_two_ticks_for_the_same_period_record_one_tick_and_one_plan(fleet):
    period, _ = drifted()
    first, second = tick(fleet, period), tick(fleet, period)
    assert first.pk == second.pk
    assert RebalanceTick.objects.count() == 1
    assert Plan.objects.count() == 1


def test_approval_applies_through_drain_then_flip_and_bumps_the_policy_once(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    version = current_policy().version
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.APPLYING and plan.approved_by == "user:ops"
    steps = list(plan.steps.order_by("index").values_list("action", flat=True))
    assert steps == ["drain", "wait", "flip", "activate"] * len(plan.role_changes) + ["policy"]

    # The first instance is drained: routers stop using it; it is not flipped before it is empty.
    rebalance.plan_apply_step(plan_id=plan.pk)
    flipped = plan.role_changes[0]["instance"]
    assert Instance.objects.get(name=flipped).state == InstanceState.DRAINING
    telemetry_fresh(busy={flipped: 3})
    outcome, delay = rebalance.plan_apply_step(plan_id=plan.pk)
    assert outcome == "wait" and delay > 0
    assert Instance.objects.get(name=flipped).role == "decode"

    telemetry_fresh()
    assert apply_all(plan)[-1] == "done"
    plan.refresh_from_db()
    assert plan.status == PlanStatus.APPLIED
    assert role_counts() == (plan.n_p_after, plan.n_d_after)
    assert all(i.state == InstanceState.ACTIVE for i in Instance.objects.all())
    current = current_policy()
    assert current.version == version + 1 == plan.policy_version_after
    assert current.thresholds[PD] == plan.threshold_after
    assert all(s.finished_at and s.started_at for s in plan.steps.all())
    for change in plan.role_changes:
        inst = Instance.objects.get(name=change["instance"])
        records = ChangeRecord.objects.filter(
            object_type="clusters.instance", object_id=str(inst.pk)
        )
        assert records.filter(action="drain").count() == 1
        assert records.filter(action="activate").count() == 1
        assert records.filter(action="update").count() == 1  # the role flip


def test_applying_again_after_completion_changes_nothing(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    apply_all(plan)
    records, versions = ChangeRecord.objects.count(), Policy.objects.count()
    assert apply_all(plan) == ["idle"]
    rebalance.plan_resume(plan_id=plan.pk)
    assert (ChangeRecord.objects.count(), Policy.objects.count()) == (records, versions)


def test_a_drain_that_never_empties_gives_up_after_its_timeout(fleet):
    period, _ = drifted()
    settings_set(fleet, drain_timeout_s=30)
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    rebalance.plan_apply_step(plan_id=plan.pk)
    busy = {c["instance"]: 5 for c in plan.role_changes}
    telemetry_fresh(busy=busy)
    assert rebalance.plan_apply_step(plan_id=plan.pk)[0] == "wait"
    PlanStep.objects.filter(plan=plan, action="drain").update(
        finished_at=timezone.now() - timedelta(seconds=31)
    )
    outcomes = apply_all(plan, limit=20, busy=busy)
    assert outcomes[-1] == "wait"  # the second instance's drain has just begun
    PlanStep.objects.filter(plan=plan, action="drain").update(
        finished_at=timezone.now() - timedelta(seconds=31)
    )
    assert apply_all(plan, busy=busy)[-1] == "done"
    wait = PlanStep.objects.filter(plan=plan, action="wait").order_by("index")[0]
    assert "timeout" in wait.detail


def test_auto_mode_applies_the_plan_the_tick_proposes(fleet):
    settings_set(fleet, mode="auto")
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    assert plan.status == PlanStatus.APPLYING and plan.approved_by == "rebalancer"
    telemetry_fresh()
    apply_all(plan)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.APPLIED


def test_rollback_restores_the_previous_threshold_and_roles(fleet):
    before = roles()
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    apply_all(plan)
    applied_version = current_policy().version
    rebalance.plan_rollback(plan_id=plan.pk, actor=OPERATOR)
    apply_all(plan)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.ROLLED_BACK
    assert roles() == before
    assert current_policy().version == applied_version + 1 == plan.policy_version_restored
    assert current_policy().thresholds[PD] == 8500


def test_a_newer_proposal_waits_while_one_is_under_review_then_supersedes_it_once_stale(fleet):
    period, _ = drifted()
    first = Plan.objects.get(tick=tick(fleet, period))
    later = period + timedelta(seconds=PERIOD)
    traffic_record(later.timestamp(), sampled_lengths(2, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    held = tick(fleet, later)
    assert (held.action, held.reason) == ("hold", "plan_under_review")
    assert f"plan {first.pk} is under review" in held.detail
    first.refresh_from_db()
    assert first.status == PlanStatus.PROPOSED
    # Nobody reviewed it for longer than PLAN_REVIEW_STALE_S: the next proposal replaces it.
    Plan.objects.filter(pk=first.pk).update(
        proposed_at=timezone.now() - timedelta(seconds=settings.PLAN_REVIEW_STALE_S + 1)
    )
    latest = later + timedelta(seconds=PERIOD)
    traffic_record(latest.timestamp(), sampled_lengths(2, 10.2, int(2.6 * PERIOD)))
    telemetry_fresh()
    second = Plan.objects.get(tick=tick(fleet, latest))
    first.refresh_from_db()
    assert first.status == PlanStatus.SUPERSEDED and second.status == PlanStatus.PROPOSED
    assert first.closed_reason.startswith("stale")


def test_a_rejected_plan_keeps_the_operators_reason(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_reject(plan_id=plan.pk, actor=OPERATOR, reason="  peak hour, not now ")
    plan.refresh_from_db()
    assert (plan.status, plan.closed_reason) == (PlanStatus.REJECTED, "peak hour, not now")


@pytest.mark.parametrize(
    ("prepare", "call", "status"),
    [
        ("applied", "approve", PlanStatus.APPLIED),
        ("applied", "reject", PlanStatus.APPLIED),
        ("rejected", "rollback", PlanStatus.REJECTED),
        ("rejected", "approve", PlanStatus.REJECTED),
        ("proposed", "rollback", PlanStatus.PROPOSED),
    ],
)
def test_illegal_transitions_conflict_and_change_nothing(fleet, prepare, call, status):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    if prepare == "applied":
        rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
        apply_all(plan)
    elif prepare == "rejected":
        rebalance.plan_reject(plan_id=plan.pk, actor=OPERATOR)
    plan.refresh_from_db()
    snapshot = (plan.version, ChangeRecord.objects.count(), Policy.objects.count(), roles())
    service = {
        "approve": rebalance.plan_approve,
        "reject": rebalance.plan_reject,
        "rollback": rebalance.plan_rollback,
    }[call]
    with pytest.raises(Conflict) as err:
        service(plan_id=plan.pk, actor=OPERATOR)
    assert err.value.status == 409 and err.value.code == "illegal_transition"
    plan.refresh_from_db()
    assert plan.status == status
    assert (plan.version, ChangeRecord.objects.count(), Policy.objects.count(), roles()) == snapshot


def test_a_stale_version_or_a_missing_plan_is_refused(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    with pytest.raises(Conflict, match="version"):
        rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR, version=plan.version + 5)
    with pytest.raises(NotFound):
        rebalance.plan_approve(plan_id=plan.pk + 1000, actor=OPERATOR)


def test_a_plan_whose_instances_changed_meanwhile_is_refused_as_stale(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    Instance.objects.filter(name=plan.role_changes[0]["instance"]).update(state="down")
    with pytest.raises(Conflict, match="stale"):
        rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.PROPOSED


# --- holds ----------------------------------------------------------------------------------


def test_no_telemetry_holds_as_missing_metrics_and_changes_nothing(fleet, redis_client):
    period = rebalance.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, 1500))
    t = tick(fleet, period)
    assert (t.action, t.reason) == ("hold", rebalancer.HOLD_MISSING_METRICS)
    assert Plan.objects.count() == 0 and role_counts() == (2, 6)


def test_stale_telemetry_holds_as_stale_metrics(fleet):
    period = rebalance.period_start_for(time.time())
    traffic_record(period.timestamp(), sampled_lengths(1, 10.2, 1500))
    telemetry_fresh(ts=time.time() - 3600)
    t = tick(fleet, period)
    assert (t.action, t.reason) == ("hold", rebalancer.HOLD_STALE_METRICS)
    assert "s old" in t.detail or "last seen" in t.detail


def test_zero_traffic_with_live_engines_is_no_traffic_not_missing_data(fleet):
    period = rebalance.period_start_for(time.time())
    telemetry_fresh()
    t = tick(fleet, period)
    assert (t.action, t.reason) == ("hold", rebalancer.HOLD_NO_TRAFFIC)
    assert Plan.objects.count() == 0


def test_recently_changed_instances_hold_as_warming_up(fleet):
    period, _ = drifted()
    Instance.objects.filter(name=f"{PD}-0").update(updated_at=timezone.now())
    t = tick(fleet, period)
    assert (t.action, t.reason) == ("hold", rebalancer.HOLD_WARMING_UP)


def test_a_tick_while_a_plan_is_applying_holds(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    later = period + timedelta(seconds=PERIOD)
    traffic_record(later.timestamp(), sampled_lengths(3, 9.3, 1500))
    telemetry_fresh()
    t = tick(fleet, later)
    assert t.action == "hold"
    assert Plan.objects.count() == 1


def test_bad_settings_are_refused_by_name(fleet):
    with pytest.raises(Invalid, match="dead_bnad"):
        rebalance.rebalance_settings_update(
            cluster_id=fleet.pk, changes={"guards": {"dead_bnad": 0.1}}, actor=OPERATOR
        )
    with pytest.raises(Invalid, match="mode"):
        rebalance.rebalance_settings_update(
            cluster_id=fleet.pk, changes={"mode": "yolo"}, actor=OPERATOR
        )
    with pytest.raises(Invalid, match="webhook"):
        rebalance.rebalance_settings_update(
            cluster_id=fleet.pk, changes={"actuator": "webhook", "webhook_url": ""}, actor=OPERATOR
        )
    with pytest.raises(Invalid, match="unknown setting"):
        rebalance.rebalance_settings_update(
            cluster_id=fleet.pk, changes={"colour": 1}, actor=OPERATOR
        )
    prfaas = Cluster.objects.get(name="prfaas-h200")
    with pytest.raises(Invalid, match="only pd clusters"):
        rebalance.rebalance_tick(cluster_id=prfaas.pk, period_start=timezone.now())


def test_every_lifecycle_change_and_step_emits_a_live_plan_event(
    fleet, django_capture_on_commit_callbacks
):
    import asyncio

    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from controlplane.live import PLANS

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(PLANS, channel)
    period, _ = drifted()
    with django_capture_on_commit_callbacks(execute=True):
        plan = Plan.objects.get(tick=tick(fleet, period))
    with django_capture_on_commit_callbacks(execute=True):
        rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    for _ in range(3):
        with django_capture_on_commit_callbacks(execute=True):
            telemetry_fresh()
            rebalance.plan_apply_step(plan_id=plan.pk)

    async def collect(count: int) -> list[dict]:
        return [await asyncio.wait_for(layer.receive(channel), 5) for _ in range(count)]

    frames = [message["frame"] for message in async_to_sync(collect)(6)]
    assert {frame["data"]["plan_id"] for frame in frames} == {plan.pk}
    assert [frame["seq"] for frame in frames] == sorted({frame["seq"] for frame in frames})
    states = [frame["data"]["state"] for frame in frames]
    assert states == [
        "proposed",
        "approved",
        "applying",
        "applying:drain",
        "applying:wait",
        "applying:flip",
    ]


def test_the_beat_runs_rebalance_every_interval_and_expires_it_within_the_period():
    from django.conf import settings

    entry: dict[str, Any] = settings.CELERY_BEAT_SCHEDULE["rebalance"]
    assert entry["task"] == "scheduling.rebalance"
    assert entry["schedule"] == settings.REBALANCE_INTERVAL_S
    assert 0 < entry["options"]["expires"] < settings.REBALANCE_INTERVAL_S


def test_the_rebalance_task_queues_one_expiring_tick_per_enabled_pd_cluster(fleet, redis_client):
    assert tasks.rebalance.run() == 1  # one pd cluster; the prfaas cluster never rebalances
    settings_set(fleet, enabled=False)
    assert tasks.rebalance.run() == 0
    [raw] = redis_client.lrange("celery", 0, -1)
    message = json.loads(raw)
    assert message["headers"]["task"] == "scheduling.rebalance_tick"
    assert message["headers"]["expires"]


def test_plans_stuck_applying_are_found_for_the_resume_sweep(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    assert rebalance.plans_stalled(300) == []
    Plan.objects.filter(pk=plan.pk).update(updated_at=timezone.now() - timedelta(minutes=10))
    assert rebalance.plans_stalled(300) == [plan.pk]


def test_a_plan_polling_a_slow_drain_is_not_taken_for_stalled(fleet):
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    settings_set(fleet, drain_poll_s=120)  # it records progress every two minutes
    Plan.objects.filter(pk=plan.pk).update(updated_at=timezone.now() - timedelta(seconds=150))
    assert rebalance.plans_stalled(60) == []
    Plan.objects.filter(pk=plan.pk).update(updated_at=timezone.now() - timedelta(seconds=400))
    assert rebalance.plans_stalled(60) == [plan.pk]


def test_old_holding_ticks_are_pruned_and_plans_kept(fleet):
    period, _ = drifted()
    tick(fleet, period)  # a plan
    telemetry_fresh()
    old = period - timedelta(days=40)
    tick(fleet, old)  # a hold (nothing recorded back then)
    assert rebalance.rebalance_ticks_prune(older_than_days=30) == 1
    assert RebalanceTick.objects.count() == 1 and Plan.objects.count() == 1


def test_a_failed_plan_can_be_rolled_back_and_only_touched_instances_move(fleet, redis_client):
    before = roles()
    period, _ = drifted()
    plan = Plan.objects.get(tick=tick(fleet, period))
    rebalance.plan_approve(plan_id=plan.pk, actor=OPERATOR)
    telemetry_fresh()
    rebalance.plan_apply_step(plan_id=plan.pk)  # drain
    telemetry_fresh()
    rebalance.plan_apply_step(plan_id=plan.pk)  # wait: empty
    # Now nobody listens at the operator's automation: the flip fails for good.
    settings_set(fleet, actuator="webhook", webhook_url="http://127.0.0.1:9/x", webhook_secret="k")
    PlanStep.objects.filter(plan=plan, action="flip").update(
        attempts=rebalance.MAX_STEP_ATTEMPTS - 1
    )
    assert rebalance.plan_apply_step(plan_id=plan.pk) == ("idle", 0.0)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.FAILED and "flip" in plan.error
    drained = plan.role_changes[0]["instance"]
    assert Instance.objects.get(name=drained).state == InstanceState.DRAINING

    settings_set(fleet, actuator="record", webhook_url="", webhook_secret="")
    rebalance.plan_rollback(plan_id=plan.pk, actor=OPERATOR)
    rollback = plan.steps.filter(phase="rollback").order_by("index")
    assert [s.action for s in rollback] == ["drain", "wait", "flip", "activate", "policy"]
    assert (
        rollback[0].instance is not None and rollback[0].instance.name == drained
    )  # the untouched instance is left alone
    apply_all(plan)
    plan.refresh_from_db()
    assert plan.status == PlanStatus.ROLLED_BACK
    assert roles() == before
    assert all(i.state == InstanceState.ACTIVE for i in Instance.objects.all())
