"""Fleet pages: clusters with their instances and live load (drain, activate), and links with
their egress against capacity and budget. Inventory from ``clusters``, live state and guards
from the overview selectors."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_POST

from clusters.models import Link
from clusters.selectors import cluster_list, instance_list, link_list
from clusters.services import instance_activate, instance_drain
from controlplane.audit import actor_from_request
from controlplane.errors import ApiError
from controlplane.models import TokenScope
from controlplane.roles import scope_required
from scheduling import overview


@scope_required(TokenScope.READ)
def cluster_list_page(request: HttpRequest) -> HttpResponse:
    return render(request, "clusters/cluster_list.html", {"clusters": overview.clusters_overview()})


@scope_required(TokenScope.READ)
def cluster_detail_page(request: HttpRequest, cluster_id: int) -> HttpResponse:
    cluster = get_object_or_404(cluster_list(), pk=cluster_id)
    row = next(c for c in overview.clusters_overview() if c["id"] == cluster.pk)
    return render(request, "clusters/cluster_detail.html", {"cluster": cluster, "overview": row})


@scope_required(TokenScope.OPERATE)
@require_POST
def instance_state_page(request: HttpRequest, instance_id: str, action: str) -> HttpResponse:
    """Drain or activate one instance; answers with its table row (htmx swaps it in)."""
    instance = get_object_or_404(instance_list(), pk=int(instance_id))
    change = {"drain": instance_drain, "activate": instance_activate}[action]
    error = ""
    try:
        instance = change(
            instance_id=instance.pk,
            actor=actor_from_request(request, source="ui"),
            version=_version(request),
        )
    except ApiError as exc:
        error = exc.detail
    row = next(
        i
        for c in overview.clusters_overview()
        if c["id"] == instance.cluster_id
        for i in c["instances"]
        if i["id"] == instance.pk
    )
    return render(
        request,
        "clusters/instance_row.html",
        {"i": row, "error": error},
        status=409 if error else 200,
    )


def _version(request: HttpRequest) -> int | None:
    raw = request.POST.get("version", "")
    return int(raw) if raw.isdigit() else None


@scope_required(TokenScope.READ)
def link_list_page(request: HttpRequest) -> HttpResponse:
    _, _, guards = overview.guards_current()
    return render(
        request, "clusters/link_list.html", {"links": overview.links_overview(guards, window_s=0)}
    )


@scope_required(TokenScope.READ)
def link_detail_page(request: HttpRequest, link_id: int) -> HttpResponse:
    link: Link = get_object_or_404(link_list(), pk=link_id)
    history = overview.link_history(link)
    predicted = history["predicted_refused_share"]
    return render(
        request,
        "clusters/link_detail.html",
        {
            "link": history,
            "predicted_share": None if predicted is None else f"{predicted:.0%}",
        },
    )
