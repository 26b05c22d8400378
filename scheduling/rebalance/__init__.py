"""The Django side of the long-term rebalancer: ticks, plans and their lifecycle, applying.

``selectors`` (reads), ``inputs`` (what a tick reads), ``tick`` (the tick and its settings),
``lifecycle`` (approve, reject, roll back, resume) and ``apply`` (one step at a time). The
public services and selectors are re-exported here.
"""

from scheduling.rebalance import desired as _desired  # noqa: F401  (registers its /metrics gauge)
from scheduling.rebalance.apply import MAX_STEP_ATTEMPTS, plan_apply_step
from scheduling.rebalance.lifecycle import (
    PLAN_APPLY_STEP_TASK,
    plan_approve,
    plan_reject,
    plan_resume,
    plan_rollback,
)
from scheduling.rebalance.selectors import (
    guards_for,
    period_start_for,
    plan_get,
    plan_list,
    plan_observed,
    plan_predicted_refusal,
    plan_steps,
    plans_in_flight,
    plans_in_force,
    plans_snapshot,
    plans_stalled,
    rebalance_settings_for,
    rebalance_ticks_recent,
)
from scheduling.rebalance.tick import (
    rebalance_run_now,
    rebalance_settings_update,
    rebalance_tick,
    rebalance_ticks_prune,
)

__all__ = [
    "MAX_STEP_ATTEMPTS",
    "PLAN_APPLY_STEP_TASK",
    "guards_for",
    "period_start_for",
    "plan_apply_step",
    "plan_approve",
    "plan_get",
    "plan_list",
    "plan_observed",
    "plan_predicted_refusal",
    "plan_reject",
    "plan_resume",
    "plan_rollback",
    "plan_steps",
    "plans_in_flight",
    "plans_in_force",
    "plans_snapshot",
    "plans_stalled",
    "rebalance_run_now",
    "rebalance_settings_for",
    "rebalance_settings_update",
    "rebalance_tick",
    "rebalance_ticks_prune",
    "rebalance_ticks_recent",
]
