"""Page forms of the control plane app, and how service errors land next to their field."""

from __future__ import annotations

from django import forms

from controlplane.errors import ApiError
from controlplane.models import TokenScope


def service_error_add(form: forms.Form, exc: ApiError) -> None:
    """Show a service's error next to the field it names (``"field: message"``), else on top."""
    field, sep, message = exc.detail.partition(":")
    field = field.strip()
    if sep and field in form.fields:
        form.add_error(field, message.strip())
    else:
        form.add_error(None, exc.detail)


def names_split(text: str) -> list[str]:
    """Names typed one per line or separated by commas."""
    return [n.strip() for n in text.replace(",", "\n").splitlines() if n.strip()]


class BindingFields(forms.Form):
    """What an agent token reports for: the fields shared by creating and re-binding."""

    instances = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="agent tokens: instance names, one per line or comma-separated",
    )
    clusters = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="agent and register tokens: clusters whose instances it reports for and "
        "registers",
    )
    links = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="agent tokens: links as source->target (cluster names, as the pages write them)",
    )
    fleet_wide = forms.BooleanField(
        required=False,
        label="Fleet-wide",
        help_text="an agent token that may report for every instance and link",
    )

    def clean_instances(self) -> list[str]:
        return names_split(self.cleaned_data["instances"])

    def clean_clusters(self) -> list[str]:
        return names_split(self.cleaned_data["clusters"])

    def clean_links(self) -> list[str]:
        return names_split(self.cleaned_data["links"])


class TokenBindingForm(BindingFields):
    """A token's new binding (it replaces the old one)."""

    name = forms.CharField(max_length=100, label="Token", help_text="the token's name")
    field_order = ["name", "instances", "clusters", "links", "fleet_wide"]


class TokenForm(BindingFields):
    """A new API token: its name, scopes, optional lifetime and (agents) binding."""

    name = forms.CharField(max_length=100, help_text="e.g. router-eu-1; unique")
    scopes = forms.MultipleChoiceField(
        choices=TokenScope.choices, widget=forms.CheckboxSelectMultiple, help_text="at least one"
    )
    expires_in_days = forms.FloatField(
        required=False, min_value=0.01, label="Expires in (days)", help_text="empty: never"
    )

    field_order = [
        "name",
        "scopes",
        "expires_in_days",
        "instances",
        "clusters",
        "links",
        "fleet_wide",
    ]

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("must not be empty")
        return name


class AuditFilterForm(forms.Form):
    """Filters of the audit log; every one given narrows the list."""

    object_type = forms.CharField(required=False, max_length=100, label="Object type")
    action = forms.CharField(required=False, max_length=20)
    actor = forms.CharField(required=False, max_length=200)
    request_id = forms.CharField(required=False, max_length=64, label="Request id")
