"""Access and accountability: API tokens and the immutable change log."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from django.db import models
from django.db.models import Q


class TokenScope(models.TextChoices):
    """What a token may do. ``admin`` implies every other scope."""

    ROUTER = "router", "router: ask for routing decisions and read the policy"
    AGENT = "agent", "agent: post telemetry and KV events"
    REGISTER = "register", "register: register the instances an agent runs beside"
    READ = "read", "read: read inventory, plans and audit"
    OPERATE = "operate", "operate: drain/activate instances, approve plans"
    ADMIN = "admin", "admin: everything, including inventory writes"


class ApiToken(models.Model):
    """A credential a machine (router, agent, script) presents as ``Authorization: Bearer``.

    Only the sha256 of the secret is stored; the secret is shown once, at creation. ``prefix``
    is the first characters of the token: not secret, enough to tell tokens apart in lists.

    The binding confines what an ``agent`` token reports for: ``instances`` (instance names)
    and ``links`` (``source->target``, cluster names), the hosts the agent runs beside, and
    ``clusters``: every instance of those clusters, including ones registered later. Samples,
    KV events and clears for anything else get 403. A ``register`` token registers instances
    into its ``clusters`` only. ``fleet_wide`` lifts the binding (an emulator, a central
    scraper; tokens made before bindings existed were migrated fleet-wide); a new agent or
    register token is either bound or explicitly fleet-wide. ``admin`` tokens are fleet-wide
    by their scope.
    """

    name = models.CharField(max_length=100, unique=True)
    prefix = models.CharField(max_length=16, db_index=True)
    secret_sha256 = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list, help_text="list of scopes among TokenScope values")
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        "auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="api_tokens"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    instances = models.JSONField(
        default=list, blank=True, help_text="instance names an agent token reports for"
    )
    links = models.JSONField(
        default=list, blank=True, help_text="links (source->target) an agent token reports for"
    )
    clusters = models.JSONField(
        default=list,
        blank=True,
        help_text="clusters whose instances an agent token reports for and registers",
    )
    fleet_wide = models.BooleanField(
        default=False, help_text="an agent token that may report for every instance and link"
    )

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.CheckConstraint(condition=~Q(name=""), name="apitoken_name_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...)"


class ChangeRecordQuerySet(models.QuerySet["ChangeRecord"]):
    def update(self, **kwargs: Any) -> int:
        raise PermissionError("change records are immutable")

    def delete(self) -> tuple[int, dict[str, int]]:
        raise PermissionError("change records are immutable")


class ChangeRecord(models.Model):
    """One change to the deployment, who made it and from where: written by every mutating
    API call, admin change, topology apply and token operation, never updated or deleted.

    The actor is kept as text and plain ids rather than foreign keys so that deleting a user
    or a token can never rewrite history.
    """

    class Action(models.TextChoices):
        CREATE = "create"
        UPDATE = "update"
        DELETE = "delete"
        DRAIN = "drain"
        ACTIVATE = "activate"
        REVOKE = "revoke"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=200, help_text="user:NAME, token:NAME or cli")
    actor_user_id = models.BigIntegerField(null=True, blank=True)
    actor_token_id = models.BigIntegerField(null=True, blank=True)
    source = models.CharField(max_length=20, help_text="api, admin, cli or topology")
    request_id = models.CharField(max_length=64, blank=True, default="", db_index=True)
    object_type = models.CharField(max_length=100, help_text="app_label.model")
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=300)
    action = models.CharField(max_length=20, choices=Action.choices)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    cause = models.CharField(
        max_length=300, blank=True, default="", help_text="why, when the actor is not a person"
    )

    objects: ClassVar[ChangeRecordQuerySet] = ChangeRecordQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"], name="changerecord_object")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_type} {self.object_repr}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise PermissionError("change records are immutable")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise PermissionError("change records are immutable")


def token_hash(token: str) -> str:
    """sha256 of the whole token: a high-entropy secret needs no salt or slow hash."""
    return hashlib.sha256(token.encode()).hexdigest()
