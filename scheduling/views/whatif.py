"""What-if pages: the knobs form, a run's live progress and its results."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from controlplane import live
from controlplane.audit import actor_from_request
from controlplane.errors import ApiError, NotFound
from controlplane.forms import service_error_add
from controlplane.models import TokenScope
from controlplane.roles import scope_required
from scheduling import whatif
from scheduling.forms import WhatIfForm


@scope_required(TokenScope.READ)
def whatif_page(request: HttpRequest) -> HttpResponse:
    return render(request, "scheduling/whatif.html", {"form": WhatIfForm()})


@scope_required(TokenScope.OPERATE)
@require_POST
def whatif_start_page(request: HttpRequest) -> HttpResponse:
    form = WhatIfForm(request.POST)
    if form.is_valid():
        try:
            run_id = whatif.whatif_start(
                form.params(), actor=actor_from_request(request, source="ui")
            )
        except ApiError as exc:
            service_error_add(form, exc)
        else:
            return redirect("whatif-run", run_id=run_id)
    return render(request, "scheduling/whatif.html", {"form": form}, status=422)


@scope_required(TokenScope.READ)
def whatif_run_page(request: HttpRequest, run_id: int) -> HttpResponse:
    try:
        run = whatif.whatif_get(run_id)
    except NotFound as exc:
        raise Http404(exc.detail) from None
    template = (
        "scheduling/whatif_result.html" if request.htmx else "scheduling/whatif_run.html"  # type: ignore[attr-defined]
    )
    return render(request, template, {"run": run, "group": live.whatif_group(run_id)})
