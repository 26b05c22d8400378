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

# The predictions the detail page compares, in order: (key, label, unit, digits).
METRICS = [
    ("throughput_rps", "Throughput", "req/s", 3),
    ("capacity_rps", "Capacity", "req/s", 3),
    ("ttft_mean_s", "TTFT mean", "s", 3),
    ("ttft_p90_s", "TTFT P90", "s", 3),
    ("offload_fraction", "Offloaded", "share", 3),
    ("egress_gbps", "Cross-DC egress", "Gbps", 2),
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
                "label": label,
                "unit": unit,
                "digits": digits,
                "current": before,
                "proposed": after,
                "delta": delta,
            }
        )
    return rows


# What the simulation of both settings on the recent traffic showed: (key, label, unit, digits).
SIMULATED = [
    ("rate_rps", "Offered rate", "req/s", 3),
    ("sustained_fraction", "Sustained", "share", 3),
    ("ttft_mean_s", "TTFT mean", "s", 3),
    ("ttft_p90_s", "TTFT P90", "s", 3),
    ("link_congested", "link_congested", "share", 3),
]


def _simulated(plan: Plan) -> list[dict[str, Any]]:
    """Rows of the simulated comparison, per situation (observed rate, stress), next to the
    model's prediction at the observed rate where it has one."""
    sim = plan.simulated or {}
    current = plan.predictions.get("current") or {}
    proposed = plan.predictions.get("proposed") or {}
    predicted = {
        "ttft_mean_s": ("at_rate_ttft_mean_s",),
        "ttft_p90_s": ("at_rate_ttft_p90_s",),
    }
    rows = []
    for situation, title in (("observed", "at the observed rate"), ("stress", "near capacity")):
        runs = sim.get(situation)
        if not runs:
            continue
        for key, label, unit, digits in SIMULATED:
            names = predicted.get(key, ())
            rows.append(
                {
                    "situation": title,
                    "label": label,
                    "unit": unit,
                    "digits": digits,
                    "current": runs["current"].get(key),
                    "proposed": runs["proposed"].get(key),
                    "predicted_current": current.get(names[0])
                    if names and situation == "observed"
                    else None,
                    "predicted_proposed": proposed.get(names[0])
                    if names and situation == "observed"
                    else None,
                }
            )
    return rows


def _observed(plan: Plan) -> list[dict[str, Any]]:
    """Predicted, simulated (at the observed rate) and observed after apply, side by side."""
    observed = rebalance.plan_observed(plan)
    proposed = plan.predictions.get("proposed") or {}
    sim = plan.simulated or {}
    # At the observed rate when that run exists, else the stress run (near capacity).
    simulated = (sim.get("observed") or sim.get("stress") or {}).get("proposed") or {}
    rate, sustained = simulated.get("rate_rps"), simulated.get("sustained_fraction")
    figures = {
        "throughput_rps": rate * sustained
        if isinstance(rate, int | float) and isinstance(sustained, int | float)
        else None,
        "ttft_p90_s": simulated.get("ttft_p90_s"),
    }
    rows = []
    for key, label, unit, digits in (
        ("throughput_rps", "Throughput", "req/s", 3),
        ("offload_fraction", "Offloaded", "share", 3),
        ("egress_gbps", "Cross-DC egress", "Gbps", 2),
        ("ttft_p90_s", "TTFT P90", "s", 3),
    ):
        rows.append(
            {
                "label": label,
                "unit": unit,
                "digits": digits,
                "predicted": proposed.get(key),
                "simulated": figures.get(key),
                "observed": observed.get(key) if observed else None,
            }
        )
    return rows


def _plan_context(plan: Plan, error: str = "") -> dict[str, Any]:
    return {
        "plan": plan,
        "observed": rebalance.plan_observed(plan),
        "outcome": _observed(plan),
        "comparison": _comparison(plan),
        "simulated": _simulated(plan),
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
