"""Pages of the control plane app: audit log, API tokens."""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from controlplane.audit import actor_from_request
from controlplane.errors import ApiError
from controlplane.forms import AuditFilterForm, TokenBindingForm, TokenForm, service_error_add
from controlplane.models import TokenScope
from controlplane.roles import scope_required
from controlplane.selectors import change_record_list, token_list
from controlplane.services import IssuedToken, token_bind, token_create, token_revoke

AUDIT_PAGE_SIZE = 50
# The binding form shares field names with the token form on one page: its ids differ.
BIND_PREFIX = "bind"


@scope_required(TokenScope.READ)
def audit_list(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None)
    filters = {k: v for k, v in form.cleaned_data.items() if v} if form.is_valid() else {}
    page = Paginator(change_record_list(**filters), AUDIT_PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    return render(request, "controlplane/audit_list.html", {"form": form, "page": page})


@scope_required(TokenScope.ADMIN)
def token_list_page(request: HttpRequest) -> HttpResponse:
    return _tokens_render(request, TokenForm())


@scope_required(TokenScope.ADMIN)
@require_POST
def token_create_page(request: HttpRequest) -> HttpResponse:
    form = TokenForm(request.POST)
    if form.is_valid():
        try:
            issued = token_create(
                **form.cleaned_data,
                actor=actor_from_request(request, source="ui"),
                created_by=request.user,  # type: ignore[arg-type]
            )
        except ApiError as exc:
            service_error_add(form, exc)
        else:
            return _tokens_render(request, TokenForm(), issued=issued, status=201)
    return _tokens_render(request, form, status=422)


@scope_required(TokenScope.ADMIN)
@require_POST
def token_revoke_page(request: HttpRequest, name: str) -> HttpResponse:
    try:
        token_revoke(name=name, actor=actor_from_request(request, source="ui"))
        messages.success(request, f"Token {name} revoked.")
    except ApiError as exc:
        messages.error(request, exc.detail)
    return redirect("token-list")


@scope_required(TokenScope.ADMIN)
@require_POST
def token_bind_page(request: HttpRequest) -> HttpResponse:
    form = TokenBindingForm(request.POST, prefix=BIND_PREFIX)
    if form.is_valid():
        try:
            token_bind(**form.cleaned_data, actor=actor_from_request(request, source="ui"))
        except ApiError as exc:
            service_error_add(form, exc)
        else:
            messages.success(request, f"Token {form.cleaned_data['name']} bound.")
            return redirect("token-list")
    return _tokens_render(request, TokenForm(), bind_form=form, status=422)


def _tokens_render(
    request: HttpRequest,
    form: TokenForm,
    issued: IssuedToken | None = None,
    status: int = 200,
    bind_form: TokenBindingForm | None = None,
) -> HttpResponse:
    context = {
        "form": form,
        "tokens": token_list(),
        "issued": issued,
        "bind_form": bind_form or TokenBindingForm(prefix=BIND_PREFIX),
    }
    return render(request, "controlplane/token_list.html", context, status=status)
