"""Scheduling pages: decisions, policies and the KV calculator (what-if and plans: submodules)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane import live
from controlplane.models import Scope
from controlplane.roles import scope_required
from scheduling import overview, selectors
from scheduling.forms import KvCalculatorForm


@scope_required(Scope.READ)
def decision_list_page(request: HttpRequest) -> HttpResponse:
    origin = request.GET.get("origin") or None
    reason = request.GET.get("reason") or None
    rows = selectors.decisions_recent(origin=origin, reason=reason)
    return render(
        request,
        "scheduling/decision_list.html",
        {
            "decisions": rows,
            "origin": origin or "",
            "reason": reason or "",
            "ttft": selectors.ttft_comparisons(),
        },
    )


@scope_required(Scope.READ)
def policy_list_page(request: HttpRequest) -> HttpResponse:
    return render(request, "scheduling/policy_list.html", {"rows": selectors.policy_history()})


@scope_required(Scope.READ)
def kv_calculator_page(request: HttpRequest) -> HttpResponse:
    form = KvCalculatorForm(request.GET or None)
    result = None
    if form.is_valid():
        data = form.cleaned_data
        result = selectors.kv_calculation(
            model=data["model"],
            profile=data["profile"],
            tokens=data["tokens"],
            instances=data["instances"],
            link=data.get("link"),
            link_gbps=data.get("link_gbps"),
        )
    status = 422 if form.is_bound and not form.is_valid() else 200
    return render(
        request, "scheduling/kv_calculator.html", {"form": form, "result": result}, status=status
    )


@scope_required(Scope.READ)
def overview_page(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "scheduling/overview.html",
        {"snapshot": overview.overview_snapshot(), "group": live.OVERVIEW},
    )
