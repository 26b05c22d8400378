"""Who may do what on the operator pages: the same groups and scopes as the API.

Viewers (``read``) see every page but the tokens page; operators (``operate``) also drain,
activate and decide on plans; admins (``admin``) alone see and manage tokens. Pages hide the buttons a user may not press, and
the views refuse the request anyway (403), so a hand-made POST gets nowhere either.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

from controlplane.auth import user_scopes
from controlplane.models import TokenScope

View = Callable[..., HttpResponse]


def user_has_scope(user: Any, scope: str) -> bool:
    if not user.is_authenticated:
        return False
    scopes = user_scopes(user)
    return scope in scopes or TokenScope.ADMIN in scopes


def scope_required(scope: str) -> Callable[[View], View]:
    """Log-in required; then 403 unless the user holds ``scope`` (through a group)."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not user_has_scope(request.user, scope):
                raise PermissionDenied(f"this needs the {scope} role")
            return view(request, *args, **kwargs)

        return login_required(wrapped)

    return decorate


def roles(request: HttpRequest) -> dict[str, bool]:
    """Template context: what the current user may do (hides buttons, never the only check)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"can_read": False, "can_operate": False, "can_admin": False}
    scopes = user_scopes(user)
    admin = TokenScope.ADMIN in scopes
    return {
        "can_read": admin or TokenScope.READ in scopes,
        "can_operate": admin or TokenScope.OPERATE in scopes,
        "can_admin": admin,
    }
