"""Celery tasks of the operator UI: the overview's periodic frames and what-if runs."""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="controlplane.live_overview_tick", ignore_result=True)
def live_overview_tick() -> int:
    """Publish the overview's slow-moving state (decision mix, alerts, policy)."""
    from controlplane.dashboard import overview_tick_publish

    return overview_tick_publish()


@shared_task(name="controlplane.whatif_run", acks_late=True, ignore_result=True)
def whatif_run(run_id: int) -> dict[str, Any]:
    """Simulate a stored what-if run, publishing progress to its live group."""
    from scheduling.whatif import whatif_execute

    return whatif_execute(run_id)
