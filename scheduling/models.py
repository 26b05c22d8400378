"""Django side of scheduling: the versioned routing policy routers obey."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class Policy(models.Model):
    """One version of the routing parameters every router obeys.

    ``thresholds`` maps each PD cluster (by name) to its threshold ``t`` in tokens: a request
    whose incremental length is above ``t`` is offloaded to a PrfaaS cluster. A PD cluster
    missing from the map never offloads. ``guards`` overrides the short-term control
    parameters of :class:`scheduling.router.Guards` (congestion, backlog, staleness, cache
    transfers). Versions only grow; the current policy is the highest version. Rows are never
    edited: a change is a new version, so any decision can be traced to the policy it used.
    """

    version = models.PositiveIntegerField(unique=True)
    thresholds = models.JSONField(default=dict, help_text="{pd cluster name: tokens}")
    guards = models.JSONField(default=dict, blank=True, help_text="overrides of router guards")
    created_by = models.CharField(max_length=200, help_text="actor: user, token or cli")
    created_at = models.DateTimeField(auto_now_add=True)
    note = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-version"]
        verbose_name_plural = "policies"
        constraints = [
            models.CheckConstraint(condition=Q(version__gte=1), name="policy_version_positive"),
        ]

    def __str__(self) -> str:
        return f"policy v{self.version}"
