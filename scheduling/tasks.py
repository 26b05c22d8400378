"""Celery tasks of the scheduling app: thin wrappers over services, named like them.

The beat schedule lives in settings (``CELERY_BEAT_SCHEDULE``): ``rebalance`` every
``REBALANCE_INTERVAL_S`` with ``expires`` just under the period (a tick that could not start
within its period is pointless: the next one supersedes it), a crash-recovery sweep, the
overview's periodic frames, engine scraping for fleets without agents, and the reachability
sweep of instances whose heartbeats stopped. Exactly-once is the
services' job (the tick id is unique); these tasks may run twice.

Services that enqueue a task (plan approval, what-if start) send it by name
(``PLAN_APPLY_STEP_TASK``, ``WHATIF_EXECUTE_TASK``): this module imports them, never the reverse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import datetime
from typing import Any

from celery import shared_task
from django.conf import settings

from clusters.live.scrape import instances_scrape
from clusters.models import Cluster, ClusterKind
from clusters.reachability import instances_reachability_sweep as reachability_sweep
from scheduling import rebalance as rebalance_services
from scheduling.core import brute_force
from scheduling.core.scenario import scenario_parse
from scheduling.decision_log import decision_log_archive as decision_log_copy
from scheduling.decisions import control_tick_async
from scheduling.overview import overview_tick_publish as overview_publish
from scheduling.whatif import WHATIF_EXECUTE_TASK
from scheduling.whatif import whatif_execute as whatif_run

logger = logging.getLogger(__name__)

# Steps run back to back in one task invocation before it hands over to a new message.
STEPS_PER_TASK = 50


@shared_task(name="scheduling.rebalance", ignore_result=True)
def rebalance() -> int:
    """Beat: one tick per enabled PD cluster for the current period."""
    period_start = rebalance_services.period_start_for(time.time())
    count = 0
    for cluster in Cluster.objects.filter(kind=ClusterKind.PD):
        if not rebalance_services.rebalance_settings_for(cluster).enabled:
            continue
        rebalance_tick.apply_async(
            (cluster.pk, period_start.isoformat()),
            expires=max(1.0, settings.REBALANCE_INTERVAL_S - 5),
        )
        count += 1
    return count


@shared_task(name="scheduling.rebalance_tick", ignore_result=True)
def rebalance_tick(cluster_id: int, period_start: str) -> int:
    """One tick of one cluster (idempotent: the same period gives the same recorded tick)."""
    tick = rebalance_services.rebalance_tick(
        cluster_id=cluster_id, period_start=datetime.fromisoformat(period_start)
    )
    logger.info("rebalance tick %s: %s (%s)", tick.pk, tick.action, tick.reason)
    return tick.pk


@shared_task(name=rebalance_services.PLAN_APPLY_STEP_TASK, ignore_result=True, acks_late=True)
def plan_apply_step(plan_id: int) -> str:
    """Run a plan's pending steps; re-schedule itself for waits instead of sleeping."""
    for _ in range(STEPS_PER_TASK):
        outcome, delay = rebalance_services.plan_apply_step(plan_id=plan_id)
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
    stalled = rebalance_services.plans_stalled(float(settings.PLAN_STALLED_S))
    for plan_id in stalled:
        plan_apply_step.delay(plan_id)
    return len(stalled)


@shared_task(name="scheduling.rebalance_ticks_prune", ignore_result=True)
def rebalance_ticks_prune() -> int:
    """Beat, daily: drop old ticks that held (plans and their ticks are kept)."""
    return rebalance_services.rebalance_ticks_prune(
        older_than_days=settings.REBALANCE_TICK_RETENTION_DAYS
    )


@shared_task(name="scheduling.overview_tick_publish", ignore_result=True)
def overview_tick_publish() -> int:
    """Beat: publish the overview's slow-moving state (decision mix, alerts, policy)."""
    return overview_publish()


@shared_task(name="scheduling.decision_log_archive", ignore_result=True)
def decision_log_archive() -> int:
    """Beat: copy the recent decisions into the searchable decision log. Returns rows added."""
    return decision_log_copy().added


@shared_task(name=WHATIF_EXECUTE_TASK, acks_late=True, ignore_result=True)
def whatif_execute(run_id: int) -> dict[str, Any]:
    """Simulate a stored what-if run, publishing progress to its live group."""
    return whatif_run(run_id)


@shared_task(name="scheduling.engines_scrape", ignore_result=True)
def engines_scrape() -> int:
    """Beat: scrape every active instance's Prometheus endpoint into live state, then advance
    the short-term control state (the route path advances it too, so a failure only logs)."""
    stored = instances_scrape().stored
    if stored:
        try:
            asyncio.run(control_tick_async())
        except Exception as exc:
            logger.warning("control tick after scrape failed: %s", exc)
    return stored


@shared_task(name="scheduling.instances_reachability_sweep", ignore_result=True)
def instances_reachability_sweep() -> int:
    """Beat: instances whose heartbeats stopped are marked unreachable, later retired.
    Returns the number of instances changed."""
    result = reachability_sweep()
    if result.marked or result.returned or result.retired:
        logger.info(
            "reachability: unreachable %s, back %s, retired %s",
            result.marked,
            result.returned,
            result.retired,
        )
    return len(result.marked) + len(result.returned) + len(result.retired)


@shared_task(name="scheduling.slo_cell_goodput")
def slo_cell_goodput(
    scenario: dict[str, Any],
    setting: dict[str, list[float]],
    floor: float,
    slo_s: float,
    requests: int,
    seed: int,
) -> dict[str, Any]:
    """One cell of the SLO brute force (``bench/slo_brute_force.py --workers``): the
    scenario as :func:`scheduling.core.scenario_writer.scenario_to_dict` writes it, the
    setting as JSON lists; returns the cell's goodput and the simulations it took."""
    found = brute_force.slo_cell_goodput(
        scenario_parse(scenario, base_dir=settings.BASE_DIR),
        {name: (float(t), int(p), int(d)) for name, (t, p, d) in setting.items()},
        floor,
        slo_s=slo_s,
        requests=requests,
        seed=seed,
    )
    return dataclasses.asdict(found)
