"""Plans for tests that apply them on engines: one the rebalancer could have proposed, and
its steps run as the Celery task runs them (sleeping through the waits instead of
re-scheduling)."""

from __future__ import annotations

import time

from django.utils import timezone

from clusters.models import Cluster
from scheduling import rebalance
from scheduling.models import Plan, RebalanceTick


def plan_flip_proposed(
    cluster: Cluster, instance: str, from_role: str, to_role: str, *, n_p: int, n_d: int
) -> Plan:
    """A proposed plan flipping ``instance`` (``n_p``/``n_d``: the split before it)."""
    tick = RebalanceTick.objects.create(
        cluster=cluster, period_start=timezone.now(), action="propose", reason="test"
    )
    step = 1 if to_role == "prefill" else -1
    return Plan.objects.create(
        tick=tick,
        cluster=cluster,
        mode="manual",
        threshold_before=10**6,
        threshold_after=10**6,
        n_p_before=n_p,
        n_d_before=n_d,
        n_p_after=n_p + step,
        n_d_after=n_d - step,
        gain=1.0,
        role_changes=[{"instance": instance, "from_role": from_role, "to_role": to_role}],
    )


def plan_steps_run(plan: Plan, timeout_s: float = 600) -> None:
    """Run the plan's pending steps until it is done (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcome, delay = rebalance.plan_apply_step(plan_id=plan.pk)
        if outcome in ("done", "idle"):
            return
        if outcome == "wait":
            time.sleep(min(delay, 1.0))
    raise AssertionError(f"plan {plan.pk} not done after {timeout_s:.0f} s")
