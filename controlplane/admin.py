"""Admin for tokens (list, revoke; never the secret) and the change log (read-only)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.audit import actor_from_request
from controlplane.models import ApiToken, ChangeRecord
from controlplane.services import token_revoke


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created with ``manage.py token create`` (the secret is printed once there)."""

    list_display = ("name", "prefix", "scopes", "expires_at", "revoked_at", "last_used_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix")
    actions = ("revoke",)
    readonly_fields = (
        "name",
        "prefix",
        "scopes",
        "created_at",
        "created_by",
        "expires_at",
        "revoked_at",
        "last_used_at",
    )
    exclude = ("secret_sha256",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        actor = actor_from_request(request, source="admin")
        for token in queryset:
            token_revoke(name=token.name, actor=actor)
        messages.success(request, f"revoked {queryset.count()} token(s)")


@admin.register(ChangeRecord)
class ChangeRecordAdmin(admin.ModelAdmin):
    list_display = ("at", "actor", "source", "action", "object_type", "object_repr", "request_id")
    list_filter = ("action", "source", "object_type")
    search_fields = ("object_repr", "object_id", "actor", "request_id")
    date_hierarchy = "at"

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [f.name for f in ChangeRecord._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
