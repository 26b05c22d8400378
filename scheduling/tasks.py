"""Celery tasks of the long-term loop: thin wrappers over ``scheduling.plans`` services.

The beat schedule lives in settings (``CELERY_BEAT_SCHEDULE``): ``rebalance`` every
``REBALANCE_INTERVAL_S`` with ``expires`` just under the period (a tick that could not start
within its period is pointless: the next one supersedes it), and a crash-recovery sweep.
Exactly-once is the services' job (the tick id is unique); these tasks may run twice.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

from celery import shared_task
from django.conf import settings

from clusters.models import Cluster, ClusterKind
from scheduling import plans

logger = logging.getLogger(__name__)

# A plan with no progress for this long is re-driven (its worker probably died).
STALLED_S = 300.0
# Steps run back to back in one task invocation before it hands over to a new message.
STEPS_PER_TASK = 50


@shared_task(name="scheduling.rebalance", ignore_result=True)
def rebalance() -> int:
    """Beat: one tick per enabled PD cluster for the current period."""
    period_start = plans.period_start_for(time.time())
    count = 0
    for cluster_id in Cluster.objects.filter(kind=ClusterKind.PD).values_list("pk", flat=True):
        row = plans.rebalance_settings_for(Cluster.objects.get(pk=cluster_id))
        if not row.enabled:
            continue
        rebalance_tick.apply_async(
            (cluster_id, period_start.isoformat()),
            expires=max(1.0, settings.REBALANCE_INTERVAL_S - 5),
        )
        count += 1
    return count


@shared_task(name="scheduling.rebalance_tick", ignore_result=True)
def rebalance_tick(cluster_id: int, period_start: str) -> int:
    """One tick of one cluster (idempotent: the same period gives the same recorded tick)."""
    tick = plans.rebalance_tick(
        cluster_id=cluster_id, period_start=datetime.fromisoformat(period_start)
    )
    logger.info("rebalance tick %s: %s (%s)", tick.pk, tick.action, tick.reason)
    return tick.pk


@shared_task(name="scheduling.plan_apply_step", ignore_result=True, acks_late=True)
def plan_apply_step(plan_id: int) -> str:
    """Run a plan's pending steps; re-schedule itself for waits instead of sleeping."""
    for _ in range(STEPS_PER_TASK):
        outcome, delay = plans.plan_apply_step(plan_id=plan_id)
        if outcome == "next":
            continue
        if outcome == "wait":
            plan_apply_step.apply_async((plan_id,), countdown=delay)
        return outcome
    plan_apply_step.delay(plan_id)
    return "next"


@shared_task(name="scheduling.plans_resume_stalled", ignore_result=True)
def plans_resume_stalled() -> int:
    """Beat: re-drive plans stuck applying or rolling back (a worker died mid-step)."""
    stalled = plans.plans_stalled(STALLED_S)
    for plan_id in stalled:
        plan_apply_step.delay(plan_id)
    return len(stalled)


@shared_task(name="scheduling.rebalance_ticks_prune", ignore_result=True)
def rebalance_ticks_prune() -> int:
    """Beat, daily: drop old ticks that held (plans and their ticks are kept)."""
    days = float(getattr(settings, "REBALANCE_TICK_RETENTION_DAYS", 30))
    return plans.rebalance_ticks_prune(older_than_days=days)
