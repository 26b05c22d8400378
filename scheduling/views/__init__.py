"""Scheduling pages: decisions, alerts, policies and the KV calculator (what-if and plans:
submodules)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane import live
from controlplane.models import TokenScope
from controlplane.roles import scope_required
from scheduling import alerts, decision_log, overview, selectors
from scheduling.core.routing import REASON_DESCRIPTIONS
from scheduling.forms import KvCalculatorForm


@scope_required(TokenScope.READ)
def decision_list_page(request: HttpRequest) -> HttpResponse:
    """The decision log, newest first: filters, a cursor for older pages; with ``rows=1`` only
    the table body (the live tail polls it)."""
    query = {k: request.GET.get(k, "").strip()[:200] for k in ("request_id", "origin", "reason")}
    before = request.GET.get("before", "")
    page = decision_log.decision_log_page(
        request_id=query["request_id"],
        origin=query["origin"],
        reason=query["reason"],
        before=before,
    )
    oldest, _ = decision_log.decision_log_span()
    context = {
        "page": page,
        "query": query,
        "before": before,
        "reasons": sorted(REASON_DESCRIPTIONS.items()),
        "reason_help": REASON_DESCRIPTIONS.get(query["reason"], ""),
        "retention_s": settings.DECISION_LOG_RETENTION_S,
        "oldest": oldest,
    }
    if request.GET.get("rows") == "1":
        return render(request, "scheduling/decision_rows.html", context)
    context["ttft"] = selectors.ttft_comparisons()
    return render(request, "scheduling/decision_list.html", context)


@scope_required(TokenScope.READ)
def alert_list_page(request: HttpRequest) -> HttpResponse:
    """Alert history: every episode, open ones first in time order."""
    return render(request, "scheduling/alert_list.html", {"episodes": alerts.alert_history()})


@scope_required(TokenScope.READ)
def policy_list_page(request: HttpRequest) -> HttpResponse:
    return render(request, "scheduling/policy_list.html", {"rows": selectors.policy_history()})


@scope_required(TokenScope.READ)
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


@scope_required(TokenScope.READ)
def overview_page(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "scheduling/overview.html",
        {
            "snapshot": overview.overview_snapshot(),
            "group": live.OVERVIEW,
            "fleet_clock_speed": float(settings.FLEET_CLOCK_SPEED),
        },
    )
