"""Reads for access and audit: tokens (never their secrets) and change records."""

from __future__ import annotations

from django.db.models import QuerySet

from controlplane.models import ApiToken, ChangeRecord


def token_list() -> QuerySet[ApiToken]:
    return ApiToken.objects.order_by("name", "id")


def change_record_list(
    *,
    object_type: str | None = None,
    object_id: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    request_id: str | None = None,
) -> QuerySet[ChangeRecord]:
    """Newest first; every filter given narrows the list."""
    filters = {
        "object_type": object_type,
        "object_id": object_id,
        "action": action,
        "actor": actor,
        "request_id": request_id,
    }
    return ChangeRecord.objects.filter(
        **{k: v for k, v in filters.items() if v is not None}
    ).order_by("-at", "-id")
