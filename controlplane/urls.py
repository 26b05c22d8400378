"""URL map: pages, admin, the versioned API and its docs."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView

from controlplane import views as pages
from controlplane.api import api
from scheduling.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics_view, name="metrics"),
    path("api/docs", RedirectView.as_view(url="/api/v1/docs", permanent=False)),
    # Operator pages.
    # Log in and out, and change one's own password. No self-service password reset: accounts
    # are made by an admin (`manage.py createsuperuser`, the admin), who also resets them.
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path(
        "accounts/password_change/",
        auth_views.PasswordChangeView.as_view(),
        name="password_change",
    ),
    path(
        "accounts/password_change/done/",
        auth_views.PasswordChangeDoneView.as_view(),
        name="password_change_done",
    ),
    path("audit/", pages.audit_list, name="audit-list"),
    path("tokens/", pages.token_list_page, name="token-list"),
    path("tokens/new/", pages.token_create_page, name="token-create"),
    path("tokens/bind/", pages.token_bind_page, name="token-bind"),
    path("tokens/<str:name>/revoke/", pages.token_revoke_page, name="token-revoke"),
    path("", include("scheduling.urls")),
]
