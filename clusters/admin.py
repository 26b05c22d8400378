"""Admin for the inventory. Saves and deletes go through the inventory services, so the admin
obeys the same rules, bumps versions and writes change records like the API.

The form carries the version it was rendered with: saving over someone else's newer change is
refused with the 409 message instead of silently overwriting it.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect

from clusters.models import (
    Accelerator,
    Cluster,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    Versioned,
)
from clusters.services import inventory_admin_delete, inventory_admin_save
from controlplane.audit import actor_from_request
from controlplane.errors import ApiError


class VersionedForm(forms.ModelForm):
    expected_version = forms.IntegerField(widget=forms.HiddenInput, required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None and not self.is_bound:
            self.fields["expected_version"].initial = self.instance.version


class VersionedAdmin(admin.ModelAdmin):
    form = VersionedForm
    readonly_fields = ("version", "created_at", "updated_at")

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        try:
            saved = inventory_admin_save(
                obj=obj,
                is_new=not change,
                actor=actor_from_request(request, source="admin"),
                version=form.cleaned_data.get("expected_version"),
            )
        except ApiError as exc:
            # The admin has no error path after form validation; report and keep the row as is.
            messages.error(request, f"not saved: {exc.detail}")
            raise _AdminRefused from exc
        obj.pk, obj.version = saved.pk, saved.version

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        try:
            inventory_admin_delete(obj=obj, actor=actor_from_request(request, source="admin"))
        except ApiError as exc:
            messages.error(request, f"not deleted: {exc.detail}")
            raise _AdminRefused from exc

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Versioned]) -> None:
        for obj in queryset:
            self.delete_model(request, obj)

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().changeform_view(request, *args, **kwargs)
        except _AdminRefused:
            return _back(request)

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().delete_view(request, *args, **kwargs)
        except _AdminRefused:
            return _back(request)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        try:
            return super().changelist_view(request, extra_context)
        except _AdminRefused:
            return _back(request)


class _AdminRefused(Exception):
    """A service refused an admin write (message already queued for the user)."""


def _back(request: HttpRequest) -> Any:
    return HttpResponseRedirect(request.get_full_path())


@admin.register(Site)
class SiteAdmin(VersionedAdmin):
    list_display = ("name", "description", "version", "updated_at")
    search_fields = ("name",)


@admin.register(Accelerator)
class AcceleratorAdmin(VersionedAdmin):
    list_display = ("name", "gpu_hour_cost", "version", "updated_at")
    search_fields = ("name",)


@admin.register(ModelProfile)
class ModelProfileAdmin(VersionedAdmin):
    list_display = ("name", "block_tokens", "linear_state_mib", "version", "updated_at")
    search_fields = ("name",)


@admin.register(PerformanceProfile)
class PerformanceProfileAdmin(VersionedAdmin):
    list_display = (
        "accelerator",
        "model",
        "gpus_per_instance",
        "decode_max_batch",
        "decode_step_seconds",
        "version",
    )
    list_filter = ("accelerator", "model")


@admin.register(Cluster)
class ClusterAdmin(VersionedAdmin):
    list_display = ("name", "kind", "site", "accelerator", "model", "version", "updated_at")
    list_filter = ("kind", "site", "accelerator", "model")
    search_fields = ("name",)


@admin.register(Instance)
class InstanceAdmin(VersionedAdmin):
    list_display = ("name", "cluster", "role", "state", "endpoint", "version", "updated_at")
    list_filter = ("state", "role", "cluster__kind", "cluster")
    search_fields = ("name", "endpoint")


@admin.register(Link)
class LinkAdmin(VersionedAdmin):
    list_display = (
        "source",
        "target",
        "gbps",
        "rtt_ms",
        "kv_budget_bytes",
        "target_utilisation",
        "version",
    )
    list_filter = ("source", "target")
