"""Plan pages: the rebalancer's proposals, predicted against current, and their lifecycle.

Both pages follow the ``plans`` live group: a plan event (from this tab, another operator, or
the worker applying steps) makes the page fetch its fresh HTML fragment, so nobody reloads.
"""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from controlplane import live
from controlplane.audit import actor_from_request
from controlplane.errors import ApiError, NotFound
from controlplane.models import TokenScope
from controlplane.roles import scope_required
from scheduling import rebalance
from scheduling.models import Plan, PlanStatus
from scheduling.views import plan_figures

# The model's figures of both settings for the plan's window: (key, label, unit, digits).
METRICS = [
    ("capacity_rps", "Capacity", "req/s", 3),
    ("throughput_rps", "Served at the planned offered rate", "req/s", 3),
    ("at_rate_ttft_p90_s", "TTFT P90 at the planned offered rate", "s", 3),
    ("ttft_mean_s", "TTFT mean, without queueing", "s", 3),
    ("ttft_p90_s", "TTFT P90, without queueing", "s", 3),
    ("offload_fraction", "Offloaded", "share of requests", 3),
    ("egress_gbps", "Cross-DC egress at the planned offered rate", "Gbps", 2),
]
ACTIONS = {
    "approve": rebalance.plan_approve,
    "reject": rebalance.plan_reject,
    "rollback": rebalance.plan_rollback,
}


def _comparison(plan: Plan) -> list[dict[str, Any]]:
    current = plan.predictions.get("current") or {}
    proposed = plan.predictions.get("proposed") or {}
    rows = []
    for key, label, unit, digits in METRICS:
        before, after = current.get(key), proposed.get(key)
        delta = (
            after - before
            if isinstance(before, int | float) and isinstance(after, int | float)
            else None
        )
        rows.append(
            {
                "key": key,
                "label": label,
                "unit": unit,
                "digits": digits,
                "current": before,
                "proposed": after,
                "delta": delta,
            }
        )
    return rows


def _plan_context(plan: Plan, error: str = "") -> dict[str, Any]:
    observed = rebalance.plan_observed(plan)
    return {
        "plan": plan,
        "planned": plan_figures.planned_window(plan),
        "observed": observed,
        "outcome": plan_figures.outcome_rows(plan, observed),
        "windows": plan_figures.outcome_windows(plan, observed),
        "clock_note": plan_figures.fleet_clock_note(),
        "min_requests": plan_figures.OBSERVED_MIN_REQUESTS,
        "min_first_tokens": plan_figures.OBSERVED_MIN_FIRST_TOKENS,
        "comparison": _comparison(plan),
        "simulated": plan_figures.simulated_rows(plan),
        "verdict": plan_figures.simulation_verdict(plan),
        "steps": rebalance.plan_steps(plan),
        "can_approve": plan.status == PlanStatus.PROPOSED,
        "can_rollback": plan.status == PlanStatus.APPLIED,
        "error": error,
    }


def _plan(plan_id: int) -> Plan:
    try:
        return rebalance.plan_get(plan_id)
    except NotFound as exc:
        raise Http404(exc.detail) from None


@scope_required(TokenScope.READ)
def plan_list_page(request: HttpRequest) -> HttpResponse:
    status = request.GET.get("status") or None
    error = ""
    try:
        rows = list(rebalance.plan_list(status=status))
    except ApiError as exc:
        rows, error = [], exc.detail
    template = "scheduling/plan_table.html" if request.htmx else "scheduling/plan_list.html"  # type: ignore[attr-defined]
    return render(
        request,
        template,
        {
            "plans": rows,
            "ticks": rebalance.rebalance_ticks_recent(limit=30),
            "status": status or "",
            "statuses": PlanStatus.values,
            "error": error,
            "group": live.PLANS,
        },
        status=422 if error else 200,
    )


@scope_required(TokenScope.READ)
def plan_detail_page(request: HttpRequest, plan_id: int) -> HttpResponse:
    plan = _plan(plan_id)
    template = "scheduling/plan_panel.html" if request.htmx else "scheduling/plan_detail.html"  # type: ignore[attr-defined]
    return render(request, template, {**_plan_context(plan), "group": live.PLANS})


@scope_required(TokenScope.OPERATE)
@require_POST
def plan_action_page(request: HttpRequest, plan_id: str, action: str) -> HttpResponse:
    """Approve, reject or roll back; answers with the plan's panel (htmx swaps it in)."""
    plan = _plan(int(plan_id))
    raw_version = request.POST.get("version", "")
    error = ""
    extra = {"reason": request.POST.get("reason", "")} if action == "reject" else {}
    try:
        ACTIONS[action](
            plan_id=plan.pk,
            actor=actor_from_request(request, source="ui"),
            version=int(raw_version) if raw_version.isdigit() else None,
            **extra,
        )
    except ApiError as exc:
        error = exc.detail
    plan = _plan(plan.pk)
    return render(
        request,
        "scheduling/plan_panel.html",
        _plan_context(plan, error),
        status=409 if error else 200,
    )
