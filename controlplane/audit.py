"""The change log: who changed what, from where, with the object before and after.

Services take an :class:`Actor` and call :func:`change_record_create` inside their transaction,
so a change and its record commit or roll back together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.http import HttpRequest

from controlplane.models import ChangeRecord


@dataclass(frozen=True)
class Actor:
    """Whoever makes a change: a user, a token or the command line, and the request id."""

    label: str
    source: str
    user_id: int | None = None
    token_id: int | None = None
    request_id: str = ""


CLI_ACTOR = Actor(label="cli", source="cli")


def actor_from_request(request: HttpRequest, *, source: str = "api") -> Actor:
    """The actor of an API or admin request: the token (``request.auth``) or the session user."""
    request_id = getattr(request, "request_id", "") or ""
    principal = getattr(request, "auth", None)
    token_id = getattr(principal, "token_id", None)
    if token_id is not None:
        return Actor(
            label=f"token:{principal.name}",  # type: ignore[union-attr]
            source=source,
            token_id=token_id,
            request_id=request_id,
        )
    user_id = getattr(principal, "user_id", None)
    if user_id is not None:
        # Session caller already resolved by the auth class: no lazy request.user (async-safe).
        return Actor(
            label=f"user:{principal.name}",  # type: ignore[union-attr]
            source=source,
            user_id=user_id,
            request_id=request_id,
        )
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return Actor(
            label=f"user:{user.get_username()}",
            source=source,
            user_id=user.pk,
            request_id=request_id,
        )
    return Actor(label="anonymous", source=source, request_id=request_id)


def snapshot(obj: models.Model) -> dict[str, Any]:
    """The object's stored fields as JSON-ready values (foreign keys as ids)."""
    data = {field.attname: field.value_from_object(obj) for field in obj._meta.concrete_fields}
    loaded: dict[str, Any] = json.loads(json.dumps(data, cls=DjangoJSONEncoder))
    return loaded


def change_record_create(
    *,
    actor: Actor,
    action: str,
    obj: models.Model,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    object_id: Any = None,
    cause: str = "",
) -> ChangeRecord:
    """Write one immutable change record (call it inside the change's transaction);
    ``cause``: why, when no person decided it (a registration, a missed heartbeat)."""
    meta = obj._meta
    return ChangeRecord.objects.create(
        actor=actor.label[:200],
        actor_user_id=actor.user_id,
        actor_token_id=actor.token_id,
        source=actor.source,
        request_id=actor.request_id[:64],
        object_type=f"{meta.app_label}.{meta.model_name}",
        object_id=str(obj.pk if object_id is None else object_id),
        object_repr=str(obj)[:300],
        action=action,
        before=before,
        after=after,
        cause=cause[:300],
    )
